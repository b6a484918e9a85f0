"""Table-driven tests of the LoRA adapter planner (`controllers.adapters.plan_adapters`): loads, reloads in place,
unloads, per-pod status, failures with one Warning Event each, back-off, unanswered probes, the AdaptersReady
condition."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controllers import AdapterProbe, AdapterResult, EventType, LoadAdapter, PodInfo, ProbeState, UnloadAdapter
from controllers.adapters import (
    CONFIRM_AFTER_S,
    RETRY_FIRST_S,
    RETRY_MAX_S,
    UNANSWERED_RETRY_S,
    AdapterInput,
    AdapterPlan,
    plan_adapters,
    retry_delay,
)
from controllers.observed import PodPhase
from crds.models import AdapterPodState, AdapterPodStatus, AdapterSpec, AdapterStatus

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
A1 = AdapterSpec(name="a1", source="/adapters/a1")
A2 = AdapterSpec(name="a2", source="hf://org/a2")
P0, P1 = "pod-0", "pod-1"
ADDRESSES = {P0: "10.0.0.10:8000", P1: "10.0.0.11:8000"}


def _pod(name: str) -> PodInfo:
    return PodInfo(name=name, revision="r1", phase=PodPhase.RUNNING, ready=True, ip=ADDRESSES[name].split(":")[0])


PODS = (_pod(P0), _pod(P1))


def _serves(*names: str) -> AdapterProbe:
    return AdapterProbe(ProbeState.ANSWERED, adapters=frozenset(names))


def _given(**overrides) -> AdapterInput:
    """Two eligible pods that answered their probes serving nothing, one adapter (a1) in the spec, no history."""
    values = dict(
        adapters=[A1],
        lora=True,
        eligible=PODS,
        addresses=ADDRESSES,
        previous=(),
        now=NOW,
        probes={P0: _serves(), P1: _serves()},
        results=(),
    )
    values.update(overrides)
    return AdapterInput(**values)


def _status(adapter: AdapterSpec, *entries: AdapterPodStatus) -> tuple[AdapterStatus, ...]:
    """`status.adapters` as last written, with one adapter."""
    return (AdapterStatus(name=adapter.name, source=adapter.source, pods=list(entries)),)


def _entry(pod: str, state: AdapterPodState, source: str = A1.source, **fields) -> AdapterPodStatus:
    return AdapterPodStatus(pod=pod, state=state, source=source, **fields)


def _entries(plan: AdapterPlan, adapter: str = "a1") -> dict[str, AdapterPodStatus]:
    (status,) = [s for s in plan.status if s.name == adapter]
    return {e.pod: e for e in status.pods}


def _ready(plan: AdapterPlan, adapter: str = "a1") -> int:
    (status,) = [s for s in plan.status if s.name == adapter]
    return status.ready_replicas


def _condition(plan: AdapterPlan) -> tuple[str, str]:
    assert plan.condition is not None
    return plan.condition.status.value, plan.condition.reason.value


# ---------------------------------------------------------------------------------------------------- nothing


@pytest.mark.parametrize(
    "probes",
    [{}, {P0: _serves(), P1: _serves()}, {P0: _serves("left-over"), P1: _serves("a1")}],
    ids=["no-probes", "answered", "serving-something"],
)
def test_no_lora_and_no_adapters_plans_nothing(probes):
    plan = plan_adapters(_given(adapters=[], lora=False, probes=probes))
    assert plan == AdapterPlan()
    assert plan.condition is None and plan.requeue_after is None  # the condition is dropped, no extra pass


# ------------------------------------------------------------------------------------------------------- loads


def test_first_pass_loads_every_adapter_into_every_answered_pod():
    plan = plan_adapters(_given(adapters=[A1, A2]))
    assert plan.loads == (
        LoadAdapter(P0, ADDRESSES[P0], "a1", A1.source),
        LoadAdapter(P1, ADDRESSES[P1], "a1", A1.source),
        LoadAdapter(P0, ADDRESSES[P0], "a2", A2.source),
        LoadAdapter(P1, ADDRESSES[P1], "a2", A2.source),
    )
    assert not any(load.replace for load in plan.loads) and plan.unloads == ()
    assert [(s.name, s.source, s.ready_replicas) for s in plan.status] == [("a1", A1.source, 0), ("a2", A2.source, 0)]
    for adapter in (A1, A2):
        assert _entries(plan, adapter.name) == {
            pod: _entry(pod, AdapterPodState.LOADING, adapter.source, attempts=1, last_attempt_time=NOW)
            for pod in (P0, P1)
        }
    assert _condition(plan) == ("False", "AdaptersLoading")
    assert plan.condition is not None and "a1 (0/2 pods)" in plan.condition.message
    assert plan.requeue_after == CONFIRM_AFTER_S
    assert plan.events == ()


def test_the_same_input_gives_the_same_plan():
    given = _given(adapters=[A1, A2], probes={P0: _serves("x"), P1: _serves("a1")})
    assert plan_adapters(given) == plan_adapters(given)


@pytest.mark.parametrize(
    ("before", "results"),
    [
        (None, ()),  # loaded by nobody we recorded (e.g. at the worker's start): taken as the spec's source
        (_entry(P0, AdapterPodState.LOADED), ()),
        (_entry(P0, AdapterPodState.LOADING, attempts=1, last_attempt_time=NOW), ()),
        (_entry(P0, AdapterPodState.LOADING, attempts=2, last_attempt_time=NOW), (AdapterResult(P0, "a1", A1.source),)),
    ],
    ids=["unrecorded", "loaded", "loading", "load-accepted"],
)
def test_a_pod_serving_the_adapter_from_the_spec_source_is_loaded(before, results):
    previous = _status(A1, before) if before is not None else ()
    plan = plan_adapters(_given(probes={P0: _serves("a1"), P1: _serves()}, previous=previous, results=results))
    assert _entries(plan)[P0] == _entry(P0, AdapterPodState.LOADED)
    assert [load.pod for load in plan.loads] == [P1]  # only the pod without it
    assert _ready(plan) == 1
    assert _condition(plan) == ("False", "AdaptersLoading")
    assert plan.condition is not None and "a1 (1/2 pods)" in plan.condition.message


def test_every_adapter_loaded_everywhere_is_ready():
    previous = (
        AdapterStatus(name="a1", source=A1.source, ready_replicas=2, pods=[_entry(P0, "Loaded"), _entry(P1, "Loaded")]),
    )
    given = _given(adapters=[A1, A2], probes={P0: _serves("a1", "a2"), P1: _serves("a1", "a2")}, previous=previous)
    plan = plan_adapters(given)
    assert plan.loads == () and plan.unloads == () and plan.events == ()
    assert [(s.name, s.ready_replicas) for s in plan.status] == [("a1", 2), ("a2", 2)]
    assert {e.state for s in plan.status for e in s.pods} == {AdapterPodState.LOADED}
    assert _condition(plan) == ("True", "AdaptersLoaded")
    assert plan.condition is not None and plan.condition.message == "2 adapter(s) loaded in 2 pod(s)"
    assert plan.requeue_after is None


def test_a_restarted_worker_that_lost_its_adapter_gets_it_again():
    previous = _status(A1, _entry(P0, AdapterPodState.LOADED), _entry(P1, AdapterPodState.LOADED))
    plan = plan_adapters(_given(probes={P0: _serves(), P1: _serves("a1")}, previous=previous))
    assert plan.loads == (LoadAdapter(P0, ADDRESSES[P0], "a1", A1.source),)
    assert _entries(plan)[P0] == _entry(P0, AdapterPodState.LOADING, attempts=1, last_attempt_time=NOW)
    assert _ready(plan) == 1


# ------------------------------------------------------------------------------------------- reload in place


@pytest.mark.parametrize(
    ("before", "results"),
    [
        (_entry(P0, AdapterPodState.LOADED, source="/adapters/old"), ()),
        (_entry(P0, AdapterPodState.LOADING, source="/adapters/old", attempts=1, last_attempt_time=NOW), ()),
        (  # last pass's load of the old source was accepted, then the spec changed the source
            _entry(P0, AdapterPodState.LOADING, source="/adapters/old", attempts=1, last_attempt_time=NOW),
            (AdapterResult(P0, "a1", "/adapters/old"),),
        ),
    ],
    ids=["loaded-old", "loading-old", "accepted-old"],
)
def test_a_changed_source_reloads_in_place(before, results):
    previous = _status(AdapterSpec(name="a1", source="/adapters/old"), before)
    plan = plan_adapters(_given(eligible=PODS[:1], probes={P0: _serves("a1")}, previous=previous, results=results))
    assert plan.loads == (LoadAdapter(P0, ADDRESSES[P0], "a1", A1.source, replace=True),)
    assert plan.unloads == ()  # the reload replaces it: no separate unload
    assert _entries(plan)[P0] == _entry(P0, AdapterPodState.LOADING, attempts=1, last_attempt_time=NOW)
    assert _ready(plan) == 0
    assert plan.requeue_after == CONFIRM_AFTER_S


def test_a_failed_reload_in_place_is_not_loaded_from_the_new_source():
    # Pass N sent LoadAdapter(replace=True) for the new source; the executor's unload of the old copy (or the load)
    # failed, so the worker still serves the OLD copy of a1 and the result for the new source is an error.
    error = "unloading the old copy: 500 busy"
    previous = _status(A1, _entry(P0, AdapterPodState.LOADING, attempts=1, last_attempt_time=NOW))
    plan = plan_adapters(
        _given(
            eligible=PODS[:1],
            probes={P0: _serves("a1")},
            previous=previous,
            results=(AdapterResult(P0, "a1", A1.source, error=error),),
            now=NOW + timedelta(seconds=1),
        )
    )
    entry = _entries(plan)[P0]
    assert _ready(plan) == 0  # the gateway must not route a1 to a pod that serves the old adapter
    assert (entry.state, entry.message) == (AdapterPodState.FAILED, error)
    # Nor on the pass after, when the failure is only in status.adapters and the old copy is still served.
    later = plan_adapters(
        _given(eligible=PODS[:1], probes={P0: _serves("a1")}, previous=plan.status, now=NOW + timedelta(seconds=2))
    )
    assert _ready(later) == 0


# ---------------------------------------------------------------------------------------------------- failures


def test_a_refused_load_fails_with_one_warning_event_and_the_base_keeps_serving():
    error = "adapter rank 64 exceeds --max-lora-rank 16"
    sent = NOW - timedelta(seconds=1)
    previous = _status(A1, _entry(P0, AdapterPodState.LOADING, attempts=3, last_attempt_time=sent))
    given = _given(
        eligible=PODS[:1],
        probes={P0: _serves()},
        previous=previous,
        results=(AdapterResult(P0, "a1", A1.source, error=error),),
    )
    plan = plan_adapters(given)
    failed = _entry(P0, AdapterPodState.FAILED, message=error, attempts=3, last_attempt_time=sent)
    assert _entries(plan) == {P0: failed}
    assert plan.loads == () and _ready(plan) == 0
    (event,) = plan.events
    assert (event.type, event.reason) == (EventType.WARNING, "AdapterLoadFailed")
    assert all(word in event.message for word in (P0, "a1", A1.source, error))
    assert _condition(plan) == ("False", "AdapterLoadFailed")
    assert plan.condition is not None and error in plan.condition.message
    assert "base model" in plan.condition.message and "keep serving" in plan.condition.message
    assert plan.requeue_after == pytest.approx(retry_delay(3) - 1)  # look again when the back-off runs out

    # The same failure seen again (the entry is already Failed with this message): no second event.
    again = plan_adapters(
        _given(eligible=PODS[:1], probes={P0: _serves()}, previous=plan.status, results=given.results)
    )
    assert again.events == ()
    assert _entries(again) == {P0: failed}
    assert again.condition == plan.condition


@pytest.mark.parametrize(
    ("before", "event"),
    [
        (None, True),
        (_entry(P0, AdapterPodState.LOADING, attempts=1, last_attempt_time=NOW), True),
        (_entry(P0, AdapterPodState.FAILED, message="bad rank", attempts=1, last_attempt_time=NOW), False),
        (_entry(P0, AdapterPodState.FAILED, message="not found", attempts=1, last_attempt_time=NOW), True),
    ],
    ids=["no-record", "was-loading", "same-failure", "other-failure"],
)
def test_a_warning_event_only_for_a_new_failure(before, event):
    previous = _status(A1, before) if before is not None else ()
    results = (AdapterResult(P0, "a1", A1.source, error="bad rank"),)
    plan = plan_adapters(_given(eligible=PODS[:1], probes={P0: _serves()}, previous=previous, results=results))
    assert _entries(plan)[P0].state == AdapterPodState.FAILED
    assert len(plan.events) == int(event)


def test_failures_of_one_adapter_in_several_pods_make_one_event_and_spare_the_others():
    results = (
        AdapterResult(P0, "a1", A1.source, error="not found"),
        AdapterResult(P1, "a1", A1.source, error="not found"),
        AdapterResult(P0, "a2", A2.source),
    )
    plan = plan_adapters(_given(adapters=[A1, A2], probes={P0: _serves("a2"), P1: _serves()}, results=results))
    (event,) = plan.events
    assert "a1" in event.message and P0 in event.message and P1 in event.message
    assert {e.state for e in _entries(plan, "a1").values()} == {AdapterPodState.FAILED}
    assert _entries(plan, "a2")[P0].state == AdapterPodState.LOADED  # the other adapter is unaffected
    assert [(load.pod, load.adapter) for load in plan.loads] == [(P1, "a2")]  # and still loads where it is missing
    assert _condition(plan) == ("False", "AdapterLoadFailed")


def test_an_overlong_worker_message_is_cut_to_the_status_limit():
    results = (AdapterResult(P0, "a1", A1.source, error="x" * 10_000),)
    plan = plan_adapters(_given(eligible=PODS[:1], probes={P0: _serves()}, results=results))
    assert len(_entries(plan)[P0].message) == 4096


# ---------------------------------------------------------------------------------------------------- back-off


@pytest.mark.parametrize(
    ("attempts", "seconds"),
    [(0, 10), (1, 10), (2, 20), (3, 40), (4, 80), (5, 160), (6, 300), (7, 300), (1000, 300)],
)
def test_retry_delay_doubles_from_10_s_up_to_5_min(attempts, seconds):
    assert (RETRY_FIRST_S, RETRY_MAX_S) == (10.0, 300.0)
    assert retry_delay(attempts) == seconds


def _failed_before(attempts: int, at: datetime, source: str = A1.source) -> tuple[AdapterStatus, ...]:
    entry = _entry(P0, AdapterPodState.FAILED, source, message="not found", attempts=attempts, last_attempt_time=at)
    return _status(AdapterSpec(name="a1", source=source), entry)


@pytest.mark.parametrize("attempts", [1, 2, 3, 8])
@pytest.mark.parametrize(("early_s", "requeue"), [(5.0, 5.0), (0.25, 1.0)], ids=["early", "almost-due"])
def test_a_failed_load_waits_out_its_back_off(attempts, early_s, requeue):
    tried = NOW - timedelta(seconds=1000)
    now = tried + timedelta(seconds=retry_delay(attempts) - early_s)
    previous = _failed_before(attempts, tried)
    plan = plan_adapters(_given(eligible=PODS[:1], probes={P0: _serves()}, previous=previous, now=now))
    assert plan.loads == () and plan.events == ()
    assert _entries(plan) == {P0: previous[0].pods[0]}  # unchanged while waiting
    assert plan.requeue_after == pytest.approx(requeue)  # at the due time, at least 1 s away
    assert _condition(plan) == ("False", "AdapterLoadFailed")


@pytest.mark.parametrize("attempts", [1, 2, 3, 8])
@pytest.mark.parametrize("late_s", [0.0, 30.0], ids=["due", "overdue"])
def test_a_failed_load_is_tried_again_once_due(attempts, late_s):
    tried = NOW - timedelta(seconds=1000)
    now = tried + timedelta(seconds=retry_delay(attempts) + late_s)
    plan = plan_adapters(
        _given(eligible=PODS[:1], probes={P0: _serves()}, previous=_failed_before(attempts, tried), now=now)
    )
    assert plan.loads == (LoadAdapter(P0, ADDRESSES[P0], "a1", A1.source),)
    assert _entries(plan)[P0] == _entry(P0, AdapterPodState.LOADING, attempts=attempts + 1, last_attempt_time=now)
    assert plan.requeue_after == CONFIRM_AFTER_S
    assert plan.events == ()


def test_a_changed_source_is_tried_at_once_despite_the_back_off():
    previous = _failed_before(5, NOW, source="/adapters/broken")  # 160 s to wait for the old source
    plan = plan_adapters(_given(eligible=PODS[:1], probes={P0: _serves()}, previous=previous))
    assert plan.loads == (LoadAdapter(P0, ADDRESSES[P0], "a1", A1.source),)
    assert _entries(plan)[P0] == _entry(P0, AdapterPodState.LOADING, attempts=1, last_attempt_time=NOW)


# -------------------------------------------------------------------------------------------- unanswered probes


@pytest.mark.parametrize(
    "probe",
    [
        None,
        AdapterProbe(ProbeState.FAILED, detail="timeout"),
        AdapterProbe(ProbeState.UNREACHABLE),
        AdapterProbe(ProbeState.FAILED, adapters=frozenset({"a1", "stray"})),  # only an answer counts
    ],
    ids=["missing", "failed", "unreachable", "failed-with-names"],
)
@pytest.mark.parametrize(
    "before",
    [
        None,
        _entry(P0, AdapterPodState.LOADED),
        _entry(P0, AdapterPodState.LOADING, attempts=2, last_attempt_time=NOW - timedelta(seconds=1)),
        _entry(P0, AdapterPodState.FAILED, message="x", attempts=1, last_attempt_time=NOW - timedelta(hours=1)),
        _entry(P0, AdapterPodState.LOADED, source="/adapters/old"),
    ],
    ids=["no-entry", "loaded", "loading", "failed-and-due", "old-source"],
)
def test_a_pod_that_did_not_answer_keeps_its_entry_and_is_sent_nothing(probe, before):
    probes = {P1: _serves("stray")} | ({P0: probe} if probe is not None else {})
    previous = _status(A1, before) if before is not None else ()
    plan = plan_adapters(_given(probes=probes, previous=previous))
    assert _entries(plan).get(P0) == before
    assert [(a.pod, a.adapter) for a in plan.loads] == [(P1, "a1")]  # the pod that answered is served as usual
    assert [(a.pod, a.adapter) for a in plan.unloads] == [(P1, "stray")]
    assert _ready(plan) == int(
        before is not None and before.state == AdapterPodState.LOADED and before.source == A1.source
    )


# -------------------------------------------------------------------------------------------------------- unloads


@pytest.mark.parametrize(
    ("adapters", "served", "unloaded"),
    [
        ([A1], {"a1", "old"}, ["old"]),
        ([A1], {"zeta", "a1", "beta"}, ["beta", "zeta"]),
        ([], {"a1", "a2"}, ["a1", "a2"]),  # every adapter removed from the spec; LoRA stays on
        ([A1, A2], {"a1", "a2"}, []),
    ],
    ids=["one-removed", "two-removed", "all-removed", "none-removed"],
)
def test_an_adapter_no_longer_in_the_spec_is_unloaded(adapters, served, unloaded):
    plan = plan_adapters(_given(adapters=adapters, eligible=PODS[:1], probes={P0: _serves(*served)}))
    assert plan.unloads == tuple(UnloadAdapter(P0, ADDRESSES[P0], name) for name in unloaded)
    assert plan.loads == ()
    assert plan.requeue_after == (CONFIRM_AFTER_S if unloaded else None)
    assert {s.name for s in plan.status} == {a.name for a in adapters}  # removed adapters leave status.adapters


@pytest.mark.parametrize("state", [ProbeState.FAILED, ProbeState.UNREACHABLE])
def test_no_unload_is_sent_to_a_pod_that_did_not_answer(state):
    probe = AdapterProbe(state, adapters=frozenset({"old"}))
    plan = plan_adapters(_given(eligible=PODS[:1], probes={P0: probe}))
    assert plan.unloads == () and plan.loads == ()


# ---------------------------------------------------------------------------------------------- eligible pods


def test_pods_that_are_not_eligible_get_no_entries_and_no_calls():
    previous = _status(A1, _entry(P0, AdapterPodState.LOADED), _entry(P1, AdapterPodState.LOADED))
    probes = {P0: _serves("a1"), P1: _serves("old"), "stranger": _serves("old")}  # P1 is draining, say
    plan = plan_adapters(_given(eligible=PODS[:1], probes=probes, previous=previous))
    assert set(_entries(plan)) == {P0}  # P1's old entry goes with its eligibility
    assert plan.loads == () and plan.unloads == ()
    assert _ready(plan) == 1
    assert _condition(plan) == ("True", "AdaptersLoaded")


# ------------------------------------------------------------------------------------------------- condition


@pytest.mark.parametrize(
    ("adapters", "eligible", "expected", "message"),
    [
        ([], PODS, ("True", "AdaptersLoaded"), "no adapters in the spec"),
        ([], (), ("True", "AdaptersLoaded"), "no adapters in the spec"),
        ([A1], (), ("False", "AdaptersLoading"), "no ready pod"),
        ([A1, A2], (), ("False", "AdaptersLoading"), "no ready pod"),
    ],
    ids=["no-adapters", "no-adapters-no-pods", "no-pods", "no-pods-two-adapters"],
)
def test_condition_with_lora_on(adapters, eligible, expected, message):
    plan = plan_adapters(_given(adapters=adapters, eligible=eligible))
    assert _condition(plan) == expected
    assert plan.condition is not None and message in plan.condition.message
    assert plan.loads == () and plan.unloads == () and plan.events == ()
    assert [(s.name, s.pods) for s in plan.status] == [(a.name, []) for a in adapters]
    assert plan.requeue_after is None


@pytest.mark.parametrize(
    ("state", "requeue"),
    [(ProbeState.FAILED, UNANSWERED_RETRY_S), (ProbeState.UNREACHABLE, UNANSWERED_RETRY_S), (None, None)],
)
def test_a_pod_that_did_not_answer_is_asked_again_soon(state, requeue):
    previous = _status(A1, _entry(P0, AdapterPodState.LOADED))
    probes = {P0: AdapterProbe(state)} if state is not None else {}
    plan = plan_adapters(_given(eligible=PODS[:1], probes=probes, previous=previous))
    assert plan.requeue_after == requeue and not plan.loads


def test_a_changed_source_reloads_one_pod_at_a_time_while_the_others_serve_the_old_copy():
    old = "/adapters/old"
    previous = _status(
        A1, _entry(P0, AdapterPodState.LOADED, source=old), _entry(P1, AdapterPodState.LOADED, source=old)
    )
    served = {P0: _serves("a1"), P1: _serves("a1")}
    first = plan_adapters(_given(probes=served, previous=previous))
    assert [(a.pod, a.replace) for a in first.loads] == [(P0, True)]
    assert {p: (e.state, e.source) for p, e in _entries(first).items()} == {
        P0: (AdapterPodState.LOADING, A1.source),
        P1: (AdapterPodState.LOADED, old),  # still routed: it serves the old copy until its turn
    }
    assert _ready(first) == 0 and first.requeue_after == CONFIRM_AFTER_S
    done = (AdapterResult(P0, "a1", A1.source),)
    second = plan_adapters(_given(probes=served, previous=first.status, results=done, now=NOW + timedelta(seconds=1)))
    assert [(a.pod, a.replace) for a in second.loads] == [(P1, True)] and _ready(second) == 1
