"""What the operator saw in the cluster, as plain immutable data: the planner's only view of the world.

The operator's shell reads the worker pods (by label), the Service, the NetworkPolicy and the
PodDisruptionBudgets of one InferenceDeployment, asks draining pods how their drain goes (`DrainProbe`) and runs a
canary analysis check when one is due, and turns all that into an `Observed` with `Observed.from_objects`;
`reconcile` never touches the API or the pods. Pods are summarised into `PodInfo` (phase, readiness, revision,
age, failure signs, drain marks) so that the planning rules read like the rules they implement, and so that tests
can build observations in one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from crds.models import AnalysisResult
from crds.pods import (
    DRAIN_DEADLINE,
    DRAIN_REASON,
    DRAINING,
    LABEL_REVISION,
    LABEL_VARIANT,
    is_draining,
    is_ready,
)

# Container waiting reasons that mean the pod will not become ready without help.
STUCK_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


class PodPhase(StrEnum):
    """Kubernetes pod phases."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


@dataclass(frozen=True)
class PodInfo:
    """One worker pod, reduced to what planning needs."""

    name: str
    uid: str = ""
    variant: str | None = None
    revision: str | None = None
    phase: PodPhase = PodPhase.PENDING
    ready: bool = False
    created_at: datetime | None = None
    deleting: bool = False  # metadata.deletionTimestamp is set: the pod is already going away
    draining: bool = False  # marked llmfleet.io/draining (`crds.pods.is_draining`)
    restarts: int = 0
    waiting_reason: str | None = None  # e.g. CrashLoopBackOff
    message: str = ""  # why the pod failed, when it did
    owner_uid: str | None = None  # uid of its controller ownerReference
    in_flight: int | None = None  # requests in flight, when the shell measured them
    ip: str | None = None  # status.podIP
    draining_since: datetime | None = None  # when its drain started (annotation), if draining
    drain_deadline: datetime | None = None  # when it is deleted even with requests in flight (annotation)
    drain_reason: str | None = None  # why it is drained (annotation), e.g. ScaleDown

    @property
    def failed(self) -> bool:
        """The pod has ended (Failed or Succeeded) and will never serve again: it must be replaced."""
        return self.phase in (PodPhase.FAILED, PodPhase.SUCCEEDED)

    @property
    def live(self) -> bool:
        """The pod counts towards its variant's size: not going away (deleted or draining) and not ended."""
        return not self.deleting and not self.draining and not self.failed

    @property
    def stuck(self) -> bool:
        """A container is waiting for a reason that does not clear by itself (crash loop, bad image, config)."""
        return self.waiting_reason in STUCK_REASONS

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodInfo:
        """Summarise a Pod object (a dict as the API returns it)."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        status = pod.get("status") or {}
        containers = status.get("containerStatuses") or []
        waiting = [
            ((c.get("state") or {}).get("waiting") or {}).get("reason") for c in containers if isinstance(c, Mapping)
        ]
        owner_uid = next(
            (ref.get("uid") for ref in meta.get("ownerReferences") or [] if ref.get("controller")),
            None,
        )
        try:
            phase = PodPhase(status.get("phase") or PodPhase.PENDING)
        except ValueError:
            phase = PodPhase.UNKNOWN
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            variant=labels.get(LABEL_VARIANT),
            revision=labels.get(LABEL_REVISION),
            phase=phase,
            ready=is_ready(pod),
            created_at=parse_time(meta.get("creationTimestamp")),
            deleting=meta.get("deletionTimestamp") is not None,
            draining=is_draining(pod),
            restarts=sum(int(c.get("restartCount") or 0) for c in containers if isinstance(c, Mapping)),
            waiting_reason=next((reason for reason in waiting if reason), None),
            message=str(status.get("message") or status.get("reason") or ""),
            owner_uid=owner_uid,
            ip=status.get("podIP") or None,
            draining_since=parse_time(annotations.get(DRAINING)),
            drain_deadline=parse_time(annotations.get(DRAIN_DEADLINE)),
            drain_reason=annotations.get(DRAIN_REASON),
        )


class ProbeState(StrEnum):
    """How a draining pod answered `GET /drain`."""

    ANSWERED = "Answered"  # a drain state came back
    UNREACHABLE = "Unreachable"  # nothing listens (the worker exited after draining, or the pod has no IP)
    FAILED = "Failed"  # an error or timeout that may pass: ask again next pass


@dataclass(frozen=True)
class DrainProbe:
    """What the shell learnt from a draining pod's `GET /drain`."""

    state: ProbeState
    draining: bool = False  # the worker is in lame-duck mode
    in_flight: int | None = None  # requests still in flight
    detail: str = ""  # error text, for messages


@dataclass(frozen=True)
class AdapterProbe:
    """What a pod's worker said it serves (`GET /v1/models`: the entries with a `parent`)."""

    state: ProbeState
    adapters: frozenset[str] = frozenset()
    detail: str = ""


@dataclass(frozen=True)
class AdapterResult:
    """The answer to a load sent last pass: `error` None when the worker accepted it."""

    pod: str
    adapter: str
    source: str
    error: str | None = None


@dataclass(frozen=True)
class Observed:
    """Everything observed about one InferenceDeployment's children, plus what went wrong last time."""

    pods: tuple[PodInfo, ...] = ()
    service: Mapping[str, Any] | None = None  # the workers' Service, if it exists
    network_policy: Mapping[str, Any] | None = None  # the workers' NetworkPolicy, if it exists (and is managed)
    errors: tuple[str, ...] = ()  # API errors of the previous pass (shown as the Degraded condition)
    drain_probes: Mapping[str, DrainProbe] = field(default_factory=dict)  # pod name -> GET /drain of draining pods
    pdbs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> the operator's PodDisruptionBudgets
    analysis: AnalysisResult | None = None  # a canary analysis check the shell ran for this pass, if one was due
    canary_metrics_since: datetime | None = None  # the running canary's metrics series appeared (found this pass)
    adapter_probes: Mapping[str, AdapterProbe] = field(default_factory=dict)  # pod name -> GET /v1/models
    adapter_results: tuple[AdapterResult, ...] = ()  # answers to the adapter loads of the previous pass

    @classmethod
    def from_objects(
        cls,
        pods: Iterable[Mapping[str, Any]],
        service: Mapping[str, Any] | None = None,
        network_policy: Mapping[str, Any] | None = None,
        errors: Iterable[str] = (),
        *,
        drain_probes: Mapping[str, DrainProbe] | None = None,
        pdbs: Iterable[Mapping[str, Any]] = (),
        analysis: AnalysisResult | None = None,
    ) -> Observed:
        """Build from API objects (dicts): the labelled pods, the Service and the NetworkPolicy (None when absent),
        the PodDisruptionBudgets; plus what the shell measured (drain probes, a canary analysis check)."""
        return cls(
            pods=tuple(PodInfo.from_pod(pod) for pod in pods),
            service=service,
            network_policy=network_policy,
            errors=tuple(errors),
            drain_probes=dict(drain_probes or {}),
            pdbs={str((pdb.get("metadata") or {}).get("name", "")): pdb for pdb in pdbs},
            analysis=analysis,
        )


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp from the API (`2024-05-01T12:00:00Z`) -> aware datetime; None when absent or bad."""
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None
