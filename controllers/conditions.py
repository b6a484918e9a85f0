"""Kubernetes-style conditions: build them, and keep `lastTransitionTime` unless the status really changes.

`merge_conditions(previous, wanted, now)` returns the new condition list: a condition whose status is unchanged
keeps its old transition time (reason and message may still be updated), a changed or new one gets `now`.
Conditions of types this controller does not set are kept as they are, so other writers' conditions survive.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from crds.models import Condition, ConditionStatus, ConditionType


@dataclass(frozen=True)
class WantedCondition:
    """A condition as the planner decides it, before transition times are known."""

    type: ConditionType
    status: ConditionStatus
    reason: str
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
