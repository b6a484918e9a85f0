"""Read one InferenceDeployment and its children fresh from the API server, for one reconcile pass.

Every pass reads the CR, its pods (by the `llmfleet.io/deployment` label), its Service and its drain-token
Secret directly (four calls in parallel) instead of trusting a watch cache: a list from the API server already
shows the pods the previous pass created, so the planner never creates a pod twice because its view was stale,
and an operator restart needs no warm-up. The Secret's data never leaves this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from controllers import Observed
from controllers.pods import label_selector, secret_name, service_name
from crds.models import GROUP, PLURAL, VERSION
from fleet_operator.kube import KubeApi, namespaced


def deployment_path(namespace: str, name: str) -> str:
    return namespaced(namespace, PLURAL, name, group=GROUP, version=VERSION)


async def observe(
    api: KubeApi, namespace: str, name: str, errors: Iterable[str] = ()
) -> tuple[dict[str, Any] | None, Observed]:
    """The CR (None when it is gone) and what exists of its pods, Service and Secret."""
    resource, pods, service, secret = await asyncio.gather(
        api.get(deployment_path(namespace, name)),
        api.list(namespaced(namespace, "pods"), label_selector(name)),
        api.get(namespaced(namespace, "services", service_name(name))),
        api.get(namespaced(namespace, "secrets", secret_name(name))),
    )
    secret_meta = {"metadata": secret["metadata"]} if secret is not None else None
    return resource, Observed.from_objects(pods, service, secret_meta, errors)
