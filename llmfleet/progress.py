"""What the fleet looks like right now, for people: readiness of a deployment and its pods, and rollout changes.

Why it exists: `llmfleet up` shows pods becoming Ready while the model loads, and the `--scenario` tour narrates
what the operator does (pods added and removed, canary steps, analysis verdicts, promotions and rollbacks). The
functions here are pure (dicts in, rows or lines out) so they are tested with tables; `watch_until` is the thin
rich shell that polls the cluster and redraws.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from crds.pods import LABEL_REVISION, is_draining, is_ready
from crds.pods import labels as pod_labels
from llmfleet.kube import Kube


@dataclass(frozen=True)
class PodRow:
    name: str
    revision: str
    phase: str
    ready: bool
    restarts: int
    detail: str


def _condition(obj: Mapping[str, Any] | None, kind: str) -> Mapping[str, Any]:
    for entry in ((obj or {}).get("status") or {}).get("conditions") or []:
        if entry.get("type") == kind:
            return entry
    return {}


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Serving: Running, Ready and not being deleted."""
    meta = pod.get("metadata") or {}
    return (pod.get("status") or {}).get("phase") == "Running" and not meta.get("deletionTimestamp") and is_ready(pod)


def pod_row(pod: Mapping[str, Any]) -> PodRow:
    """One line about a pod: why it is not Ready yet, in words."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    restarts = sum(int(c.get("restartCount") or 0) for c in containers)
    ready = pod_ready(pod)
    if meta.get("deletionTimestamp"):
        detail = "terminating (draining)"
    elif ready:
        detail = "serving"
    elif is_draining(pod):
        detail = "draining"
    else:
        waiting = next((c["state"]["waiting"] for c in containers if (c.get("state") or {}).get("waiting")), None)
        scheduled = _condition(pod, "PodScheduled")
        if waiting:
            detail = waiting.get("reason") or "waiting"
            if waiting.get("message"):
                detail += f": {waiting['message']}"
        elif scheduled.get("status") == "False":
            detail = f"unschedulable: {scheduled.get('message', '')}"
        elif status.get("phase") == "Running":
            detail = "loading the model (waiting for /ready)"
        else:
            detail = status.get("phase") or "Pending"
    return PodRow(
        name=meta.get("name", "?"),
        revision=pod_labels(pod).get(LABEL_REVISION, "?"),
        phase=status.get("phase") or "Pending",
        ready=ready,
        restarts=restarts,
        detail=detail[:120],
    )


def deployment_ready(resource: Mapping[str, Any] | None, min_ready: int = 1) -> bool:
    """Available, the current generation observed, and at least `min_ready` ready pods."""
    if not resource:
        return False
    status = resource.get("status") or {}
    return (
        _condition(resource, "Available").get("status") == "True"
        and status.get("observedGeneration") == (resource.get("metadata") or {}).get("generation")
        and int(status.get("readyReplicas") or 0) >= min_ready
    )


def deployment_summary(resource: Mapping[str, Any] | None) -> str:
    if not resource:
        return "not created yet"
    status = resource.get("status") or {}
    rollout = status.get("rollout") or {}
    parts = [
        f"phase {status.get('phase') or 'Pending'}",
        f"{status.get('readyReplicas', 0)}/{status.get('replicas', 0)} ready",
    ]
    if rollout.get("canaryRevision"):
        parts.append(f"canary {rollout['canaryRevision']} at {rollout.get('canaryWeight', 0)}%")
    invalid = _condition(resource, "InvalidSpec")
    if invalid.get("status") == "True":
        parts.append(f"InvalidSpec: {invalid.get('message', '')[:200]}")
    stalled = _condition(resource, "Stalled")
    if stalled.get("status") == "True" and stalled.get("reason") != "InvalidSpec":  # InvalidSpec: said above
        parts.append(f"Stalled ({stalled.get('reason', '')}): {stalled.get('message', '')[:200]}")
    return ", ".join(parts)


def rollout_changes(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> list[str]:
    """Lines describing what changed in a deployment's status between two reads: sizes, rollout phase, step,
    weight, new analysis verdicts and new autoscaling decisions."""
    old = (before or {}).get("status") or {}
    new = (after or {}).get("status") or {}
    lines: list[str] = []
    old_v = {v.get("name"): v for v in old.get("variants") or []}
    for variant in new.get("variants") or []:
        prev = old_v.get(variant.get("name")) or {}
        for key, word in (("desiredReplicas", "desired"), ("readyReplicas", "ready")):
            if prev.get(key, 0) != variant.get(key, 0):
                lines.append(f"variant {variant.get('name')}: {word} pods {prev.get(key, 0)} -> {variant.get(key, 0)}")
    o_roll, n_roll = old.get("rollout") or {}, new.get("rollout") or {}
    if o_roll.get("phase") != n_roll.get("phase") and n_roll.get("phase"):
        why = f" ({n_roll.get('reason')}: {n_roll.get('message', '')[:200]})" if n_roll.get("reason") else ""
        lines.append(f"rollout {o_roll.get('phase') or 'Stable'} -> {n_roll['phase']}{why}")
    if n_roll.get("canaryRevision") and (o_roll.get("step"), o_roll.get("canaryWeight")) != (
        n_roll.get("step"),
        n_roll.get("canaryWeight"),
    ):
        lines.append(
            f"canary {n_roll['canaryRevision']}: step {n_roll.get('step', 0) + 1}, "
            f"{n_roll.get('canaryWeight', 0)}% of traffic"
        )
    seen = {a.get("time") for a in o_roll.get("analysis") or []}
    for check in n_roll.get("analysis") or []:
        if check.get("time") not in seen:
            lines.append(
                f"analysis (step {check.get('step', 0) + 1}): {check.get('verdict')} - {check.get('message', '')[:200]}"
            )
    old_d = {
        (v.get("name"), d.get("time"))
        for v in (old.get("autoscaling") or {}).get("variants") or []
        for d in v.get("lastDecisions") or []
    }
    for variant in (new.get("autoscaling") or {}).get("variants") or []:
        for decision in variant.get("lastDecisions") or []:
            if (variant.get("name"), decision.get("time")) not in old_d:
                lines.append(
                    f"autoscaler ({variant.get('name')}): {decision.get('currentReplicas')} -> "
                    f"{decision.get('desiredReplicas')} pods: {decision.get('reason', '')[:200]}"
                )
    return lines


def pods_table(title: str, rows: Sequence[PodRow], elapsed_s: float) -> Table:
    table = Table(title=f"{title}  ({elapsed_s:.0f} s)", title_justify="left", expand=False)
    for column in ("pod", "revision", "phase", "ready", "restarts", "status"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row.name,
            row.revision,
            row.phase,
            "[green]yes[/]" if row.ready else "[yellow]no[/]",
            str(row.restarts),
            row.detail,
        )
    if not rows:
        table.add_row("(no pods yet)", "", "", "", "", "")
    return table


def watch_until(
    console: Console,
    kube: Kube,
    name: str,
    namespace: str,
    done: Callable[[Mapping[str, Any] | None, list[dict[str, Any]]], bool],
    timeout_s: float,
    poll_s: float = 1.0,
    check: Callable[[], None] | None = None,
) -> tuple[bool, float]:
    """Redraw the pods of deployment `name` until `done(resource, pods)` or `timeout_s`; (done, seconds)."""
    started = time.monotonic()
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        for _ in range(int(timeout_s / poll_s) + 1):
            if check is not None:
                check()
            resource = kube.infd(name, namespace)
            pods = sorted(kube.pods(name, namespace), key=lambda p: p["metadata"]["name"])
            elapsed = time.monotonic() - started
            title = f"{namespace}/{name}: {deployment_summary(resource)}"
            live.update(pods_table(title, [pod_row(p) for p in pods], elapsed))
            if done(resource, pods):
                return True, elapsed
            if elapsed > timeout_s:
                break
            time.sleep(poll_s)
    return False, time.monotonic() - started
