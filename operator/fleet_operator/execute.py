"""Carry out a `Plan` against the API server, idempotently, and report what failed instead of raising.

Each action is one API call: AlreadyExists on create and NotFound on delete mean "already done"; a delete is
guarded by the pod's uid, so a pod recreated under the same name is never hit by a stale decision; conflicts,
throttling and server errors are retried a few times (`kube.with_retries`). Independent calls run
concurrently; each successful pod create or delete is recorded as a Kubernetes Event on the InferenceDeployment (so
`kubectl describe infd` tells the story). Failures come back as strings: the next pass shows them in the
Degraded condition and a Warning Event, and the operator keeps running.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import secrets
import socket
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from controllers import (
    CreatePod,
    DeletePod,
    EmitEvent,
    EnsureSecret,
    EnsureService,
    EventType,
    PatchStatus,
    Plan,
)
from controllers.pods import MANAGED_BY
from fleet_operator.kube import ApiError, KubeApi, namespaced, with_retries
from fleet_operator.observe import deployment_path

log = logging.getLogger(__name__)
COMPONENT = MANAGED_BY
MAX_EVENT_MESSAGE = 1024


async def execute(api: KubeApi, plan: Plan, resource: Mapping[str, Any]) -> list[str]:
    """Run the plan's actions; returns the errors, empty if none.

    Order: the drain-token Secret; then the Service, pod deletes and pod creates together; then the status patch
    and the Events together (an Event per successful create/delete, the plan's own Events, and one Warning that
    lists any failures)."""
    meta = resource["metadata"]
    namespace = meta.get("namespace", "default")
    errors: list[str] = []

    async def attempt(what: str, call: Any) -> bool:
        try:
            await with_retries(call)
            return True
        except Exception as error:  # noqa: BLE001 - reported, never allowed to crash the loop
            log.warning("%s/%s: %s failed: %s", namespace, meta["name"], what, error)
            errors.append(f"{what}: {error}"[:500])
            return False

    # The Secret first: new pods read their drain token from it. The rest of the pod work runs concurrently.
    for secret in plan.of_type(EnsureSecret):
        await attempt("create drain-token Secret", lambda a=secret: _create_secret(api, namespace, a))
    services = plan.of_type(EnsureService)
    deletes = plan.of_type(DeletePod)
    creates = plan.of_type(CreatePod)
    outcomes = await asyncio.gather(
        *(attempt("ensure Service", lambda a=a: _ensure_service(api, namespace, a)) for a in services),
        *(attempt(f"delete pod {d.name}", lambda d=d: _delete_pod(api, namespace, d)) for d in deletes),
        *(attempt(f"create pod {c.name}", lambda c=c: _create_pod(api, namespace, c)) for c in creates),
    )
    done, made = outcomes[len(services) : len(services) + len(deletes)], outcomes[len(services) + len(deletes) :]
    events: list[EmitEvent] = [
        EmitEvent(EventType.NORMAL, "DeletedPod", f"deleted pod {d.name} ({d.reason}): {d.message}")
        for d, ok in zip(deletes, done, strict=True)
        if ok
    ]
    events += [
        EmitEvent(EventType.NORMAL, "CreatedPod", f"created pod {c.name} ({c.reason}): {c.message}")
        for c, ok in zip(creates, made, strict=True)
        if ok
    ]
    events += plan.of_type(EmitEvent)
    await asyncio.gather(
        *(attempt("patch status", lambda p=p: _patch_status(api, namespace, meta["name"], p))
          for p in plan.of_type(PatchStatus)),
        *(_post_event(api, resource, event) for event in events),
    )
    if errors:
        await _post_event(api, resource, EmitEvent(EventType.WARNING, "ApiError", "; ".join(errors)))
    return errors


async def _create_pod(api: KubeApi, namespace: str, action: CreatePod) -> None:
    try:
        await api.create(namespaced(namespace, "pods"), action.manifest)
    except ApiError as error:
        if not error.already_exists:
            raise


async def _delete_pod(api: KubeApi, namespace: str, action: DeletePod) -> None:
    try:
        await api.delete(namespaced(namespace, "pods", action.name), uid=action.uid or None)
    except ApiError as error:
        # NotFound: already gone. Conflict: the uid precondition failed, the name now belongs to a new pod.
        if not (error.not_found or error.status == 409):
            raise


async def _create_secret(api: KubeApi, namespace: str, action: EnsureSecret) -> None:
    token = base64.b64encode(secrets.token_urlsafe(32).encode()).decode()
    body = {**action.manifest, "data": {action.key: token}}
    try:
        await api.create(namespaced(namespace, "secrets"), body)
    except ApiError as error:
        if not error.already_exists:  # never overwrite: running pods hold the old token
            raise


async def _ensure_service(api: KubeApi, namespace: str, action: EnsureService) -> None:
    name = action.manifest["metadata"]["name"]
    try:
        await api.create(namespaced(namespace, "services"), action.manifest)
    except ApiError as error:
        if not error.already_exists:
            raise
        spec = action.manifest["spec"]
        await api.merge_patch(
            namespaced(namespace, "services", name), {"spec": {"selector": spec["selector"], "ports": spec["ports"]}}
        )


async def _patch_status(api: KubeApi, namespace: str, name: str, action: PatchStatus) -> None:
    try:
        await api.merge_patch(deployment_path(namespace, name) + "/status", {"status": dict(action.status)})
    except ApiError as error:
        if not error.not_found:  # the CR is gone: nothing to describe
            raise


async def _post_event(api: KubeApi, resource: Mapping[str, Any], event: EmitEvent) -> None:
    """Best effort: an Event that cannot be posted is logged, never retried or escalated."""
    meta = resource["metadata"]
    namespace = meta.get("namespace", "default")
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
        "involvedObject": {
            "apiVersion": resource.get("apiVersion"),
            "kind": resource.get("kind"),
            "name": meta["name"],
            "namespace": namespace,
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": event.type.value,
        "reason": event.reason,
        "message": event.message[:MAX_EVENT_MESSAGE],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": os.environ.get("POD_NAME") or socket.gethostname(),
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await api.create(namespaced(namespace, "events"), body)
    except Exception as error:  # noqa: BLE001 - events are best effort
        log.info("could not post event %s on %s/%s: %s", event.reason, namespace, meta["name"], error)
