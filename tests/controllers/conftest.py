"""Builders for planner tests: InferenceDeployment dicts, pods in given states, and a tiny fake cluster that
applies plans so multi-pass behaviour (convergence, drains, rollouts) can be checked without an API server.

Tests get them through the `kit` fixture (test modules cannot import this file by name under importlib mode)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from controllers import (
    CreatePod,
    DeletePdb,
    DeletePod,
    DrainProbe,
    EnsureNetworkPolicy,
    EnsurePdb,
    EnsureService,
    Observed,
    PatchStatus,
    Plan,
    ProbeState,
    RemoveAnnotations,
    StartDrain,
    reconcile,
)
from controllers.draining import mark_patch
from controllers.reconcile import Policy
from crds.models import AnalysisResult
from localkube.patches import merge_patch  # as the API server applies it

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
UID = "uid-1"


def make_resource(spec: Mapping[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """An InferenceDeployment as the API returns it; `spec` is merged over a minimal valid spec."""
    base_spec: dict[str, Any] = {
        "model": {"name": "smollm2", "source": "bundled://smollm2-135m-instruct"},
        "variants": [{"name": "default"}],
    }
    base_spec.update(spec or {})
    resource: dict[str, Any] = {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "smollm2", "namespace": "default", "uid": UID, "generation": 1},
        "spec": base_spec,
    }
    resource.update(overrides)
    return resource


def pod_object(
    manifest: Mapping[str, Any],
    *,
    ready: bool = True,
    phase: str = "Running",
    age_s: float = 60,
    deleting: bool = False,
    waiting: str | None = None,
    ip: str | None = "10.0.0.1",
) -> dict[str, Any]:
    """A pod as the API would return it after `manifest` was created and the kubelet ran it."""
    pod = copy.deepcopy(dict(manifest))
    pod["metadata"]["uid"] = "uid-" + pod["metadata"]["name"]
    pod["metadata"]["creationTimestamp"] = (NOW - timedelta(seconds=age_s)).isoformat().replace("+00:00", "Z")
    if deleting:
        pod["metadata"]["deletionTimestamp"] = NOW.isoformat().replace("+00:00", "Z")
    container: dict[str, Any] = {"name": "worker", "ready": ready, "restartCount": 0, "state": {}}
    if waiting:
        container["state"] = {"waiting": {"reason": waiting}}
    pod["status"] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [container],
    }
    if ip is not None:
        pod["status"]["podIP"] = ip
    return pod


@dataclass
class FakeCluster:
    """Pods and the CR, changed only by applying plans (plus the test's own pokes).

    Draining pods answer the drain probe with `in_flight[name]` requests in flight (0 unless a test sets it), so
    by default a drain finishes on the pass after it started. `analysis` is handed to the next pass only (as the
    operator's analysis runner would), and `now` is the pass's time."""

    resource: dict[str, Any]
    policy: Policy = field(default_factory=Policy)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    network_policy: dict[str, Any] | None = None
    service: dict[str, Any] | None = None
    pdbs: dict[str, dict[str, Any]] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    posts: list[str] = field(default_factory=list)  # pods that were sent POST /drain, in order
    analysis: AnalysisResult | None = None
    metrics_since: datetime | None = None  # the canary's metrics series appeared: handed to the next pass only
    now: datetime = NOW
    clock: int = 0

    def observed(self) -> Observed:
        probes = {
            name: DrainProbe(ProbeState.ANSWERED, draining=name in self.posts, in_flight=self.in_flight.get(name, 0))
            for name, pod in self.pods.items()
            if "llmfleet.io/draining" in (pod["metadata"].get("labels") or {})
        }
        analysis, self.analysis = self.analysis, None
        metrics_since, self.metrics_since = self.metrics_since, None
        observed = Observed.from_objects(
            self.pods.values(),
            self.service,
            self.network_policy,
            drain_probes=probes,
            pdbs=self.pdbs.values(),
            analysis=analysis,
        )
        return replace(observed, canary_metrics_since=metrics_since)

    def plan(self) -> Plan:
        return reconcile(self.resource, self.observed(), self.now, self.policy)

    def apply(self, plan: Plan, *, ready: bool = True) -> None:
        """Creates become pods (ready or not), drains mark pods, deletes remove pods at once, patches land."""
        for action in plan.actions:
            if isinstance(action, CreatePod):
                self.clock += 1
                assert action.name not in self.pods, f"duplicate create of {action.name}"
                self.pods[action.name] = pod_object(action.manifest, ready=ready, age_s=1000 - self.clock)
            elif isinstance(action, DeletePod):
                assert self.pods[action.name]["metadata"]["uid"] == action.uid
                del self.pods[action.name]
            elif isinstance(action, StartDrain):
                pod = self.pods[action.name]
                if action.mark:
                    pod["metadata"] = merge_patch(pod["metadata"], mark_patch(action)["metadata"])
                self.posts.append(action.name)
            elif isinstance(action, PatchStatus):
                self.resource["status"] = merge_patch(self.resource.get("status") or {}, dict(action.status))
            elif isinstance(action, EnsureNetworkPolicy):
                self.network_policy = copy.deepcopy(dict(action.manifest))
            elif isinstance(action, EnsureService):
                self.service = dict(action.manifest)
            elif isinstance(action, EnsurePdb):
                self.pdbs[action.name] = copy.deepcopy(dict(action.manifest))
            elif isinstance(action, DeletePdb):
                del self.pdbs[action.name]
            elif isinstance(action, RemoveAnnotations):
                annotations = self.resource["metadata"].get("annotations") or {}
                for key in action.keys:
                    annotations.pop(key, None)

    def set_ready(self, name: str, ready: bool = True) -> None:
        pod = self.pods[name]
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]

    def converge(
        self, *, ready: bool = True, passes: int = 20, check: Callable[[FakeCluster], None] | None = None
    ) -> int:
        """Plan/apply until a plan changes no pods; returns the passes used. `check` runs after each pass."""
        for used in range(1, passes + 1):
            plan = self.plan()
            changes = plan.of_type(CreatePod) + plan.of_type(DeletePod) + plan.of_type(StartDrain)
            self.apply(plan, ready=ready)
            if check is not None:
                check(self)
            if not changes:
                return used
        raise AssertionError(f"no convergence in {passes} passes")

    def pods_by_revision(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for pod in self.pods.values():
            rev = pod["metadata"]["labels"]["llmfleet.io/revision"]
            counts[rev] = counts.get(rev, 0) + 1
        return counts


def build_cluster(spec: Mapping[str, Any] | None = None, policy: Policy | None = None) -> FakeCluster:
    return FakeCluster(make_resource(spec), policy or Policy())


@pytest.fixture
def kit() -> SimpleNamespace:
    return SimpleNamespace(
        now=NOW,
        uid=UID,
        resource=make_resource,
        pod=pod_object,
        cluster=build_cluster,
        reconcile=reconcile,
        merge_patch=merge_patch,
    )
