"""Carry out a `Plan` against the API server, idempotently, and report what failed instead of raising.

Each action is one API call: AlreadyExists on create and NotFound on delete mean "already done"; a delete is
guarded by the pod's uid, so a pod recreated under the same name is never hit by a stale decision; conflicts,
throttling and server errors are retried a few times (`kube.with_retries`). Independent calls run
concurrently; each successful pod create, delete or drain is recorded as a Kubernetes Event on the
InferenceDeployment (so `kubectl describe infd` tells the story). Failures come back as strings: the next pass
shows them in the Degraded condition and a Warning Event, and the operator keeps running.

A `StartDrain` is two calls in order: the pod's mark (a merge patch of its label and annotations: routing stops,
and the drain survives an operator restart), then `POST /drain` to the worker with the deployment's drain token
(derived from the operator's key by `drains`, the same token the pods were created with; no Secret is read).
A failed POST is not an API error: it is logged, and the drain machine sees on its next probe whether the worker
drains, asks again, or deletes a worker that no longer answers.

`LoadAdapter`/`UnloadAdapter` go to the workers through `adapters` (`adapter_client`), alongside the drains; a
refused load is not an API error either: the worker's reason is kept for the next pass, which puts it in
`status.adapters` (and a Warning Event) through the planner.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from controllers import (
    CreatePod,
    DeletePdb,
    DeletePod,
    EmitEvent,
    EnsureNetworkPolicy,
    EnsurePdb,
    EnsureService,
    EventType,
    LoadAdapter,
    PatchStatus,
    Plan,
    RemoveAnnotations,
    StartDrain,
    UnloadAdapter,
)
from controllers.draining import mark_patch
from controllers.pods import MANAGED_BY
from controllers.reasons import Reason
from fleet_operator.adapter_client import WorkerAdapters
from fleet_operator.drain_client import WorkerDrains
from fleet_operator.kube import ApiError, KubeApi, namespaced, with_retries
from fleet_operator.observe import deployment_path, network_policies_path, pdbs_path

log = logging.getLogger(__name__)
COMPONENT = MANAGED_BY
MAX_EVENT_MESSAGE = 1024


async def execute(
    api: KubeApi,
    plan: Plan,
    resource: Mapping[str, Any],
    drains: WorkerDrains | None = None,
    adapters: WorkerAdapters | None = None,
) -> list[str]:
    """Run the plan's actions; returns the errors, empty if none. Without `drains` no `POST /drain` is sent (the
    pods are still marked; their preStop hook drains them when they are deleted); without `adapters` no adapter
    is loaded or unloaded.

    Order: the Service, the NetworkPolicy and the budgets together; then pod deletes, drains and pod creates
    together; then the status patch, annotation removals and the Events together (an Event per successful create, delete
    or drain, the plan's own Events, and one Warning that lists any failures)."""
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

    services = plan.of_type(EnsureService)
    deletes = plan.of_type(DeletePod)
    starts = plan.of_type(StartDrain)
    creates = plan.of_type(CreatePod)
    token = drains.token(meta) if starts and drains is not None else None
    await asyncio.gather(
        *(attempt("ensure Service", lambda a=a: _ensure_service(api, namespace, a)) for a in services),
        *(
            attempt(f"ensure NetworkPolicy {n.name}", lambda n=n: _ensure_network_policy(api, namespace, n))
            for n in plan.of_type(EnsureNetworkPolicy)
        ),
        *(
            attempt(f"ensure PodDisruptionBudget {b.name}", lambda b=b: _ensure_pdb(api, namespace, b))
            for b in plan.of_type(EnsurePdb)
        ),
        *(
            attempt(f"delete PodDisruptionBudget {b.name}", lambda b=b: _delete_pdb(api, namespace, b))
            for b in plan.of_type(DeletePdb)
        ),
    )
    outcomes = await asyncio.gather(
        *(attempt(f"delete pod {d.name}", lambda d=d: _delete_pod(api, namespace, d)) for d in deletes),
        *(attempt(f"mark pod {s.name} draining", lambda s=s: _mark(api, namespace, s)) for s in starts),
        *(attempt(f"create pod {c.name}", lambda c=c: _create_pod(api, namespace, c)) for c in creates),
    )
    done = outcomes[: len(deletes)]
    marked = outcomes[len(deletes) : len(deletes) + len(starts)]
    made = outcomes[len(deletes) + len(starts) :]
    loads, unloads = plan.of_type(LoadAdapter), plan.of_type(UnloadAdapter)
    await asyncio.gather(
        *(
            _post_drain(drains, s, token, namespace)
            for s, ok in zip(starts, marked, strict=True)
            if ok and drains is not None
        ),
        *(
            [adapters.run((namespace, meta["name"]), meta, loads, unloads)]
            if adapters is not None and (loads or unloads)
            else []
        ),
    )
    events: list[EmitEvent] = [
        EmitEvent(EventType.NORMAL, Reason.DELETED_POD, f"deleted pod {d.name} ({d.reason}): {d.message}")
        for d, ok in zip(deletes, done, strict=True)
        if ok
    ]
    events += [
        EmitEvent(EventType.NORMAL, Reason.DRAINING_POD, f"draining pod {s.name} ({s.reason}): {s.message}")
        for s, ok in zip(starts, marked, strict=True)
        if ok and s.mark
    ]
    events += [
        EmitEvent(EventType.NORMAL, Reason.CREATED_POD, f"created pod {c.name} ({c.reason}): {c.message}")
        for c, ok in zip(creates, made, strict=True)
        if ok
    ]
    events += plan.of_type(EmitEvent)
    await asyncio.gather(
        *(
            attempt("patch status", lambda p=p: _patch_status(api, namespace, meta["name"], p))
            for p in plan.of_type(PatchStatus)
        ),
        *(
            attempt("remove annotations", lambda r=r: _remove_annotations(api, namespace, meta["name"], r))
            for r in plan.of_type(RemoveAnnotations)
        ),
        *(_post_event(api, resource, event) for event in events),
    )
    if errors:
        await _post_event(api, resource, EmitEvent(EventType.WARNING, Reason.API_ERROR, "; ".join(errors)))
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


async def _mark(api: KubeApi, namespace: str, action: StartDrain) -> None:
    """Label and annotate a pod as draining (NotFound: the pod is gone, nothing to drain)."""
    if not action.mark:
        return
    try:
        await api.merge_patch(namespaced(namespace, "pods", action.name), mark_patch(action))
    except ApiError as error:
        if not error.not_found:
            raise


async def _post_drain(drains: WorkerDrains, action: StartDrain, token: str | None, namespace: str) -> None:
    if action.address is None:
        return
    problem = await drains.post(action.address, token)
    if problem is not None:
        log.info("%s/%s: %s (the next probe decides what follows)", namespace, action.name, problem)


async def _ensure_pdb(api: KubeApi, namespace: str, action: EnsurePdb) -> None:
    try:
        await api.create(pdbs_path(namespace), action.manifest)
    except ApiError as error:
        if not error.already_exists:
            raise
        await api.merge_patch(pdbs_path(namespace, action.name), {"spec": action.manifest["spec"]})


async def _delete_pdb(api: KubeApi, namespace: str, action: DeletePdb) -> None:
    try:
        await api.delete(pdbs_path(namespace, action.name))
    except ApiError as error:
        if not error.not_found:
            raise


async def _remove_annotations(api: KubeApi, namespace: str, name: str, action: RemoveAnnotations) -> None:
    body = {"metadata": {"annotations": dict.fromkeys(action.keys)}}
    try:
        await api.merge_patch(deployment_path(namespace, name), body)
    except ApiError as error:
        if not error.not_found:
            raise


async def _ensure_network_policy(api: KubeApi, namespace: str, action: EnsureNetworkPolicy) -> None:
    """Create the NetworkPolicy, or (AlreadyExists) merge-patch its spec back to the wanted one: lists in a merge
    patch replace, so peers added by hand are removed again."""
    try:
        await api.create(network_policies_path(namespace), action.manifest)
    except ApiError as error:
        if not error.already_exists:
            raise
        await api.merge_patch(network_policies_path(namespace, action.name), {"spec": action.manifest["spec"]})


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
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
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
        "reason": str(event.reason),  # a Reason member; plain str on the wire
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
