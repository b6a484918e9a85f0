"""Read one InferenceDeployment and its children fresh from the API server, for one reconcile pass.

Every pass reads the CR, its pods (by the `llmfleet.io/deployment` label), its Service, its drain-token Secret and
its PodDisruptionBudgets directly (in parallel) instead of trusting a watch cache: a list from the API server
already shows the pods the previous pass created, so the planner never creates a pod twice because its view was
stale, and an operator restart needs no warm-up. Pods marked draining are then asked how their drain goes
(`GET /drain`, see `drain_client`). The Secret's data never leaves this module.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from controllers import Observed
from controllers.pods import DRAIN_TOKEN_KEY, label_selector, secret_name, service_name
from crds.models import GROUP, PLURAL, VERSION
from fleet_operator.drain_client import WorkerDrains
from fleet_operator.kube import KubeApi, namespaced


def deployment_path(namespace: str, name: str) -> str:
    return namespaced(namespace, PLURAL, name, group=GROUP, version=VERSION)


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
    port: int = 8000,
) -> Observation:
    """The CR and what exists of its pods, Service, Secret and budgets; with `drains`, the draining pods' state."""
    resource, pods, service, secret, pdbs = await asyncio.gather(
        api.get(deployment_path(namespace, name)),
        api.list(namespaced(namespace, "pods"), label_selector(name)),
        api.get(namespaced(namespace, "services", service_name(name))),
        api.get(namespaced(namespace, "secrets", secret_name(name))),
        api.list(pdbs_path(namespace), label_selector(name)),
    )
    secret_meta = {"metadata": secret["metadata"]} if secret is not None else None
    observed = Observed.from_objects(pods, service, secret_meta, errors, pdbs=pdbs)
    if drains is not None and resource is not None:
        observed = replace(observed, drain_probes=await drains.probe_all(observed.pods, port))
    return Observation(resource, observed, pods)


async def drain_token(api: KubeApi, namespace: str, name: str) -> str | None:
    """The drain token from the deployment's Secret (None when it does not exist yet)."""
    secret = await api.get(namespaced(namespace, "secrets", secret_name(name)))
    data = (secret or {}).get("data") or {}
    raw = data.get(DRAIN_TOKEN_KEY)
    return base64.b64decode(raw).decode() if raw else None
