"""Desired sizes per variant, weight splits, deletion order and condition merging: tables."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controllers.conditions import WantedCondition, merge_conditions
from controllers.observed import PodInfo
from controllers.ordering import deletion_order
from controllers.sizing import SizeSource, desired_sizes, split_by_weight
from crds.helpers import parse_spec, parse_status
from crds.models import Condition, ConditionStatus, ConditionType

T0 = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        (5, [3, 1], [4, 1]),
        (4, [1, 1], [2, 2]),
        (3, [1, 1], [2, 1]),  # ties go to the earlier variant
        (1, [1, 3], [0, 1]),
        (3, [0, 0, 0], [1, 1, 1]),
        (2, [0, 1], [0, 2]),
        (0, [1, 2], [0, 0]),
        (7, [], []),
        (100, [1, 2], [33, 67]),
    ],
)
def test_split_by_weight(total, weights, expected):
    assert split_by_weight(total, weights) == expected
    assert sum(expected) == (total if weights else 0)


_AUTO = {"minReplicas": 2, "maxReplicas": 5, "targets": {"queueDepthPerReplica": 4}}


@pytest.mark.parametrize(
    ("spec", "status", "expected"),
    [
        ({"variants": [{"name": "a"}]}, {}, {"a": (1, SizeSource.SHARED)}),
        (
            {"replicas": 6, "variants": [{"name": "a", "weight": 2}, {"name": "b"}]},
            {},
            {"a": (4, SizeSource.SHARED), "b": (2, SizeSource.SHARED)},
        ),
        (
            {"replicas": 6, "variants": [{"name": "a", "replicas": 1}, {"name": "b"}]},
            {},
            {"a": (1, SizeSource.FIXED), "b": (6, SizeSource.SHARED)},
        ),
        ({"variants": [{"name": "a", "autoscaling": _AUTO}]}, {}, {"a": (2, SizeSource.AUTOSCALER_INITIAL)}),
        (
            {"variants": [{"name": "a", "autoscaling": _AUTO}]},
            {"autoscaling": {"variants": [{"name": "a", "desiredReplicas": 4}]}},
            {"a": (4, SizeSource.AUTOSCALER)},
        ),
        (
            {"variants": [{"name": "a", "autoscaling": _AUTO}]},
            {"autoscaling": {"variants": [{"name": "a", "desiredReplicas": 0}]}},
            {"a": (2, SizeSource.AUTOSCALER)},
        ),
        (
            {"variants": [{"name": "a", "autoscaling": {**_AUTO, "minReplicas": 0, "scaleToZeroAfterSeconds": 60}}]},
            {"autoscaling": {"variants": [{"name": "a", "desiredReplicas": 0}]}},
            {"a": (0, SizeSource.AUTOSCALER)},
        ),
        (
            {"variants": [{"name": "a", "autoscaling": {**_AUTO, "minReplicas": 0, "scaleToZeroAfterSeconds": 60}}]},
            {},
            {"a": (1, SizeSource.AUTOSCALER_INITIAL)},
        ),
    ],
)
def test_desired_sizes(spec, status, expected):
    full = {"model": {"name": "m", "source": "/m"}, **spec}
    sizes = desired_sizes(parse_spec(full), parse_status(status).autoscaling)
    assert {name: (s.replicas, s.source) for name, s in sizes.items()} == expected


def _pod(name, *, ready=True, revision="new", in_flight=None, age=0):
    return PodInfo(
        name=name, ready=ready, revision=revision, in_flight=in_flight, created_at=T0 - timedelta(seconds=age)
    )


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        ([_pod("ready"), _pod("unready", ready=False)], ["unready", "ready"]),
        ([_pod("new"), _pod("old", revision="old")], ["old", "new"]),
        ([_pod("busy", in_flight=5), _pod("idle", in_flight=0)], ["idle", "busy"]),
        ([_pod("older", age=100), _pod("younger", age=10)], ["younger", "older"]),
        # the rules apply in order: unready beats old revision beats in-flight beats age
        (
            [_pod("old-idle", revision="old", in_flight=0), _pod("new-unready", ready=False)],
            ["new-unready", "old-idle"],
        ),
        ([_pod("new-idle", in_flight=0), _pod("old-busy", revision="old", in_flight=9)], ["old-busy", "new-idle"]),
        ([_pod("young-busy", in_flight=3, age=1), _pod("old-idle", in_flight=1, age=500)], ["old-idle", "young-busy"]),
        ([_pod("b"), _pod("a")], ["a", "b"]),
    ],
)
def test_deletion_order(pods, expected):
    assert [p.name for p in deletion_order(pods, "new")] == expected


def test_merge_conditions_keeps_transition_time_and_foreign_types():
    earlier = Condition(type="Available", status=ConditionStatus.TRUE, reason="A", last_transition_time=T0)
    foreign = Condition(type="RolloutHealthy", status=ConditionStatus.TRUE, reason="X", last_transition_time=T0)
    later = T0 + timedelta(hours=1)
    merged = merge_conditions(
        [earlier, foreign],
        [
            WantedCondition(ConditionType.AVAILABLE, ConditionStatus.TRUE, "B", "msg"),
            WantedCondition(ConditionType.DEGRADED, ConditionStatus.FALSE, "Healthy"),
        ],
        later,
        3,
    )
    by_type = {c.type: c for c in merged}
    assert by_type["Available"].last_transition_time == T0 and by_type["Available"].reason == "B"
    assert by_type["Degraded"].last_transition_time == later
    assert by_type["RolloutHealthy"] == foreign
    assert by_type["Available"].observed_generation == 3
