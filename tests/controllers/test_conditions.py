"""kstatus conditions (Ready / Reconciling / Stalled): the pure rules, then through the planner at each phase of a
deployment's life: first rollout, canary, promotion, rollback, invalid spec, stuck pods, scale to zero, deletion."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controllers.conditions import Health, kstatus_conditions, merge_conditions
from controllers.reasons import Reason
from crds.models import AnalysisResult, Verdict

STEPS = [{"weight": 25, "pauseSeconds": 10}, {"weight": 50, "pauseSeconds": 10}]
ANALYSIS = {"intervalSeconds": 5, "failureLimit": 2}


def _triple(health):
    return [(c.type.value, c.status.value, c.reason) for c in kstatus_conditions(health)]


@pytest.mark.parametrize(
    ("health", "expected"),
    [
        (
            Health(summary="a 2/2 ready"),
            [("Ready", "True", "Current"), ("Reconciling", "False", "Reconciled"), ("Stalled", "False", "NotStalled")],
        ),
        (
            Health(scaled_to_zero=True),
            [
                ("Ready", "True", "ScaledToZero"),
                ("Reconciling", "False", "Reconciled"),
                ("Stalled", "False", "NotStalled"),
            ],
        ),
        (
            Health(moving=[(Reason.CANARY_PROGRESSING, "step 1/2"), (Reason.SCALING_UP, "a: up")]),
            [
                ("Ready", "False", "CanaryProgressing"),
                ("Reconciling", "True", "CanaryProgressing"),
                ("Stalled", "False", "NotStalled"),
            ],
        ),
        (
            Health(serving=False),
            [
                ("Ready", "False", "ReplicasUnavailable"),
                ("Reconciling", "False", "Reconciled"),
                ("Stalled", "False", "NotStalled"),
            ],
        ),
        (
            Health(trouble=(Reason.API_ERROR, "boom")),
            [
                ("Ready", "False", "ApiError"),
                ("Reconciling", "False", "Reconciled"),
                ("Stalled", "False", "NotStalled"),
            ],
        ),
        # Stalled wins over moving: kstatus reads Reconciling first, so both true would hide the failure.
        (
            Health(stalled=[(Reason.CANARY_ROLLED_BACK, "fix it")], moving=[(Reason.DRAINING, "d")]),
            [
                ("Ready", "False", "CanaryRolledBack"),
                ("Reconciling", "False", "Stalled"),
                ("Stalled", "True", "CanaryRolledBack"),
            ],
        ),
        (
            Health(stalled=[(Reason.INVALID_SPEC, "x"), (Reason.PODS_CANNOT_START, "y")]),
            [
                ("Ready", "False", "InvalidSpec"),
                ("Reconciling", "False", "Stalled"),
                ("Stalled", "True", "InvalidSpec"),
            ],
        ),
    ],
)
def test_kstatus_rules(health, expected):
    assert _triple(health) == expected


def test_stalled_message_lists_every_problem():
    conditions = kstatus_conditions(Health(stalled=[(Reason.INVALID_SPEC, "a"), (Reason.CANARY_ROLLED_BACK, "b")]))
    assert conditions[2].message == "a; b"


def test_transition_time_kept_while_status_unchanged(kit):
    first = merge_conditions([], kstatus_conditions(Health()), kit.now, 1)
    later = merge_conditions(first, kstatus_conditions(Health(summary="new text")), kit.now + timedelta(hours=1), 2)
    assert [c.last_transition_time for c in later] == [kit.now] * 3


# ------------------------------------------------------------------------------------------------ via the planner


def _conditions(c):
    return {x["type"]: (x["status"], x["reason"]) for x in c.resource["status"]["conditions"]}


def _kstatus(c):
    found = _conditions(c)
    return tuple(found.get(kind) for kind in ("Ready", "Reconciling", "Stalled"))


def _pass(c, seconds=1.0, verdict=None):
    c.now += timedelta(seconds=seconds)
    if verdict is not None:
        step = c.resource["status"]["rollout"]["step"]
        c.analysis = AnalysisResult(time=c.now, step=step, verdict=verdict, message=f"{verdict.value}: test")
    plan = c.plan()
    c.apply(plan)
    return plan


def _settled(kit, replicas=2, **spec):
    c = kit.cluster({"replicas": replicas, **spec})
    c.converge()
    _pass(c)
    return c


def test_first_rollout_is_reconciling_until_pods_are_ready_then_ready(kit):
    c = kit.cluster({"replicas": 2})
    c.apply(c.plan(), ready=False)
    assert _kstatus(c) == (("False", "ScalingUp"), ("True", "ScalingUp"), ("False", "NotStalled"))
    _pass(c)
    assert _kstatus(c)[1] == ("True", "PodsStarting")
    for name in c.pods:
        c.set_ready(name)
    _pass(c)
    assert _kstatus(c) == (("True", "Current"), ("False", "Reconciled"), ("False", "NotStalled"))


def test_a_canary_is_reconciling_until_promoted(kit):
    c = _settled(kit, 4, rollout={"canary": {"steps": STEPS, "analysis": ANALYSIS}})
    c.resource["spec"]["template"] = {"env": [{"name": "NEW", "value": "1"}]}
    c.resource["metadata"]["generation"] = 2
    seen = set()
    for _ in range(40):
        _pass(c, 5, Verdict.PASS if c.resource["status"]["rollout"].get("canaryRevision") else None)
        ready, reconciling, stalled = _kstatus(c)
        seen.add(reconciling[1])
        if c.resource["status"]["rollout"]["phase"] == "Stable" and ready[0] == "True":
            break
        assert ready[0] == "False" and reconciling[0] == "True" and stalled[0] == "False"
    assert _kstatus(c) == (("True", "Current"), ("False", "Reconciled"), ("False", "NotStalled"))
    assert "CanaryProgressing" in seen


def test_a_rollback_is_stalled_until_the_spec_changes(kit):
    c = _settled(kit, 2, rollout={"canary": {"steps": STEPS, "analysis": ANALYSIS}})
    c.resource["spec"]["template"] = {"env": [{"name": "BAD", "value": "1"}]}
    c.resource["metadata"]["annotations"] = {"llmfleet.io/abort": "true"}
    _pass(c)  # the canary starts
    c.resource["metadata"]["annotations"] = {"llmfleet.io/abort": "true"}
    _pass(c)  # and is aborted: a rollback
    assert c.resource["status"]["rollout"]["phase"] == "RollingBack"
    assert _kstatus(c) == (("False", "CanaryRolledBack"), ("False", "Stalled"), ("True", "CanaryRolledBack"))
    for _ in range(10):
        _pass(c)
    assert c.resource["status"]["rollout"]["phase"] == "RolledBack"
    stalled = next(x for x in c.resource["status"]["conditions"] if x["type"] == "Stalled")
    assert stalled["status"] == "True" and "llmfleet.io/promote=true" in stalled["message"]
    del c.resource["spec"]["template"]  # back to the stable revision: nothing is stalled any more
    for _ in range(5):
        _pass(c)
    assert _kstatus(c) == (("True", "Current"), ("False", "Reconciled"), ("False", "NotStalled"))


def test_reverting_a_running_canary_reconciles_without_stalling(kit):
    c = _settled(kit, 2, rollout={"canary": {"steps": STEPS, "analysis": ANALYSIS}})
    c.resource["spec"]["template"] = {"env": [{"name": "NEW", "value": "1"}]}
    _pass(c)
    c.converge()
    del c.resource["spec"]["template"]
    _pass(c)
    assert c.resource["status"]["rollout"]["phase"] == "RollingBack"
    assert _kstatus(c)[1:] == (("True", "RollingBack"), ("False", "NotStalled"))


def test_an_invalid_edit_is_stalled_while_the_last_valid_spec_runs(kit):
    c = _settled(kit, 2)
    c.resource["spec"]["variants"] = [{"name": "default", "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}]
    c.resource["metadata"]["generation"] = 2
    _pass(c)
    assert _kstatus(c) == (("False", "InvalidSpec"), ("False", "Stalled"), ("True", "InvalidSpec"))


def test_a_never_valid_spec_is_stalled(kit):
    c = kit.cluster({"variants": []})
    _pass(c)
    assert _kstatus(c) == (("False", "InvalidSpec"), ("False", "Stalled"), ("True", "InvalidSpec"))


def test_pods_that_cannot_start_are_stalled(kit):
    c = kit.cluster({"replicas": 1})
    c.apply(c.plan(), ready=False)
    (name,) = c.pods
    c.pods[name]["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "ImagePullBackOff"}}
    _pass(c)
    ready, reconciling, stalled = _kstatus(c)
    assert stalled == ("True", "PodsCannotStart") and reconciling[0] == "False" and ready[0] == "False"


def test_scaled_to_zero_on_purpose_is_ready(kit):
    c = _settled(kit, 2)
    c.resource["spec"]["replicas"] = 0
    for _ in range(5):
        _pass(c)
    assert not c.pods
    assert _kstatus(c) == (("True", "ScaledToZero"), ("False", "Reconciled"), ("False", "NotStalled"))


def test_deletion_is_reconciling(kit):
    c = _settled(kit, 1)
    c.resource["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    _pass(c)
    assert _kstatus(c) == (("False", "Terminating"), ("True", "Terminating"), ("False", "NotStalled"))
