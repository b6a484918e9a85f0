"""The CR adapters of controllers.autoscaling: spec -> policy, status <-> decision state, decision -> status entry."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from controllers.autoscaling import (
    AlertIntent,
    AutoscalingState,
    MetricsSample,
    PodCounts,
    RecommendationRecord,
    decide,
    policy_from_spec,
    state_from_status,
    variant_status,
)
from crds.models import (
    AlertIntent as AlertIntentStatus,
)
from crds.models import (
    AutoscalingSpec,
    AutoscalingTargets,
    DecisionTrigger,
    InferenceDeploymentStatus,
    VariantAutoscalingStatus,
)

NOW = 1_800_000_000.0


def test_policy_takes_the_crd_defaults() -> None:
    spec = AutoscalingSpec(max_replicas=8, targets=AutoscalingTargets(queue_depth_per_replica=3))
    policy = policy_from_spec(spec, expected_startup_seconds=90, settle_seconds=30, max_metrics_age_seconds=45)
    assert (policy.min_replicas, policy.max_replicas) == (1, 8)
    assert policy.targets() == {"queueDepthPerReplica": 3}
    assert (policy.tolerance, policy.scale_up_max_step, policy.scale_down_stabilization_seconds) == (
        spec.tolerance,
        spec.scale_up_max_step,
        spec.scale_down_stabilization_seconds,
    )
    assert (policy.expected_startup_seconds, policy.settle_seconds, policy.max_metrics_age_seconds) == (90, 30, 45)


def test_policy_refuses_what_validate_reports() -> None:
    spec = AutoscalingSpec(min_replicas=0, max_replicas=3, targets=AutoscalingTargets(kv_cache_utilization=0.8))
    with pytest.raises(ValidationError, match="needs scaleToZeroAfterSeconds"):
        policy_from_spec(spec)


def _decision_with_everything():
    spec = AutoscalingSpec(max_replicas=10, targets=AutoscalingTargets(queue_depth_per_replica=2))
    policy = policy_from_spec(spec)
    alert = AlertIntent(name="QueueHigh", received_at=NOW - 5, expires_at=NOW + 100, min_replicas=4)
    state = AutoscalingState(
        window=(RecommendationRecord(time=NOW - 30, replicas=3),), alerts=(alert,), last_active_at=NOW - 50
    )
    metrics = MetricsSample(
        observed_at=NOW,
        ready_pods=2,
        queue_depth_per_replica=3.5,
        kv_cache_utilization=0.4,
        running_requests=3,
        waiting_requests=7,
    )
    pods = PodCounts(ready=2, starting_since=(NOW - 3,))
    return decide(policy, now=NOW, current_replicas=3, pods=pods, metrics=metrics, state=state)


def test_status_entry_records_the_decision() -> None:
    decision = _decision_with_everything()
    previous = VariantAutoscalingStatus(
        name="fp8",
        alert_intents=[
            AlertIntentStatus(
                alert="QueueHigh",
                fingerprint="abc",
                replicas=4,
                received_at=datetime.fromtimestamp(NOW - 5, UTC),
                expires_at=datetime.fromtimestamp(NOW + 100, UTC),
                reason="queue above 8 for 1m",
            )
        ],
    )
    entry = variant_status(decision, previous, name="fp8", trigger=DecisionTrigger.ALERT)
    assert entry.desired_replicas == decision.desired_replicas == 4
    assert entry.last_scale_time == datetime.fromtimestamp(NOW, UTC)
    assert entry.idle_since is None  # traffic was seen
    (record,) = entry.last_decisions
    assert (record.trigger, record.current_replicas, record.ready_replicas, record.starting_replicas) == (
        DecisionTrigger.ALERT,
        3,
        2,
        1,
    )
    assert (record.inputs.queue_depth_per_replica, record.inputs.kv_cache_utilization) == (3.5, 0.4)
    assert record.reason == decision.reason
    (intent,) = entry.alert_intents
    assert (intent.alert, intent.fingerprint, intent.replicas, intent.reason) == (
        "QueueHigh",
        "abc",
        4,
        "queue above 8 for 1m",
    )
    # What the status holds is valid CR status (the API server gets it through this model).
    InferenceDeploymentStatus.model_validate({"autoscaling": {"variants": [entry.model_dump(by_alias=True)]}})


def test_new_alert_details_are_recorded() -> None:
    entry = variant_status(
        _decision_with_everything(), None, name="fp8", alert_details={"QueueHigh": ("f00", "queue above 8")}
    )
    (intent,) = entry.alert_intents
    assert (intent.fingerprint, intent.reason, intent.replicas) == ("f00", "queue above 8", 4)
    plain = variant_status(_decision_with_everything(), None, name="fp8")
    assert (plain.alert_intents[0].fingerprint, plain.alert_intents[0].reason) == (None, "")


def test_state_survives_the_status_round_trip() -> None:
    decision = _decision_with_everything()
    entry = variant_status(decision, None, name="fp8")
    again = VariantAutoscalingStatus.model_validate_json(entry.model_dump_json(by_alias=True))
    restored = state_from_status(again)
    assert restored.window == decision.state.window
    assert restored.alerts == decision.state.alerts
    assert restored.last_active_at is None  # traffic was seen: not idle


def test_idle_since_round_trip_drives_scale_to_zero() -> None:
    spec = AutoscalingSpec(
        min_replicas=0,
        max_replicas=3,
        scale_to_zero_after_seconds=60,
        targets=AutoscalingTargets(queue_depth_per_replica=2),
    )
    policy = policy_from_spec(spec)
    idle = MetricsSample(
        observed_at=NOW, ready_pods=1, queue_depth_per_replica=0, running_requests=0, waiting_requests=0
    )
    entry = None
    desired = []
    for tick in range(0, 80, 10):
        state = state_from_status(entry)
        metrics = idle.model_copy(update={"observed_at": NOW + tick})
        decision = decide(
            policy, now=NOW + tick, current_replicas=1, pods=PodCounts(ready=1), metrics=metrics, state=state
        )
        entry = variant_status(decision, entry, name="v")
        desired.append(decision.desired_replicas)
        assert entry.idle_since == datetime.fromtimestamp(NOW, UTC)
    assert desired == [1] * 6 + [0, 0]
    assert len(entry.last_decisions) == 8


def test_last_decisions_are_bounded() -> None:
    decision = _decision_with_everything()
    entry = None
    for _ in range(13):
        entry = variant_status(decision, entry, name="v", max_decisions=10)
    assert len(entry.last_decisions) == 10


def test_empty_status_is_an_empty_state() -> None:
    assert state_from_status(None) == AutoscalingState()
    assert state_from_status(VariantAutoscalingStatus(name="v")) == AutoscalingState()
