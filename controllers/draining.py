"""Lame-duck draining: how a worker pod that may still serve requests goes away without breaking a stream.

Why it exists: deleting a serving pod cuts its streams unless something first stops new work reaching it and
waits for the work it has. Every removal the planner decides (scale down, rolling replace, canary steps,
rollback, promotion, removed variants, deletion of the InferenceDeployment) goes through `remove`:

- A pod that serves nothing (not Running+Ready) is deleted at once: there is nothing to drain.
- A ready pod is drained (`StartDrain`): the executor marks it (label `llmfleet.io/draining=true`, so the
  gateway's watch stops routing to it and scrapers stop counting it at once; annotations with the start time,
  the deadline and the reason, so an operator restart resumes the drain), then `POST /drain`s the worker, which
  stops taking requests and finishes the ones in flight.

`advance` then moves every marked pod along, one pass at a time, from what the shell's `GET /drain` said
(`DrainProbe`):

    probe / time                                   decision
    no drain annotations (marked by hand)          mark again with a fresh deadline (StartDrain)
    answered draining, nothing in flight           delete: drained ("drained: 0 in flight after 3.2 s")
    pod ended, has no IP, or nothing listens       delete: not drained (the worker crashed or is broken)
    answered not draining, nothing in flight       delete: not drained (it restarted, or never got the POST)
    the deadline passed                            delete, even with requests in flight (they are cut)
    answered, not in lame-duck mode                POST /drain again (the first one was lost)
    failed (timeout, error) or still in flight     wait; look again in `POLL_SECONDS`

A drained worker stays up and idle (0 in flight, `/ready` 503) until the deletion's SIGTERM, so the kubelet never
restarts it before the pod goes; the DeletedPod Event says which way the drain ended.

The deadline is `drain.timeoutSeconds` after the start, and is stored on the pod: a restart neither shortens nor
extends a drain. The deletion itself runs the pod's preStop hook (which drains too, and returns at once when
the worker has already drained) and SIGTERM; `drain.terminationGracePeriodSeconds` exceeds the timeout, so the
kubelet does not kill a pod mid-drain. Pure: time is an argument, the probes are observations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from controllers.actions import Action, DeletePod, StartDrain
from controllers.observed import DrainProbe, PodInfo, PodPhase, ProbeState
from controllers.reasons import Reason
from crds.models import DrainReason, DrainStatus
from crds.pods import DRAIN_DEADLINE, DRAIN_REASON, DRAINING

# How often a draining pod is asked how its drain goes.
POLL_SECONDS = 1.0


def address(pod: PodInfo, port: int) -> str | None:
    """host:port of a pod's worker, None without an IP."""
    if not pod.ip:
        return None
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    return f"{host}:{port}"


def serving(pod: PodInfo) -> bool:
    """Whether a pod may have requests in flight: running and ready (an unready worker is loading, failed or
    already draining, and takes no requests)."""
    return pod.phase == PodPhase.RUNNING and pod.ready and not pod.deleting


def begin(pod: PodInfo, reason: DrainReason, why: str, now: datetime, timeout_s: int, port: int) -> StartDrain:
    """The action that starts draining `pod` now."""
    return StartDrain(
        name=pod.name,
        uid=pod.uid,
        address=address(pod, port),
        variant=pod.variant,
        revision=pod.revision,
        reason=Reason(reason),
        message=why,
        started_at=now,
        deadline=now + timedelta(seconds=timeout_s),
    )


def remove(pod: PodInfo, reason: DrainReason, why: str, now: datetime, timeout_s: int, port: int) -> Action:
    """How `pod` goes away: drained when it may serve requests, deleted at once when it serves nothing."""
    if serving(pod):
        return begin(pod, reason, why, now, timeout_s, port)
    state = "not running" if pod.phase != PodPhase.RUNNING else "unready"
    return DeletePod(pod.name, pod.uid, pod.variant, pod.revision, Reason(reason), f"{why} ({state} pod)")


def mark_patch(action: StartDrain) -> dict[str, Any]:
    """The merge patch that marks a pod draining: the label routing and scraping watch, and the annotations that
    let a restarted operator resume the drain with the same deadline."""
    return {
        "metadata": {
            "labels": {DRAINING: "true"},
            "annotations": {
                DRAINING: timestamp(action.started_at),
                DRAIN_DEADLINE: timestamp(action.deadline),
                DRAIN_REASON: str(action.reason),
            },
        }
    }


def timestamp(moment: datetime) -> str:
    """RFC 3339 UTC with microseconds, as the API writes times (parsed back by `observed.parse_time`)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def status_of(action: StartDrain) -> DrainStatus:
    """The status entry of a drain that starts now."""
    return DrainStatus(
        pod=action.name,
        variant=action.variant,
        revision=action.revision,
        reason=reason_of(action.reason),
        started_at=action.started_at,
        deadline=action.deadline,
    )


def reason_of(value: str | None) -> DrainReason:
    """A drain reason from an annotation; anything unknown reads as ScaleDown (a pod leaving the fleet)."""
    try:
        return DrainReason(value or DrainReason.SCALE_DOWN.value)
    except ValueError:
        return DrainReason.SCALE_DOWN


@dataclass(frozen=True)
class DrainProgress:
    """What one pass does about the drains in progress."""

    actions: tuple[Action, ...] = ()  # DeletePod for finished drains, StartDrain to mark or POST again
    drains: tuple[DrainStatus, ...] = ()  # status.drains: drains still in progress after this pass
    requeue_after: float | None = None  # when to look again (None: no drain waits)


def advance(
    pods: Iterable[PodInfo],
    probes: Mapping[str, DrainProbe],
    now: datetime,
    *,
    timeout_s: int,
    port: int,
    poll_s: float = POLL_SECONDS,
) -> DrainProgress:
    """Move every draining pod one step (see the module docstring's table)."""
    actions: list[Action] = []
    drains: list[DrainStatus] = []
    waits: list[float] = []
    for pod in sorted(pods, key=lambda p: p.name):
        if not pod.draining or pod.deleting:
            continue
        reason = reason_of(pod.drain_reason)
        if pod.draining_since is None or pod.drain_deadline is None:
            start = begin(pod, reason, "resuming a drain whose annotations are missing", now, timeout_s, port)
            actions.append(start)
            drains.append(status_of(start))
            waits.append(poll_s)
            continue
        probe = probes.get(pod.name)
        elapsed = max(0.0, (now - pod.draining_since).total_seconds())
        done = _finished(pod, probe, now)
        if done is not None:
            actions.append(
                DeletePod(pod.name, pod.uid, pod.variant, pod.revision, Reason(reason), f"{done} after {elapsed:.1f} s")
            )
            continue
        if probe is not None and probe.state == ProbeState.ANSWERED and not probe.draining:
            actions.append(
                StartDrain(
                    name=pod.name,
                    uid=pod.uid,
                    address=address(pod, port),
                    variant=pod.variant,
                    revision=pod.revision,
                    reason=Reason(reason),
                    message="the worker is not draining yet: asking again",
                    started_at=pod.draining_since,
                    deadline=pod.drain_deadline,
                    mark=False,
                )
            )
        drains.append(
            DrainStatus(
                pod=pod.name,
                variant=pod.variant,
                revision=pod.revision,
                reason=reason,
                started_at=pod.draining_since,
                deadline=pod.drain_deadline,
                in_flight=probe.in_flight if probe is not None else None,
            )
        )
        waits.append(min(poll_s, max(0.0, (pod.drain_deadline - now).total_seconds())))
    return DrainProgress(tuple(actions), tuple(drains), min(waits) if waits else None)


def _finished(pod: PodInfo, probe: DrainProbe | None, now: datetime) -> str | None:
    """Why the drain of `pod` is over (its pod may be deleted now), or None while it must go on."""
    if pod.failed:
        return f"not drained: the pod ended ({pod.phase.value})"
    if not pod.ip:
        return "not drained: the pod has no IP, so nothing can be in flight"
    if probe is not None and probe.state == ProbeState.UNREACHABLE:
        return "not drained: the worker no longer answers" + (f" ({probe.detail})" if probe.detail else "")
    if probe is not None and probe.state == ProbeState.ANSWERED and probe.in_flight == 0:
        if probe.draining:
            return "drained: 0 in flight"
        return "not drained: 0 in flight but the worker was not draining (it restarted, or never got POST /drain)"
    if pod.drain_deadline is not None and now >= pod.drain_deadline:
        left = probe.in_flight if probe is not None and probe.in_flight is not None else "unknown"
        return f"drain timeout passed with {left} request(s) in flight"
    return None
