"""Kubernetes-style conditions: build them, and keep `lastTransitionTime` unless the status really changes.

`merge_conditions(previous, wanted, now)` returns the new condition list: a condition whose status is unchanged
keeps its old transition time (reason and message may still be updated), a changed or new one gets `now`.
Conditions of types this controller does not set are kept as they are, so other writers' conditions survive.

`kstatus_conditions(health)` derives the three conditions GitOps tools read (kstatus: Flux, `kubectl wait`, kpt,
Config Sync; and the Argo CD health check in charts/llmfleet/files/argocd-health.lua) from what the planner saw:
- `Stalled` (abnormal-true) when nothing will change without a human: an invalid spec, a canary rolled back (or a
  spec still asking for a rejected revision), pods that cannot start. The reason says which, the message what to fix.
- `Reconciling` (abnormal-true) while a rollout, drain or scale is under way and not stalled; the reason names the
  step (`CanaryProgressing`, `Promoting`, `RollingUpdate`, `ScalingUp`, ...).
- `Ready` only when neither holds, the spec's revision serves all its replicas and no API error hid anything
  (at zero wanted replicas, a deployment scaled to zero on purpose is Ready with reason `ScaledToZero`).
Stalled and Reconciling are never both true, so kstatus' order (Reconciling before Stalled) cannot hide a failure.
The mapping is documented in docs/gitops.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from controllers.reasons import Reason
from crds.models import Condition, ConditionStatus, ConditionType


@dataclass(frozen=True)
class WantedCondition:
    """A condition as the planner decides it, before transition times are known."""

    type: ConditionType
    status: ConditionStatus
    reason: Reason
    message: str = ""


def merge_conditions(
    previous: Iterable[Condition], wanted: Iterable[WantedCondition], now: datetime, generation: int | None
) -> list[Condition]:
    """The condition list after this pass: `wanted` ones (in order) followed by untouched foreign ones."""
    old = {condition.type: condition for condition in previous}
    merged: list[Condition] = []
    for want in wanted:
        before = old.pop(want.type.value, None)
        changed = before is None or before.status != want.status
        merged.append(
            Condition(
                type=want.type.value,
                status=want.status,
                reason=want.reason,
                message=want.message[:32_768],
                last_transition_time=before.last_transition_time if before is not None and not changed else now,
                observed_generation=generation,
            )
        )
    return merged + list(old.values())


def find(conditions: Iterable[Condition], kind: ConditionType) -> Condition | None:
    """The condition of one type, if present."""
    return next((c for c in conditions if c.type == kind.value), None)


def is_true(conditions: Iterable[Condition], kind: ConditionType) -> bool:
    condition = find(conditions, kind)
    return condition is not None and condition.status == ConditionStatus.TRUE


# ------------------------------------------------------------------------------------------------------ kstatus


@dataclass(frozen=True)
class Health:
    """What the planner knows about a deployment, for the kstatus conditions."""

    stalled: Sequence[tuple[Reason, str]] = ()  # every reason it cannot progress, with what to fix
    moving: Sequence[tuple[Reason, str]] = ()  # every step under way, in order of importance
    serving: bool = True  # the spec's revision serves all its wanted replicas (ready pods >= desired)
    scaled_to_zero: bool = False  # no pods wanted on purpose
    trouble: tuple[Reason, str] | None = None  # (reason, message) of transient trouble (API errors) hiding the truth
    summary: str = ""  # for Ready=True: who serves (e.g. "default 2/2 ready")


def kstatus_conditions(health: Health) -> list[WantedCondition]:
    """`Ready`, `Reconciling` and `Stalled` (in that order) for `health` (rules in the module docstring)."""
    if health.stalled:
        why = health.stalled[0][0]
        message = "; ".join(text for _, text in health.stalled)
        stalled = WantedCondition(ConditionType.STALLED, ConditionStatus.TRUE, why, message)
        reconciling = WantedCondition(
            ConditionType.RECONCILING, ConditionStatus.FALSE, Reason.STALLED, "stalled: " + message
        )
        ready = WantedCondition(ConditionType.READY, ConditionStatus.FALSE, why, message)
        return [ready, reconciling, stalled]
    stalled = WantedCondition(ConditionType.STALLED, ConditionStatus.FALSE, Reason.NOT_STALLED, "")
    if health.moving:
        step = health.moving[0][0]
        message = "; ".join(text for _, text in health.moving)
        reconciling = WantedCondition(ConditionType.RECONCILING, ConditionStatus.TRUE, step, message)
        ready = WantedCondition(ConditionType.READY, ConditionStatus.FALSE, step, message)
        return [ready, reconciling, stalled]
    reconciling = WantedCondition(ConditionType.RECONCILING, ConditionStatus.FALSE, Reason.RECONCILED, "")
    if health.trouble is not None:
        ready = WantedCondition(ConditionType.READY, ConditionStatus.FALSE, *health.trouble)
    elif not health.serving:
        ready = WantedCondition(ConditionType.READY, ConditionStatus.FALSE, Reason.REPLICAS_UNAVAILABLE, health.summary)
    elif health.scaled_to_zero:
        ready = WantedCondition(
            ConditionType.READY, ConditionStatus.TRUE, Reason.SCALED_TO_ZERO, "no pods wanted; requests wake it"
        )
    else:
        ready = WantedCondition(ConditionType.READY, ConditionStatus.TRUE, Reason.CURRENT, health.summary)
    return [ready, reconciling, stalled]
