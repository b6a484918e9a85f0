"""The autoscaling pass around `decide` (`controllers.autoscaling_plan`) as tables: pods -> PodCounts, alert
intents, the bounded window and decision history, status entries and patches, the scale Event, and which CRs
the timers evaluate."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controllers.autoscaling import GatewaySample, MetricsSample, PodCounts
from controllers.autoscaling_plan import (
    ScaleIntent,
    VariantInputs,
    autoscaling_patch,
    collapse_runs,
    compact_window,
    evaluate_variants,
    intents_for,
    owned,
    pod_counts,
    scale_event,
    variants_at_zero,
    wants_autoscaling,
)
from controllers.testing import iso, scale_intent, worker_pod
from crds.helpers import parse_spec
from crds.models import AutoscalingStatus, DecisionTrigger, Recommendation

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC).timestamp()
NS, NAME, UID = "ns", "demo", "uid-demo"


def pod(name: str, **kwargs: Any) -> dict[str, Any]:
    """A worker pod of NAME in NS owned by UID, 100 s old at T0 (see controllers.testing.worker_pod)."""
    return worker_pod(name, **{"namespace": NS, "deployment": NAME, "now": T0, "owner": UID, **kwargs})


# ---------------------------------------------------------------------------------------------------- pods


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        ([], PodCounts(ready=0)),
        ([pod("a", ready_at=T0 - 50)], PodCounts(ready=1, ready_since=(T0 - 50,))),
        ([pod("a", created=T0 - 5)], PodCounts(ready=0, starting_since=(T0 - 5,))),
        (
            [pod("a", ready_at=T0 - 50), pod("b", created=T0 - 3), pod("c", created=T0 - 9)],
            PodCounts(ready=1, ready_since=(T0 - 50,), starting_since=(T0 - 9, T0 - 3)),
        ),
        ([pod("a", ready_at=T0 - 50, draining=True), pod("b", deleting=True)], PodCounts(ready=0, draining=2)),
        ([pod("a", phase="Failed"), pod("b", phase="Succeeded")], PodCounts(ready=0)),
        ([pod("a", variant="other", ready_at=T0)], PodCounts(ready=0)),
    ],
    ids=["none", "ready", "starting", "mixed-sorted", "leaving", "ended", "other-variant"],
)
def test_pod_counts(pods, expected):
    assert pod_counts(pods, "default") == expected


def test_pod_counts_reads_missing_times_as_long_ago():
    ready, starting = pod("a", ready_at=T0), pod("b")
    del ready["status"]["conditions"][0]["lastTransitionTime"]
    del ready["metadata"]["creationTimestamp"]
    del starting["metadata"]["creationTimestamp"]
    assert pod_counts([ready, starting], "default") == PodCounts(ready=1, ready_since=(0.0,), starting_since=(0.0,))


def test_only_pods_the_deployment_controls_count():
    mine, stranger = pod("a"), pod("b", owner="someone-else")
    stranger["metadata"]["ownerReferences"].append({"uid": UID})  # owned, but not as controller
    assert owned([mine, stranger, {"metadata": {}}], UID) == [mine]


# -------------------------------------------------------------------------------------------------- alerts


def intent(alert: str = "QueueHigh", **kwargs: Any) -> ScaleIntent:
    """An alert for NAME in NS received at T0 (see controllers.testing.scale_intent)."""
    return scale_intent(alert, **{"deployment": NAME, "namespace": NS, "at": T0, **kwargs})


@pytest.mark.parametrize(
    ("candidate", "matches"),
    [
        (intent(), True),
        (intent(namespace=None), True),
        (intent(variant="default"), True),
        (intent(variant="other"), False),
        (intent(namespace="elsewhere"), False),
        (intent(deployment="other"), False),
    ],
)
def test_intents_for(candidate, matches):
    assert intents_for([candidate], NS, NAME, "default") == ([candidate] if matches else [])


# ------------------------------------------------------------------------------------------ window and status


@given(st.lists(st.integers(0, 6), min_size=1, max_size=60), st.integers(1, 20))
def test_compacting_the_window_keeps_the_oldest_record_and_every_suffix_maximum(replicas, limit):
    records = [Recommendation(time=datetime.fromtimestamp(T0 + i, tz=UTC), replicas=r) for i, r in enumerate(replicas)]
    kept = compact_window(records, limit)
    if len(records) <= limit:
        assert kept == records
        return
    assert kept[0] == records[0] and all(r in records for r in kept)
    assert kept == sorted(kept, key=lambda r: r.time)
    assert len(kept) <= 1 + len(set(replicas))
    for start in range(1, len(records)):
        since = records[start].time
        assert max(r.replicas for r in kept[1:] if r.time >= since) == max(r.replicas for r in records[start:])


@pytest.mark.parametrize(
    ("replicas", "kept"),
    [([], []), ([2, 2, 2], [0]), ([2, 3, 3, 1, 1, 2], [0, 1, 3, 5])],
)
def test_collapse_runs_keeps_the_first_record_of_each_run(replicas, kept):
    records = [Recommendation(time=datetime.fromtimestamp(T0 + i, tz=UTC), replicas=r) for i, r in enumerate(replicas)]
    assert collapse_runs(records) == [records[i] for i in kept]


SPEC = {
    "model": {"name": "m", "source": "bundled://smollm2-135m-instruct"},
    "variants": [
        {
            "name": "default",
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 6,
                "targets": {"queueDepthPerReplica": 2},
                "scaleDownStabilizationSeconds": 30,
            },
        },
        {"name": "fixed", "replicas": 2},
    ],
}


def _metrics(queue: float, ready: int = 1, at: float = T0) -> MetricsSample:
    return MetricsSample(
        observed_at=at,
        ready_pods=ready,
        queue_depth_per_replica=queue,
        running_requests=float(ready),
        waiting_requests=queue * ready,
    )


def _ready(n: int) -> PodCounts:
    return PodCounts(ready=n, ready_since=tuple(T0 - 600 for _ in range(n)))


def _evaluate(
    status: AutoscalingStatus, inputs: dict[str, VariantInputs], *, now: float = T0, spec=SPEC, intents=()
) -> list:
    return list(
        evaluate_variants(
            parse_spec(spec), status, inputs, namespace=NS, deployment=NAME, now=now, intents=intents
        ).outcomes
    )


def test_only_autoscaled_variants_with_inputs_are_decided_from_the_initial_size():
    (outcome,) = _evaluate(
        AutoscalingStatus(),
        {"default": VariantInputs(_ready(1), _metrics(8)), "fixed": VariantInputs(_ready(2), _metrics(8))},
    )
    assert outcome.variant == "default" and outcome.trigger == DecisionTrigger.TIMER
    assert (outcome.decision.current_replicas, outcome.decision.desired_replicas) == (1, 4)
    assert outcome.entry.desired_replicas == 4 and outcome.entry.last_decisions[-1].inputs.queue_depth_per_replica == 8
    assert _evaluate(AutoscalingStatus(), {}) == []


def test_missing_metrics_hold_the_size():
    (first,) = _evaluate(AutoscalingStatus(), {"default": VariantInputs(_ready(1), _metrics(8))})
    status = AutoscalingStatus(variants=[first.entry])
    (held,) = _evaluate(status, {"default": VariantInputs(_ready(4), None)}, now=T0 + 600)
    assert held.decision.desired_replicas == 4 and "missing data never scales down" in held.decision.reason


def test_a_firing_alert_adds_a_bounded_expiring_floor_and_a_resolved_one_removes_it():
    (outcome,) = _evaluate(
        AutoscalingStatus(),
        {"default": VariantInputs(_ready(1), _metrics(0))},
        intents=[intent(step=2), intent("Other", deployment="x")],
    )
    assert outcome.trigger == DecisionTrigger.ALERT and outcome.decision.desired_replicas == 3
    (stored,) = outcome.entry.alert_intents
    assert (stored.alert, stored.replicas, stored.fingerprint, stored.reason) == (
        "QueueHigh",
        3,
        "fp-QueueHigh",
        "summary of QueueHigh",
    )
    assert stored.expires_at.timestamp() == T0 + 300
    status = AutoscalingStatus(variants=[outcome.entry])
    (later,) = _evaluate(
        status,
        {"default": VariantInputs(_ready(3), _metrics(0, 3))},
        now=T0 + 10,
        intents=[intent(firing=False, at=T0 + 10)],
    )
    assert later.entry.alert_intents == [] and later.trigger == DecisionTrigger.ALERT
    assert later.decision.desired_replicas == 3  # scale-down still waits for the stabilisation window


def test_gateway_queue_wakes_a_variant_at_zero():
    spec = copy.deepcopy(SPEC)
    spec["variants"][0]["autoscaling"].update(minReplicas=0, scaleToZeroAfterSeconds=60)
    status = AutoscalingStatus.model_validate({"variants": [{"name": "default", "desiredReplicas": 0}]})
    (idle,) = _evaluate(status, {"default": VariantInputs(PodCounts(ready=0))}, spec=spec)
    assert idle.decision.desired_replicas == 0 and idle.trigger == DecisionTrigger.TIMER
    queued = GatewaySample(observed_at=T0, queued_requests=5)
    (woken,) = _evaluate(status, {"default": VariantInputs(PodCounts(ready=0), None, queued)}, spec=spec)
    assert woken.trigger == DecisionTrigger.WAKE and woken.decision.desired_replicas == 3
    assert woken.entry.last_decisions[-1].inputs.gateway_queued == 5


def test_repeated_decisions_and_recommendations_are_recorded_once():
    status = AutoscalingStatus()
    for tick in range(4):
        (outcome,) = _evaluate(status, {"default": VariantInputs(_ready(1), _metrics(2))}, now=T0 + tick)
        status = AutoscalingStatus(variants=[outcome.entry])
    (only,) = status.variants[0].last_decisions
    assert only.time.timestamp() == T0 and only.desired_replicas == 1  # held since then
    assert [r.time.timestamp() for r in status.variants[0].recommendations] == [T0]
    (outcome,) = _evaluate(status, {"default": VariantInputs(_ready(1), _metrics(8))}, now=T0 + 4)
    assert [d.desired_replicas for d in outcome.entry.last_decisions] == [1, 4]


def test_a_long_window_is_compacted_before_it_outgrows_the_status():
    spec = copy.deepcopy(SPEC)
    spec["variants"][0]["autoscaling"]["scaleDownStabilizationSeconds"] = 3600
    window = [{"time": iso(T0 - 1000 + i), "replicas": 1 + i % 3} for i in range(1000)]
    status = AutoscalingStatus.model_validate(
        {"variants": [{"name": "default", "desiredReplicas": 3, "recommendations": window}]}
    )
    (outcome,) = _evaluate(status, {"default": VariantInputs(_ready(3), _metrics(0, 3))}, spec=spec)
    kept = outcome.entry.recommendations
    assert len(kept) <= 4 and kept[0].time.timestamp() == T0 - 1000
    assert max(r.replicas for r in kept) == 3 and outcome.decision.desired_replicas == 3


def test_patch_keeps_undecided_entries_drops_unscaled_variants_and_is_none_when_nothing_changes():
    spec = parse_spec(SPEC)
    previous = AutoscalingStatus.model_validate(
        {"variants": [{"name": "default", "desiredReplicas": 2}, {"name": "fixed", "desiredReplicas": 5}]}
    )
    patch = autoscaling_patch(spec, previous, [])
    assert patch == {
        "autoscaling": {
            "variants": [
                {
                    "name": "default",
                    "desiredReplicas": 2,
                    "lastDecisions": [],
                    "recommendations": [],
                    "alertIntents": [],
                }
            ]
        }
    }
    kept = AutoscalingStatus.model_validate(patch["autoscaling"])
    assert autoscaling_patch(spec, kept, []) is None
    (outcome,) = _evaluate(kept, {"default": VariantInputs(_ready(2), _metrics(8, 2))})
    decided = autoscaling_patch(spec, kept, [outcome])
    assert decided["autoscaling"]["variants"][0]["desiredReplicas"] == 6
    assert scale_event(outcome).reason == "Autoscaled"
    assert scale_event(outcome).message.startswith("variant default: 2 -> 6 replicas (timer): queue depth 8/replica")


@pytest.mark.parametrize(
    ("body", "wanted"),
    [
        ({"spec": SPEC}, True),
        ({"spec": {"variants": [{"name": "a", "replicas": 1}]}}, False),
        ({"spec": {"variants": [{"name": "a"}]}, "status": {"autoscaling": {"variants": [{"name": "a"}]}}}, True),
        ({}, False),
    ],
)
def test_wants_autoscaling(body, wanted):
    assert wants_autoscaling(body) is wanted


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (
            {"autoscaling": {"variants": [{"name": "a", "desiredReplicas": 0}, {"name": "b", "desiredReplicas": 2}]}},
            ["a"],
        ),
        ({"autoscaling": {"variants": [{"name": "a", "desiredReplicas": 1}]}}, []),
        ({"autoscaling": {"variants": [{"name": "a"}]}}, []),  # not decided yet: not at zero
        ({}, []),
    ],
)
def test_variants_at_zero(status, expected):
    assert variants_at_zero({"status": status}) == expected
