"""The canary step machine through the planner: start, steps, analysis (missing data never passes), rollback,
promotion, restart mid-step, supersede, revert, manual promote/abort, and the pure helpers around it."""

from __future__ import annotations

import copy
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from controllers import CreatePod, DeletePod, EmitEvent, PatchStatus, RemoveAnnotations, StartDrain
from controllers.pods import PodDefaults
from controllers.rollout import (
    SERIES_POLL_SECONDS,
    SERIES_TIMEOUT_INTERVALS,
    analysis_request,
    await_series,
    canary_ready_since,
    combine,
    pod_snapshot,
    shares,
    stable_spec_of,
    variant_revisions,
)
from crds.helpers import parse_spec
from crds.models import AnalysisResult, Verdict

STEPS = [{"weight": 25, "pauseSeconds": 10}, {"weight": 50, "pauseSeconds": 10}]
ANALYSIS = {"intervalSeconds": 5, "failureLimit": 2}


def _spec(replicas=4, steps=STEPS, **extra):
    return {"replicas": replicas, "rollout": {"canary": {"steps": steps, "analysis": ANALYSIS}}, **extra}


def _rollout(c):
    return c.resource["status"]["rollout"]


def _check(c, verdict):
    """An analysis check as the shell would hand it to this pass (run at the pass's time, for the current step)."""
    c.analysis = AnalysisResult(time=c.now, step=_rollout(c)["step"], verdict=verdict, message=f"{verdict.value}: test")


def _events(plan, reason):
    return [e for e in plan.of_type(EmitEvent) if e.reason == reason]


def _pass(c, seconds=0.0, verdict=None):
    """Let time go by, then one plan/apply pass (with an analysis check of `verdict`); returns the plan."""
    c.now += timedelta(seconds=seconds)
    if verdict is not None:
        _check(c, verdict)
    plan = c.plan()
    c.apply(plan)
    return plan


def _settle(c, seconds=1.0, passes=30):
    """Passes (time moving) until a pass changes no pods."""
    for _ in range(passes):
        plan = _pass(c, seconds)
        if not (plan.of_type(CreatePod) or plan.of_type(DeletePod) or plan.of_type(StartDrain)):
            return
    raise AssertionError("no settling")


def _live_revisions(c):
    return Counter(
        p["metadata"]["labels"]["llmfleet.io/revision"]
        for p in c.pods.values()
        if "llmfleet.io/draining" not in p["metadata"]["labels"]
    )


def _started(kit, **spec):
    """A converged fleet whose spec then changed: the first pass after the change has run."""
    c = kit.cluster(_spec(**spec))
    c.converge()
    stable = _rollout(c)["stableRevision"]
    c.resource["spec"]["template"] = {"env": [{"name": "NEW", "value": "1"}]}
    plan = _pass(c)
    return c, stable, plan


# ---------------------------------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    ("weight", "desired", "expected"),
    [
        (25, 4, (3, 1)),
        (10, 4, (4, 1)),
        (50, 4, (2, 2)),
        (50, 1, (1, 1)),
        (67, 3, (1, 3)),
        (100, 3, (0, 3)),
        (1, 1, (1, 1)),
        (30, 0, (0, 0)),
    ],
)
def test_shares_of_stable_and_canary_pods(weight, desired, expected):
    assert shares(weight, desired) == expected


def test_the_first_revision_is_stable_at_once(kit):
    c = kit.cluster(_spec())
    c.converge()
    rollout = _rollout(c)
    assert rollout["phase"] == "Stable" and rollout["stableSpec"]["variants"] == [
        {"name": "default", "quantization": "none", "resources": {"nvidia.com/gpu": 0}, "extraArgs": {}}
    ]
    assert rollout["stableRevision"] == next(iter(c.pods_by_revision()))
    assert "replicas" not in rollout["stableSpec"] and "rollout" not in rollout["stableSpec"]


def test_stable_spec_keeps_pod_fields_and_takes_sizes_from_the_spec():
    old = parse_spec({"model": {"name": "m", "source": "/m"}, "variants": [{"name": "a", "weight": 1}]})
    new = parse_spec(
        {
            "model": {"name": "m", "source": "/m"},
            "replicas": 9,
            "variants": [{"name": "a", "weight": 3, "source": "/int4", "quantization": "int4"}, {"name": "b"}],
        }
    )
    stable = stable_spec_of(new, pod_snapshot(old))
    a, b = stable.variants
    assert (a.source, a.quantization, a.weight, stable.replicas) == (None, "none", 3, 9)  # a field unset before
    assert b.name == "b"  # a variant added since: no older revision
    revisions = variant_revisions("d", new, stable, PodDefaults())
    assert revisions["a"].changed and not revisions["b"].changed
    assert (revisions["a"].stable_quantization, revisions["a"].target_quantization) == ("none", "int4")
    assert stable_spec_of(new, None) is new and stable_spec_of(new, {"variants": [{"name": 1}]}) is new


def test_combine_takes_the_worst_variant():
    now = datetime(2025, 1, 1, tzinfo=UTC)
    ok = AnalysisResult(time=now, step=1, verdict=Verdict.PASS, message="Pass: fine", ttft_p95_ratio=1.0)
    bad = AnalysisResult(time=now, step=1, verdict=Verdict.FAIL, message="Fail: slow", ttft_p95_ratio=4.0)
    merged = combine({"a": ok, "b": bad}, step=1, now=now)
    assert merged.verdict == Verdict.FAIL and merged.ttft_p95_ratio == 4.0
    assert merged.message == "variant a: Pass: fine; variant b: Fail: slow"
    assert combine({"a": ok}, step=1, now=now) == ok
    assert combine({}, step=1, now=now).verdict == Verdict.INCONCLUSIVE


# ------------------------------------------------------------------------------------------------- the machine


def test_a_spec_change_starts_a_canary_beside_stable(kit):
    c, stable, plan = _started(kit)
    rollout = _rollout(c)
    canary = rollout["canaryRevision"]
    assert (rollout["phase"], rollout["step"], rollout["canaryWeight"]) == ("Progressing", 0, 25)
    assert rollout["stableRevision"] == stable != canary
    assert len(_events(plan, "CanaryStarted")) == 1
    assert [(a.revision, a.reason) for a in plan.of_type(CreatePod)] == [(canary, "Canary")]
    assert plan.of_type(StartDrain) == []  # stable keeps its 4 pods (ceil 75% of 4 = 3 + surge while moving)
    _settle(c)
    assert _live_revisions(c) == Counter({stable: 3, canary: 1})
    endpoints = {(e["revision"], e.get("canary", False)): e["weight"] for e in c.resource["status"]["endpoints"]}
    assert endpoints == {(stable, False): 75, (canary, True): 25}
    conditions = {x["type"]: x for x in c.resource["status"]["conditions"]}
    assert conditions["Progressing"]["reason"] == "CanaryProgressing"


def test_steps_advance_only_after_the_pause_ready_pods_and_a_passing_check(kit):
    c, stable, _ = _started(kit)
    canary = _rollout(c)["canaryRevision"]
    _settle(c)
    _series_appear(c)
    plan = _pass(c, 0, Verdict.PASS)  # pause of 10 s not over yet
    assert _rollout(c)["step"] == 0 and "pausing until" in _rollout(c)["message"]
    assert len(_events(plan, "AnalysisPass")) == 1 and plan.requeue_after is not None
    _pass(c, 10)  # the pause is over; the step's latest check (taken during the pause) passed
    assert _rollout(c)["step"] == 1 and _rollout(c)["canaryWeight"] == 50
    _settle(c)
    assert _live_revisions(c) == Counter({stable: 2, canary: 2})
    _pass(c, 10)
    assert _rollout(c)["step"] == 1 and "waiting for an analysis check" in _rollout(c)["message"]
    plan = _pass(c, 0, Verdict.PASS)
    assert _rollout(c)["phase"] == "Promoting" and len(_events(plan, "CanaryPromoted")) == 1
    _settle(c)
    rollout = _rollout(c)
    assert (rollout["phase"], rollout["stableRevision"], rollout.get("canaryRevision")) == ("Stable", canary, None)
    assert rollout["reason"] == "AllStepsPassed"
    assert _live_revisions(c) == Counter({canary: 4}) and len(c.pods) == 4
    assert rollout["stableSpec"]["template"]["env"] == [{"name": "NEW", "value": "1"}]
    assert [a["verdict"] for a in rollout["analysis"]] == ["Pass", "Pass"]


def test_missing_metrics_are_inconclusive_and_never_advance_a_step(kit):
    c, _, _ = _started(kit)
    _settle(c)
    for _ in range(5):
        _pass(c, 6, Verdict.INCONCLUSIVE)
    rollout = _rollout(c)
    assert (rollout["phase"], rollout["step"], rollout["consecutiveFailures"]) == ("Progressing", 0, 0)
    assert "Inconclusive" in rollout["message"]


def test_the_canary_needs_its_ready_pods_before_a_step_completes(kit):
    c, _, _ = _started(kit)
    for name, pod in c.pods.items():
        if pod["metadata"]["labels"]["llmfleet.io/revision"] == _rollout(c)["canaryRevision"]:
            c.set_ready(name, False)
    _pass(c, 30, Verdict.PASS)
    assert _rollout(c)["step"] == 0 and "canary pod(s) ready" in _rollout(c)["message"]


@pytest.mark.parametrize(
    ("verdicts", "rolled_back"),
    [
        ([Verdict.FAIL, Verdict.FAIL], True),
        ([Verdict.FAIL, Verdict.INCONCLUSIVE, Verdict.FAIL], True),  # inconclusive does not break the run
        ([Verdict.FAIL, Verdict.PASS, Verdict.FAIL], False),  # a pass does
        ([Verdict.FAIL], False),
    ],
)
def test_failure_limit_counts_failures_in_a_row(kit, verdicts, rolled_back):
    c, _, _ = _started(kit, steps=[{"weight": 25, "pauseSeconds": 600}])
    _settle(c)
    for verdict in verdicts:
        _pass(c, 5, verdict)
    assert (_rollout(c)["phase"] == "RollingBack") is rolled_back


def test_rollback_drains_the_canary_and_does_not_retry_it(kit):
    c, stable, _ = _started(kit)
    canary = _rollout(c)["canaryRevision"]
    _settle(c)
    _pass(c, 5, Verdict.FAIL)
    plan = _pass(c, 5, Verdict.FAIL)
    (warning,) = _events(plan, "CanaryRolledBack")
    assert warning.type == "Warning" and "failureLimit 2" in warning.message
    rollout = _rollout(c)
    assert (rollout["phase"], rollout["rejectedRevision"], rollout["canaryWeight"]) == ("RollingBack", canary, 0)
    assert rollout["reason"] == "AnalysisFailed"
    endpoints = {e["revision"]: e["weight"] for e in c.resource["status"]["endpoints"]}
    assert endpoints[canary] == 0 and endpoints[stable] > 0  # no traffic to the canary at once
    _settle(c)
    rollout = _rollout(c)
    assert rollout["phase"] == "RolledBack" and rollout["reason"] == "AnalysisFailed"
    assert _live_revisions(c) == Counter({stable: 4}) and len(c.pods) == 4
    conditions = {x["type"]: x for x in c.resource["status"]["conditions"]}
    assert (conditions["Progressing"]["status"], conditions["Progressing"]["reason"]) == ("False", "CanaryRolledBack")
    plan = _pass(c, 60)
    assert plan.of_type(CreatePod) == [] and _events(plan, "CanaryStarted") == []


def test_restart_mid_step_resumes_at_the_same_step(kit):
    c, _, _ = _started(kit)
    _settle(c)
    _pass(c, 10, Verdict.PASS)
    assert _rollout(c)["step"] == 1
    _settle(c)
    before = copy.deepcopy(_rollout(c))
    pods = set(c.pods)
    # A new operator process: nothing in memory, the same CR status and pods, some time later.
    c.now += timedelta(seconds=3)
    plan = c.plan()
    assert plan.of_type(CreatePod) == [] and plan.of_type(StartDrain) == [] and plan.of_type(DeletePod) == []
    assert _events(plan, "CanaryStarted") == [] and _events(plan, "CanaryStep") == []
    c.apply(plan)
    after = _rollout(c)
    assert {k: after[k] for k in ("step", "stepStartedAt", "startedAt", "canaryRevision", "canaryWeight")} == {
        k: before[k] for k in ("step", "stepStartedAt", "startedAt", "canaryRevision", "canaryWeight")
    }
    assert set(c.pods) == pods


def test_a_new_spec_supersedes_the_canary(kit):
    c, stable, _ = _started(kit)
    first = _rollout(c)["canaryRevision"]
    _settle(c)
    c.resource["spec"]["template"] = {"env": [{"name": "NEW", "value": "2"}]}
    plan = _pass(c, 1)
    second = _rollout(c)["canaryRevision"]
    assert second not in (first, stable) and _rollout(c)["step"] == 0
    assert len(_events(plan, "CanarySuperseded")) == 1 and len(_events(plan, "CanaryStarted")) == 1
    _settle(c)
    assert _live_revisions(c) == Counter({stable: 3, second: 1})
    assert not _rollout(c).get("rejectedRevision")


def test_reverting_the_spec_aborts_the_canary_without_rejecting_it(kit):
    c, stable, _ = _started(kit)
    _settle(c)
    del c.resource["spec"]["template"]
    plan = _pass(c, 1)
    assert len(_events(plan, "CanaryAborted")) == 1 and _rollout(c)["phase"] == "RollingBack"
    _settle(c)
    rollout = _rollout(c)
    assert (rollout["phase"], rollout["reason"], rollout.get("rejectedRevision")) == ("Stable", "SpecReverted", None)
    assert _live_revisions(c) == Counter({stable: 4})


def test_manual_abort_rolls_back_and_the_annotation_is_removed(kit):
    c, stable, _ = _started(kit)
    _settle(c)
    c.resource["metadata"]["annotations"] = {"llmfleet.io/abort": "true"}
    plan = _pass(c)
    assert plan.of_type(RemoveAnnotations)[0].keys == ("llmfleet.io/abort",)
    assert c.resource["metadata"]["annotations"] == {}
    assert (_rollout(c)["phase"], _rollout(c)["reason"]) == ("RollingBack", "ManualAbort")
    _settle(c)
    assert _live_revisions(c) == Counter({stable: 4})


def test_manual_promote_skips_the_remaining_steps_even_for_a_rejected_revision(kit):
    c, _, _ = _started(kit)
    canary = _rollout(c)["canaryRevision"]
    _settle(c)
    c.resource["metadata"]["annotations"] = {"llmfleet.io/abort": "true"}
    _settle(c)
    assert _rollout(c)["phase"] == "RolledBack"
    c.resource["metadata"]["annotations"] = {"llmfleet.io/promote": "true"}
    plan = _pass(c)
    assert plan.of_type(RemoveAnnotations)[0].keys == ("llmfleet.io/promote",)
    assert (_rollout(c)["phase"], _rollout(c)["reason"]) == ("Promoting", "ManualPromote")
    _settle(c)
    rollout = _rollout(c)
    assert (rollout["phase"], rollout["stableRevision"], rollout.get("rejectedRevision")) == ("Stable", canary, None)
    assert _live_revisions(c) == Counter({canary: 4})


def test_commands_without_a_canary_are_ignored_and_removed(kit):
    c = kit.cluster(_spec())
    c.converge()
    c.resource["metadata"]["annotations"] = {"llmfleet.io/promote": "true", "llmfleet.io/abort": "true", "x": "1"}
    plan = _pass(c)
    assert {e.reason for e in plan.of_type(EmitEvent)} >= {"PromoteIgnored", "AbortIgnored"}
    assert c.resource["metadata"]["annotations"] == {"x": "1"}
    assert plan.of_type(CreatePod) == [] and plan.of_type(StartDrain) == []


def test_without_a_rollout_spec_changes_replace_pods_through_drains(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    old = _rollout(c)["stableRevision"]
    c.resource["spec"]["engine"] = {"maxNumSeqs": 8}
    plan = _pass(c)
    new = _rollout(c)["stableRevision"]
    assert new != old and _rollout(c)["phase"] == "Promoting" and len(_events(plan, "RollingReplace")) == 1
    _settle(c)
    assert _rollout(c)["phase"] == "Stable" and _live_revisions(c) == Counter({new: 2})
    assert not any(e.get("canary") for e in c.resource["status"]["endpoints"])


def test_removing_the_rollout_spec_mid_canary_promotes(kit):
    c, _, _ = _started(kit)
    canary = _rollout(c)["canaryRevision"]
    _settle(c)
    del c.resource["spec"]["rollout"]
    _pass(c)
    assert (_rollout(c)["phase"], _rollout(c)["reason"]) == ("Promoting", "RolloutSpecRemoved")
    _settle(c)
    assert _live_revisions(c) == Counter({canary: 4})


def test_a_full_weight_step_completes_without_stable_traffic_unless_a_check_fails(kit):
    c, stable, _ = _started(kit, steps=[{"weight": 100, "pauseSeconds": 5}])
    canary = _rollout(c)["canaryRevision"]
    _settle(c)
    assert _live_revisions(c) == Counter({canary: 4})  # stable has no share at 100%
    endpoints = {e["revision"]: e["weight"] for e in c.resource["status"]["endpoints"]}
    assert endpoints == {canary: 100, stable: 0}
    _pass(c, 6, Verdict.FAIL)
    assert _rollout(c)["phase"] == "Progressing"
    _pass(c, 5, Verdict.INCONCLUSIVE)  # no stable requests to compare with: not a failure
    assert _rollout(c)["phase"] == "Promoting"


def test_quantization_changes_need_the_quality_probe(kit):
    c = kit.cluster(_spec())
    c.converge()
    c.resource["spec"]["variants"][0]["quantization"] = "int4"
    _pass(c)
    request = analysis_request(c.resource, c.now + timedelta(seconds=5), PodDefaults())
    (comparison,) = request.comparisons
    assert comparison.quality_required and comparison.canary == _rollout(c)["canaryRevision"]
    assert (request.step, request.window_s, request.model) == (0, 5.0, "smollm2")


def _series_appear(c, seconds=0.0):
    """A pass in which the shell found the canary's metrics series (the analysis clock starts at its time)."""
    c.now += timedelta(seconds=seconds)
    c.metrics_since = c.now
    c.apply(c.plan())
    return c.now


def test_analysis_is_due_every_interval_and_only_for_the_running_canary(kit):
    c, _, _ = _started(kit)
    _series_appear(c)
    assert analysis_request(c.resource, c.now + timedelta(seconds=4), PodDefaults()) is None
    assert analysis_request(c.resource, c.now + timedelta(seconds=5), PodDefaults()) is not None
    _pass(c, 5, Verdict.INCONCLUSIVE)
    assert analysis_request(c.resource, c.now + timedelta(seconds=4), PodDefaults()) is None
    assert analysis_request(c.resource, c.now + timedelta(seconds=5), PodDefaults()) is not None
    moved = copy.deepcopy(c.resource)
    moved["spec"]["template"] = {"env": [{"name": "NEW", "value": "3"}]}  # the next pass supersedes this canary
    assert analysis_request(moved, c.now + timedelta(seconds=60), PodDefaults()) is None
    stable = kit.cluster(_spec())
    stable.converge()
    assert analysis_request(stable.resource, stable.now + timedelta(hours=1), PodDefaults()) is None


def test_status_patch_clears_fields_that_went_away(kit):
    c, _, _ = _started(kit)
    _settle(c)
    c.resource["metadata"]["annotations"] = {"llmfleet.io/abort": "true"}
    plan = c.plan()
    (patch,) = plan.of_type(PatchStatus)
    assert patch.status["rollout"]["canaryRevision"] is None  # sent as null: a merge patch removes it
    assert patch.status["rollout"]["stepStartedAt"] is None


def test_only_changed_variants_run_a_canary(kit):
    c = kit.cluster(_spec(replicas=4, variants=[{"name": "a", "weight": 1}, {"name": "b", "weight": 1}]))
    c.converge()
    before = dict(c.pods)
    c.resource["spec"]["variants"][0]["extraArgs"] = {"enforce-eager": True}
    _pass(c)
    _settle(c)
    rollout = _rollout(c)
    endpoints = [(e["variant"], e.get("canary", False), e["weight"]) for e in c.resource["status"]["endpoints"]]
    assert endpoints == [("a", False, 75), ("a", True, 25), ("b", False, 100)]
    canary_pods = [
        n for n, p in c.pods.items() if p["metadata"]["labels"]["llmfleet.io/revision"] == rollout["canaryRevision"]
    ]
    assert len(canary_pods) == 1 and canary_pods[0].startswith("smollm2-a-")
    assert {n: p for n, p in c.pods.items() if n.startswith("smollm2-b-")} == {
        n: p for n, p in before.items() if n.startswith("smollm2-b-")
    }


def test_superseding_a_canary_with_the_rejected_revision_stops_it_without_rejecting_it(kit):
    c, stable, _ = _started(kit)
    rejected = _rollout(c)["canaryRevision"]
    _settle(c)
    c.resource["metadata"]["annotations"] = {"llmfleet.io/abort": "true"}
    _settle(c)
    c.resource["spec"]["template"] = {"env": [{"name": "NEW", "value": "2"}]}
    _pass(c)
    second = _rollout(c)["canaryRevision"]
    assert _rollout(c)["phase"] == "Progressing" and _rollout(c)["rejectedRevision"] == rejected
    _settle(c)
    c.resource["spec"]["template"] = {"env": [{"name": "NEW", "value": "1"}]}  # back to the rejected one
    plan = _pass(c)
    assert len(_events(plan, "CanaryAborted")) == 1 and _events(plan, "CanaryStarted") == []
    _settle(c)
    rollout = _rollout(c)
    assert (rollout["phase"], rollout["rejectedRevision"]) == ("RolledBack", rejected)  # not `second`
    assert _live_revisions(c) == Counter({stable: 4}) and second not in _live_revisions(c)


# ---------------------------------------------------------------------------------------- the analysis clock


def test_no_check_runs_before_the_canary_series_appear_and_the_clock_starts_then(kit):
    c, _, _ = _started(kit, steps=[{"weight": 25, "pauseSeconds": 0}])
    started = c.now
    for seconds in (0, 5, 60):  # however late: until the series appear, the shell only looks for them
        waiting = analysis_request(c.resource, started + timedelta(seconds=seconds), PodDefaults())
        assert waiting is not None and waiting.awaiting_series, seconds
    plan = _pass(c, 3)
    assert _rollout(c).get("canaryMetricsSince") is None
    assert "waiting for the canary's metrics series" in _rollout(c)["message"]
    assert plan.requeue_after is not None and plan.requeue_after <= SERIES_POLL_SECONDS  # it looks again soon
    appeared = _series_appear(c, 4)  # 7 s after the canary started
    assert _rollout(c)["canaryMetricsSince"] == appeared.isoformat().replace("+00:00", "Z")
    assert analysis_request(c.resource, appeared + timedelta(seconds=4.9), PodDefaults()) is None
    due = analysis_request(c.resource, appeared + timedelta(seconds=5), PodDefaults())
    assert due is not None and not due.awaiting_series  # one interval of data: the first check
    _series_appear(c, 1)  # found again (e.g. after an operator restart): the clock keeps its start
    assert _rollout(c)["canaryMetricsSince"] == appeared.isoformat().replace("+00:00", "Z")


def test_the_clock_restarts_for_a_new_canary(kit):
    c, _, _ = _started(kit)
    _series_appear(c)
    c.resource["spec"]["template"] = {"env": [{"name": "NEW", "value": "2"}]}  # supersedes the canary
    _pass(c, 1)
    assert _rollout(c).get("canaryMetricsSince") is None
    assert analysis_request(c.resource, c.now + timedelta(seconds=30), PodDefaults()).awaiting_series


def _waiting(kit, **spec):
    c, _, _ = _started(kit, **spec)
    request = analysis_request(c.resource, c.now, PodDefaults())
    assert request is not None and request.awaiting_series
    return c, request


@pytest.mark.parametrize(
    ("present", "ready_after_s", "now_s", "since", "failed"),
    [
        (True, 1, 1, 1, None),  # the series are there: the clock starts now
        (False, 1, 5, None, None),  # not yet, deadline 1 + 2 x 5 s
        (False, 1, 10.9, None, None),
        (False, 1, 11, None, "no canary metrics after 10 s"),  # 2 intervals after the canary was ready
        (False, 30.5, 40, None, None),  # a slow start counts from readiness, not from the canary's start
        (False, 30.5, 40.5, None, "no canary metrics after 10 s"),
        (False, None, 10, None, "no canary metrics after 10 s"),  # readiness unknown: from the step's start
        (True, None, 12, 12, None),
    ],
)
def test_await_series(kit, present, ready_after_s, now_s, since, failed):
    c, request = _waiting(kit)
    start = c.now
    ready = start + timedelta(seconds=ready_after_s) if ready_after_s is not None else None
    wait = await_series(request, present=present, ready_since=ready, now=start + timedelta(seconds=now_s))
    assert wait.metrics_since == (start + timedelta(seconds=since) if since is not None else None)
    if failed is None:
        assert wait.result is None
    else:
        assert wait.result.verdict == Verdict.FAIL and failed in wait.result.message
        assert wait.result.step == 0 and wait.result.time == start + timedelta(seconds=now_s)
    assert SERIES_TIMEOUT_INTERVALS == 2


def test_without_series_a_failed_check_repeats_once_per_interval_until_the_failure_limit(kit):
    c, _, _ = _started(kit)
    start = c.now
    verdicts = []
    for second in range(1, 40):
        request = analysis_request(c.resource, start + timedelta(seconds=second), PodDefaults())
        if request is None:  # rolled back
            break
        wait = await_series(request, present=False, ready_since=start, now=start + timedelta(seconds=second))
        if wait.result is not None:
            verdicts.append((second, wait.result.verdict))
            c.analysis = wait.result
        _pass(c, (start + timedelta(seconds=second) - c.now).total_seconds())
    assert verdicts == [(10, Verdict.FAIL), (15, Verdict.FAIL)]  # failureLimit 2, one interval apart
    assert _rollout(c)["reason"] == "AnalysisFailed" and "no canary metrics after" in _rollout(c)["message"]


@pytest.mark.parametrize(
    ("pods", "expected_s"),
    [
        ([], None),
        ([("canary", True, 12)], 12),
        ([("canary", True, 12), ("canary", True, 7)], 7),
        ([("canary", False, 3), ("canary", True, 9)], 9),  # unready pods do not count
        ([("stable", True, 1), ("canary", True, 9)], 9),  # other revisions do not count
        ([("canary", True, None)], None),  # no transition time
    ],
)
def test_canary_ready_since(pods, expected_s):
    base = datetime(2025, 1, 1, tzinfo=UTC)

    def pod(revision, ready, at):
        condition = {"type": "Ready", "status": "True" if ready else "False"}
        if at is not None:
            condition["lastTransitionTime"] = (base + timedelta(seconds=at)).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "metadata": {"labels": {"llmfleet.io/variant": "default", "llmfleet.io/revision": revision}},
            "status": {"phase": "Running", "conditions": [condition]},
        }

    found = canary_ready_since([pod(*p) for p in pods], "default", "canary")
    assert found == (base + timedelta(seconds=expected_s) if expected_s is not None else None)
