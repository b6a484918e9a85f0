"""Read one InferenceDeployment and its children fresh from the API server, for one reconcile pass.

Every pass reads the CR, its pods (by the `llmfleet.io/deployment` label), its Service, its NetworkPolicy (when the
operator manages them) and its PodDisruptionBudgets directly (in parallel) instead of trusting a watch cache: a list from the API server
already shows the pods the previous pass created, so the planner never creates a pod twice because its view was
stale, and an operator restart needs no warm-up. Pods marked draining are then asked how their drain goes
(`GET /drain`, see `drain_client`). When the deployment serves LoRA adapters, its ready pods are asked which
adapters they serve (`GET /v1/models`) and the answers to the previous pass's loads are picked up
(`adapter_client`). No Secret is read: drain tokens are derived from the operator's key
(`controllers.drain_token`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from controllers import Observed
from controllers.network import network_policy_name
from controllers.pods import label_selector, service_name
from crds.models import GROUP, PLURAL, VERSION
from crds.pods import WORKER_PORT
from fleet_operator.adapter_client import WorkerAdapters, serves_adapters
from fleet_operator.drain_client import WorkerDrains
from fleet_operator.kube import KubeApi, namespaced


def deployment_path(namespace: str, name: str) -> str:
    return namespaced(namespace, PLURAL, name, group=GROUP, version=VERSION)


def network_policies_path(namespace: str, name: str | None = None) -> str:
    return namespaced(namespace, "networkpolicies", name, group="networking.k8s.io", version="v1")


def pdbs_path(namespace: str, name: str | None = None) -> str:
    return namespaced(namespace, "poddisruptionbudgets", name, group="policy", version="v1")


@dataclass(frozen=True)
class Observation:
    """One pass's reading: the CR (None when it is gone), the planner's view, and the raw pods (for metrics)."""

    resource: dict[str, Any] | None
    observed: Observed
    pods: list[dict[str, Any]]


async def observe(
    api: KubeApi,
    namespace: str,
    name: str,
    errors: Iterable[str] = (),
    *,
    drains: WorkerDrains | None = None,
    adapters: WorkerAdapters | None = None,
    port: int = WORKER_PORT,
    network_policies: bool = True,
) -> Observation:
    """The CR and what exists of its pods, Service, NetworkPolicy (only with `network_policies`: without them
    the operator neither reads nor writes NetworkPolicies) and budgets; with `drains`, the draining pods' state;
    with `adapters` (and a spec that serves adapters), what the ready pods serve and the last loads' answers."""
    resource, pods, service, network_policy, pdbs = await asyncio.gather(
        api.get(deployment_path(namespace, name)),
        api.list(namespaced(namespace, "pods"), label_selector(name)),
        api.get(namespaced(namespace, "services", service_name(name))),
        api.get(network_policies_path(namespace, network_policy_name(name))) if network_policies else _none(),
        api.list(pdbs_path(namespace), label_selector(name)),
    )
    observed = Observed.from_objects(pods, service, network_policy, errors, pdbs=pdbs)
    if drains is not None and resource is not None:
        observed = replace(observed, drain_probes=await drains.probe_all(observed.pods, port))
    if adapters is not None and resource is not None and serves_adapters(resource.get("spec")):
        observed = replace(
            observed,
            adapter_probes=await adapters.probe_all(observed.pods, port),
            adapter_results=adapters.take_results((namespace, name)),
        )
    return Observation(resource, observed, pods)


async def _none() -> None:
    return None
