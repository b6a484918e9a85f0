"""Worker pods as the API server returns them, for the tables that test decisions on observed pods.

Why it exists: the controllers' tests and the operator's tests both describe fleets as lists of pod dicts; one
builder keeps them spelling the labels, the draining marker and the Ready condition as `crds.pods` defines them,
instead of each test file carrying its own copy. Test support only: no product module imports it. Imports
`crds.pods`, `controllers.autoscaling_plan` and the standard library.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from controllers.autoscaling_plan import ScaleIntent
from crds.pods import DRAINING, LABEL_DEPLOYMENT, LABEL_REVISION, LABEL_VARIANT


def iso(seconds: float) -> str:
    """An epoch time as the API server writes timestamps (RFC 3339, seconds, UTC)."""
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def worker_pod(
    name: str,
    *,
    namespace: str,
    deployment: str,
    now: float,
    owner: str,
    variant: str = "default",
    revision: str = "r1",
    ready_at: float | None = None,
    created: float | None = None,
    phase: str = "Running",
    draining: bool = False,
    deleting: bool = False,
) -> dict[str, Any]:
    """A worker pod of `deployment` owned by `owner` (a uid): Ready since `ready_at` when given, else not Ready;
    created 100 s before `now` unless `created` says when; `deleting` sets a deletionTimestamp of `now`."""
    ready: dict[str, Any] = {"type": "Ready", "status": "False"}
    if ready_at:
        ready = {"type": "Ready", "status": "True", "lastTransitionTime": iso(ready_at)}
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "creationTimestamp": iso(now - 100 if created is None else created),
        "labels": {LABEL_DEPLOYMENT: deployment, LABEL_VARIANT: variant, LABEL_REVISION: revision},
        "ownerReferences": [{"uid": owner, "controller": True}],
    }
    if draining:
        meta["labels"][DRAINING] = "true"
    if deleting:
        meta["deletionTimestamp"] = iso(now)
    return {"metadata": meta, "status": {"phase": phase, "conditions": [ready], "podIP": f"127.0.9.{len(name)}"}}


def scale_intent(
    alert: str,
    *,
    deployment: str,
    namespace: str | None,
    at: float,
    variant: str | None = None,
    firing: bool = True,
    step: int = 2,
) -> ScaleIntent:
    """An Alertmanager alert as the operator records it: received at `at`, expiring 300 s later."""
    return ScaleIntent(
        deployment=deployment,
        namespace=namespace,
        variant=variant,
        alert=alert,
        fingerprint="fp-" + alert,
        firing=firing,
        step=step,
        received_at=at,
        expires_at=at + 300,
        reason="summary of " + alert,
    )
