"""Tables for controllers.autoscaling.decide: each signal, max over signals, tolerance, starting pods, stabilisation,
bounds, scale to zero and wake, stale data, alert intents, scaleUpMaxStep, and invariants over random inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from controllers.autoscaling import (
    AlertIntent,
    AutoscalingPolicy,
    AutoscalingState,
    GatewaySample,
    MetricsSample,
    PodCounts,
    QueueRecord,
    RecommendationRecord,
    add_alert,
    alert_intent,
    decide,
    remove_alert,
)

NOW = 10_000.0


def sample(ready: int = 2, age: float = 0.0, **values: float | None) -> MetricsSample:
    values.setdefault("running_requests", 1.0)
    values.setdefault("waiting_requests", 0.0)
    return MetricsSample(observed_at=NOW - age, ready_pods=ready, **values)


def policy(**fields: Any) -> AutoscalingPolicy:
    base: dict[str, Any] = {
        "min_replicas": 1,
        "max_replicas": 20,
        "queue_depth_per_replica": 2.0,
        "kv_cache_utilization": 0.6,
        "ttft_p95_seconds": None,
        "scale_up_max_step": None,
    }
    return AutoscalingPolicy(**{**base, **fields})


def window(*records: tuple[float, int]) -> tuple[RecommendationRecord, ...]:
    return tuple(RecommendationRecord(time=NOW - ago, replicas=replicas) for ago, replicas in records)


@dataclass
class Case:
    name: str
    current: int
    desired: int
    metrics: MetricsSample | None = None
    pods: PodCounts | None = None
    policy: AutoscalingPolicy = field(default_factory=policy)
    state: AutoscalingState = field(default_factory=AutoscalingState)
    gateway: GatewaySample | None = None
    reason_has: tuple[str, ...] = ()


CASES = [
    # --- each signal alone: demand = measured pods * value / target
    Case("queue alone", 2, 8, sample(queue_depth_per_replica=7.5), reason_has=("queue depth 7.5/replica > target 2",)),
    Case("kv alone", 4, 6, sample(ready=4, kv_cache_utilization=0.9), reason_has=("KV-cache utilisation 90%",)),
    Case("ttft alone", 3, 6, sample(ready=3, ttft_p95_seconds=4.0), policy=policy(ttft_p95_seconds=2.0)),
    Case("signal without target ignored", 3, 3, sample(ready=3, ttft_p95_seconds=40.0, kv_cache_utilization=0.6)),
    # --- max over signals
    Case(
        "max over signals",
        4,
        7,
        sample(ready=4, queue_depth_per_replica=2.5, kv_cache_utilization=0.99),
        reason_has=("KV-cache utilisation",),
    ),
    # --- tolerance band: |demand / current - 1| <= 0.1 changes nothing
    Case("inside tolerance up", 4, 4, sample(ready=4, kv_cache_utilization=0.63), reason_has=("within tolerance",)),
    Case("outside tolerance up", 4, 5, sample(ready=4, kv_cache_utilization=0.7)),
    Case("inside tolerance down", 4, 4, sample(ready=4, kv_cache_utilization=0.56)),
    Case("no tolerance", 4, 5, sample(ready=4, kv_cache_utilization=0.63), policy=policy(tolerance=0.0)),
    # --- starting pods are capacity on its way: demand measured on ready pods already includes them
    Case(
        "starting pods cover the demand",
        4,
        4,
        sample(ready=2, queue_depth_per_replica=4.0),
        PodCounts(ready=2, starting_since=(NOW - 5, NOW - 5)),
    ),
    Case(
        "held while pods of that scale-up load",
        6,
        6,
        sample(ready=2, queue_depth_per_replica=10.0),
        PodCounts(ready=2, starting_since=(NOW - 10,) * 4),
        state=AutoscalingState(answered={"queueDepthPerReplica": RecommendationRecord(time=NOW - 10, replicas=6)}),
        reason_has=("4 pod(s) starting: holding at 6",),
    ),
    Case(
        "another signal is not held",
        6,
        10,
        sample(ready=2, queue_depth_per_replica=10.0),
        PodCounts(ready=2, starting_since=(NOW - 10,) * 4),
        state=AutoscalingState(answered={"kvCacheUtilization": RecommendationRecord(time=NOW - 10, replicas=6)}),
    ),
    Case(
        "stuck pods (past expected start-up) hold nothing",
        6,
        10,
        sample(ready=2, queue_depth_per_replica=10.0),
        PodCounts(ready=2, starting_since=(NOW - 400,) * 4),
        state=AutoscalingState(answered={"queueDepthPerReplica": RecommendationRecord(time=NOW - 200, replicas=6)}),
    ),
    Case(
        "lagging signal held while new pods settle",
        6,
        6,
        sample(ready=6, kv_cache_utilization=0.9),
        PodCounts(ready=6, ready_since=(NOW - 5,) * 4 + (NOW - 900,) * 2),
        state=AutoscalingState(answered={"kvCacheUtilization": RecommendationRecord(time=NOW - 20, replicas=6)}),
        reason_has=("new pod(s) settling",),
    ),
    Case(
        "instant queue not held once pods are ready",
        6,
        10,
        sample(ready=6, queue_depth_per_replica=10.0 / 3),
        PodCounts(ready=6, ready_since=(NOW - 5,) * 4 + (NOW - 900,) * 2),
        state=AutoscalingState(answered={"queueDepthPerReplica": RecommendationRecord(time=NOW - 20, replicas=6)}),
    ),
    Case(
        "a shrinking queue asks for nothing",
        10,
        10,
        sample(ready=10, queue_depth_per_replica=3.0),
        state=AutoscalingState(queue=QueueRecord(time=NOW - 10, total=40.0)),
        reason_has=("queue shrinking (40 -> 30 waiting)",),
    ),
    Case(
        "a growing queue scales",
        10,
        15,
        sample(ready=10, queue_depth_per_replica=3.0),
        state=AutoscalingState(queue=QueueRecord(time=NOW - 10, total=20.0)),
    ),
    # --- scaleUpMaxStep
    Case(
        "max step",
        2,
        4,
        sample(queue_depth_per_replica=7.5),
        policy=policy(scale_up_max_step=2),
        reason_has=("-> 4 replicas (max step 2)",),
    ),
    Case("step larger than need", 2, 8, sample(queue_depth_per_replica=7.5), policy=policy(scale_up_max_step=10)),
    # --- stabilisation: scale down to the highest recommendation of the window, once it covers the period
    Case(
        "recent higher recommendation holds",
        6,
        6,
        sample(ready=6, kv_cache_utilization=0.3),
        state=AutoscalingState(window=window((200, 6), (60, 6), (10, 4))),
        reason_has=("stabilisation: 6 recommended within the last 120s",),
    ),
    Case(
        "highest of the window",
        6,
        4,
        sample(ready=6, kv_cache_utilization=0.3),
        state=AutoscalingState(window=window((200, 6), (125, 3), (60, 4))),
    ),
    Case(
        "record before the window still held at its start",
        6,
        6,
        sample(ready=6, kv_cache_utilization=0.3),
        state=AutoscalingState(window=window((130, 6), (100, 3))),
    ),
    Case(
        "no history yet",
        6,
        6,
        sample(ready=6, kv_cache_utilization=0.3),
        reason_has=("waits for 120s of history",),
    ),
    Case(
        "no stabilisation",
        6,
        3,
        sample(ready=6, kv_cache_utilization=0.3),
        policy=policy(scale_down_stabilization_seconds=0),
    ),
    Case(
        "scale up ignores the window",
        4,
        6,
        sample(ready=4, kv_cache_utilization=0.9),
        state=AutoscalingState(window=window((300, 2), (100, 2))),
    ),
    # --- bounds
    Case(
        "min bound",
        3,
        2,
        sample(ready=3, kv_cache_utilization=0.0),
        policy=policy(min_replicas=2),
        state=AutoscalingState(window=window((200, 1))),
        reason_has=("minReplicas 2",),
    ),
    Case("max bound", 4, 20, sample(ready=4, queue_depth_per_replica=30.0), reason_has=("maxReplicas 20",)),
    Case("lowered max applies at once", 12, 10, None, policy=policy(max_replicas=10)),
    Case("raised min scales up", 2, 5, None, policy=policy(min_replicas=5)),
    Case("a new variant starts at min", 0, 2, None, policy=policy(min_replicas=2), reason_has=("minReplicas 2",)),
    Case(
        "no load keeps one pod",
        2,
        1,
        sample(kv_cache_utilization=0.0, running_requests=0.0),
        state=AutoscalingState(window=window((300, 1))),
    ),
    # --- missing or stale data never scales down
    Case("no metrics holds", 5, 5, None, state=AutoscalingState(window=window((200, 1))), reason_has=("no metrics",)),
    Case(
        "stale metrics hold",
        5,
        5,
        sample(ready=5, age=61, kv_cache_utilization=0.0),
        state=AutoscalingState(window=window((200, 1))),
        reason_has=("metrics stale (61s old)",),
    ),
    Case(
        "fresh enough",
        5,
        1,
        sample(ready=5, age=59, kv_cache_utilization=0.0),
        state=AutoscalingState(window=window((200, 1))),
    ),
    Case("no ready pod reporting", 3, 3, sample(ready=0), reason_has=("no ready pod",)),
    Case("metrics without configured signals", 3, 3, sample(ready=3, ttft_p95_seconds=9.0)),
    # --- alert intents raise the floor while they live
    Case(
        "alert floor",
        3,
        6,
        sample(ready=3, kv_cache_utilization=0.6),
        state=AutoscalingState(
            alerts=(AlertIntent(name="TTFTBurn", received_at=NOW - 5, expires_at=NOW + 60, min_replicas=6),)
        ),
        reason_has=("alert TTFTBurn holds at least 6 for 60s more",),
    ),
    Case(
        "expired alert ignored",
        3,
        3,
        sample(ready=3, kv_cache_utilization=0.6),
        state=AutoscalingState(
            alerts=(AlertIntent(name="TTFTBurn", received_at=NOW - 400, expires_at=NOW - 1, min_replicas=6),)
        ),
    ),
    Case(
        "alert with stale metrics",
        3,
        5,
        None,
        state=AutoscalingState(
            alerts=(AlertIntent(name="QueueHigh", received_at=NOW, expires_at=NOW + 60, min_replicas=5),)
        ),
    ),
    Case(
        "alert bounded by max",
        3,
        4,
        None,
        policy=policy(max_replicas=4),
        state=AutoscalingState(
            alerts=(AlertIntent(name="QueueHigh", received_at=NOW, expires_at=NOW + 60, min_replicas=9),)
        ),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_decide(case: Case) -> None:
    pods = case.pods or PodCounts(ready=case.metrics.ready_pods if case.metrics else case.current)
    decision = decide(
        case.policy,
        now=NOW,
        current_replicas=case.current,
        pods=pods,
        metrics=case.metrics,
        gateway=case.gateway,
        state=case.state,
    )
    assert decision.desired_replicas == case.desired, decision.reason
    for fragment in case.reason_has:
        assert fragment in decision.reason
    assert decision.reason.count(f"-> {case.desired} replicas") == 1


def test_reason_reads_like_the_issue_example() -> None:
    decision = decide(
        policy(scale_up_max_step=2, kv_cache_utilization=None),
        now=NOW,
        current_replicas=2,
        pods=PodCounts(ready=2),
        metrics=sample(queue_depth_per_replica=7.5),
    )
    assert decision.reason == "queue depth 7.5/replica > target 2 (wants 8) -> 4 replicas (max step 2)"
    assert decision.direction == "up"


ZERO = policy(min_replicas=0, scale_to_zero_after_seconds=300)
IDLE = {"running_requests": 0.0, "waiting_requests": 0.0, "kv_cache_utilization": 0.0, "queue_depth_per_replica": 0.0}


@pytest.mark.parametrize(
    ("name", "current", "metrics", "gateway", "last_active_ago", "desired"),
    [
        ("idle long enough", 1, sample(ready=1, **IDLE), GatewaySample(observed_at=NOW, queued_requests=0), 301, 0),
        ("idle without gateway data", 1, sample(ready=1, **IDLE), None, 301, 0),
        ("idle not long enough", 1, sample(ready=1, **IDLE), None, 100, 1),
        ("running request", 1, sample(ready=1, **{**IDLE, "running_requests": 1.0}), None, 301, 1),
        (
            "gateway holds requests",
            1,
            sample(ready=1, **IDLE),
            GatewaySample(observed_at=NOW, queued_requests=2),
            301,
            1,
        ),
        ("stale metrics are not idleness", 1, sample(ready=1, age=120, **IDLE), None, 301, 1),
        ("no metrics are not idleness", 1, None, None, 301, 1),
        ("idle with several pods", 3, sample(ready=3, **IDLE), None, 400, 0),
        ("wake per queued demand", 0, None, GatewaySample(observed_at=NOW, queued_requests=5), 0, 3),
        ("wake to at least one", 0, None, GatewaySample(observed_at=NOW, queued_requests=1), 0, 1),
        ("wake bounded by max step", 0, None, GatewaySample(observed_at=NOW, queued_requests=100), 0, 4),
        ("stay at zero", 0, None, GatewaySample(observed_at=NOW, queued_requests=0), 0, 0),
        ("stale gateway does not wake", 0, None, GatewaySample(observed_at=NOW - 90, queued_requests=9), 0, 0),
    ],
)
def test_scale_to_zero_and_wake(
    name: str,
    current: int,
    metrics: MetricsSample | None,
    gateway: GatewaySample | None,
    last_active_ago: float,
    desired: int,
) -> None:
    zero = ZERO.model_copy(update={"scale_up_max_step": 4})
    decision = decide(
        zero,
        now=NOW,
        current_replicas=current,
        pods=PodCounts(ready=metrics.ready_pods if metrics else 0),
        metrics=metrics,
        gateway=gateway,
        state=AutoscalingState(last_active_at=NOW - last_active_ago, window=window((500, current))),
    )
    assert decision.desired_replicas == desired, decision.reason


def test_idle_clock_restarts_on_traffic_and_on_missing_data() -> None:
    state = AutoscalingState(last_active_at=NOW - 200)
    idle = decide(
        ZERO, now=NOW, current_replicas=1, pods=PodCounts(ready=1), metrics=sample(ready=1, **IDLE), state=state
    )
    assert idle.state.last_active_at == NOW - 200 and not idle.traffic_seen
    busy = decide(
        ZERO,
        now=NOW,
        current_replicas=1,
        pods=PodCounts(ready=1),
        metrics=sample(ready=1, **{**IDLE, "waiting_requests": 1.0}),
        state=state,
    )
    assert busy.state.last_active_at == NOW and busy.traffic_seen
    unknown = decide(ZERO, now=NOW, current_replicas=1, pods=PodCounts(ready=1), metrics=None, state=state)
    assert unknown.state.last_active_at == NOW


def test_zero_needs_idle_rule_not_a_low_recommendation() -> None:
    decision = decide(
        ZERO,
        now=NOW,
        current_replicas=2,
        pods=PodCounts(ready=2),
        metrics=sample(**{**IDLE, "running_requests": 3.0}),
        state=AutoscalingState(window=window((300, 0))),
    )
    assert decision.desired_replicas == 1
    assert "at least 1 while active" in decision.reason


def test_alert_prevents_scale_to_zero_and_wakes() -> None:
    intent = AlertIntent(name="QueueHigh", received_at=NOW, expires_at=NOW + 60, min_replicas=2)
    state = AutoscalingState(alerts=(intent,), last_active_at=NOW - 1000)
    kept = decide(ZERO, now=NOW, current_replicas=2, pods=PodCounts(ready=2), metrics=sample(**IDLE), state=state)
    assert kept.desired_replicas == 2
    woken = decide(ZERO, now=NOW, current_replicas=0, pods=PodCounts(ready=0), state=state)
    assert woken.desired_replicas == 2


def test_stabilisation_window_survives_a_restart() -> None:
    """The window is an input: a fresh process given the persisted state decides exactly as the old one would."""
    p = policy()
    state = AutoscalingState()
    current = 2
    history = []
    for tick in range(0, 200, 10):
        total_kv = 1.8 if tick < 30 else 0.6  # three pods' worth of load at target 0.6, then one
        kv = total_kv / current
        decision = decide(
            p,
            now=NOW + tick,
            current_replicas=current,
            pods=PodCounts(ready=current),
            metrics=MetricsSample(
                observed_at=NOW + tick,
                ready_pods=current,
                kv_cache_utilization=kv,
                running_requests=1,
                waiting_requests=0,
            ),
            state=state,
        )
        restarted = AutoscalingState.model_validate_json(decision.state.model_dump_json())
        assert restarted == decision.state
        state, current = restarted, decision.desired_replicas
        history.append((tick, current))
    assert history[0] == (0, 3)  # scaled up at once
    down_at = next(tick for tick, replicas in history if replicas < 3)
    assert down_at == 150  # the last recommendation of 3 (t=20) holds until the window has moved past t=30
    assert history[-1] == (190, 1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_replicas": 5, "max_replicas": 3}, "minReplicas (5) is greater than maxReplicas (3)"),
        ({"min_replicas": 0}, "minReplicas 0 needs scaleToZeroAfterSeconds"),
        ({"scale_to_zero_after_seconds": 60}, "set minReplicas to 0"),
        ({"tolerance": 1.5}, "less than 1"),
        ({"kv_cache_utilization": 1.5}, "less than or equal to 1"),
    ],
)
def test_policy_rejects_bad_input_with_a_fix(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AutoscalingPolicy(**fields)


def test_negative_current_is_an_error() -> None:
    with pytest.raises(ValueError, match="current_replicas must be >= 0"):
        decide(policy(), now=NOW, current_replicas=-1, pods=PodCounts(ready=0))


@pytest.mark.parametrize(
    ("current", "step", "max_step", "max_replicas", "floor"),
    [(3, 1, None, 20, 4), (3, 10, 2, 20, 5), (3, 10, None, 8, 8), (0, 2, None, 20, 2)],
)
def test_alert_intent_is_bounded(current: int, step: int, max_step: int | None, max_replicas: int, floor: int) -> None:
    p = policy(scale_up_max_step=max_step, max_replicas=max_replicas)
    intent = alert_intent("KVSaturated", now=NOW, current_replicas=current, policy=p, step=step, ttl_seconds=120)
    assert intent.min_replicas == floor
    assert intent.expires_at == NOW + 120


def test_repeated_alert_extends_without_stacking_and_resolves() -> None:
    p = policy()
    first = alert_intent("QueueHigh", now=NOW, current_replicas=3, policy=p, ttl_seconds=60)
    state = add_alert(AutoscalingState(), first)
    # Alertmanager re-sends while the alert fires; the fleet has grown to the floor meanwhile.
    again = alert_intent("QueueHigh", now=NOW + 30, current_replicas=4, policy=p, ttl_seconds=60)
    state = add_alert(state, again)
    assert [(a.name, a.min_replicas, a.received_at, a.expires_at) for a in state.alerts] == [
        ("QueueHigh", 5, NOW, NOW + 90)
    ]
    other = alert_intent("TTFTBurn", now=NOW + 30, current_replicas=4, policy=p)
    state = add_alert(state, other)
    assert {a.name for a in state.alerts} == {"QueueHigh", "TTFTBurn"}
    assert {a.name for a in remove_alert(state, "QueueHigh").alerts} == {"TTFTBurn"}


def test_expired_alerts_are_dropped_from_state() -> None:
    live = AlertIntent(name="a", received_at=NOW - 10, expires_at=NOW + 10, min_replicas=2)
    dead = AlertIntent(name="b", received_at=NOW - 100, expires_at=NOW - 1, min_replicas=2)
    decision = decide(
        policy(), now=NOW, current_replicas=2, pods=PodCounts(ready=2), state=AutoscalingState(alerts=(live, dead))
    )
    assert decision.state.alerts == (live,)


def test_alert_intent_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        alert_intent("x", now=NOW, current_replicas=1, policy=policy(), step=0)
    with pytest.raises(ValidationError, match="positive time to live"):
        AlertIntent(name="x", received_at=NOW, expires_at=NOW, min_replicas=1)


optional_float = st.one_of(st.none(), st.floats(min_value=0, max_value=50, allow_nan=False))


@settings(max_examples=300, deadline=None)
@given(
    current=st.integers(min_value=0, max_value=30),
    ready=st.integers(min_value=0, max_value=30),
    queue=optional_float,
    kv=st.one_of(st.none(), st.floats(min_value=0, max_value=1)),
    age=st.floats(min_value=0, max_value=200),
    step=st.one_of(st.none(), st.integers(min_value=1, max_value=5)),
    max_replicas=st.integers(min_value=1, max_value=25),
    records=st.lists(
        st.tuples(st.floats(min_value=0, max_value=400), st.integers(min_value=0, max_value=30)), max_size=6
    ),
)
def test_invariants(
    current: int,
    ready: int,
    queue: float | None,
    kv: float | None,
    age: float,
    step: int | None,
    max_replicas: int,
    records: list[tuple[float, int]],
) -> None:
    p = policy(max_replicas=max_replicas, scale_up_max_step=step)
    metrics = MetricsSample(
        observed_at=NOW - age,
        ready_pods=ready,
        queue_depth_per_replica=queue,
        kv_cache_utilization=kv,
        running_requests=1,
        waiting_requests=0,
    )
    decision = decide(
        p,
        now=NOW,
        current_replicas=current,
        pods=PodCounts(ready=ready),
        metrics=metrics,
        state=AutoscalingState(window=window(*records)),
    )
    desired = decision.desired_replicas
    assert 0 <= desired <= max_replicas
    if current > 0:
        assert desired >= 1  # zero only through the idle rule, which this policy does not have
    if step is not None and current > 0:
        assert desired - current <= step
    if age > p.max_metrics_age_seconds or ready == 0 or (queue is None and kv is None):
        assert desired >= min(current, max_replicas)  # missing or stale data never scales down
    assert all(record.time >= NOW - 400 for record in decision.state.window)
    assert len(decision.state.window) <= len(records) + 1
