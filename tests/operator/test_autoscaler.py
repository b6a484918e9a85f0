"""The autoscaler's glue (pods -> PodCounts, gateway answers, alert intents, status entries and patches) as
tables, and its shell (`Autoscaler.evaluate`, `on_alerts`, the gateway source) against a scripted API and
scripted metrics."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controllers.autoscaling import GatewaySample, MetricsSample, PodCounts
from crds.helpers import parse_spec
from crds.models import AutoscalingStatus, DecisionTrigger, Recommendation
from fleet_operator.alerts import ParsedAlerts, ScaleIntent
from fleet_operator.autoscaler import (
    Autoscaler,
    VariantInputs,
    autoscaling_patch,
    collapse_runs,
    compact_window,
    evaluate_variants,
    intents_for,
    owned,
    pod_counts,
    queued_by_variant,
    scale_event,
    variants_at_zero,
    wants_autoscaling,
)
from fleet_operator.kube import ApiError
from fleet_operator.metrics_source import LoadSample
from fleet_operator.operator_metrics import OperatorMetrics
from fleet_operator.settings import OperatorSettings

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC).timestamp()
NS, NAME, UID = "ns", "demo", "uid-demo"
CR_PATH = f"/apis/llmfleet.io/v1alpha1/namespaces/{NS}/inferencedeployments/{NAME}"


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(
    name: str,
    *,
    variant: str = "default",
    ready_at: float | None = None,
    created: float = T0 - 100,
    phase: str = "Running",
    draining: bool = False,
    deleting: bool = False,
    owner: str = UID,
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True", "lastTransitionTime": _iso(ready_at)}] if ready_at else [
        {"type": "Ready", "status": "False"}
    ]
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "creationTimestamp": _iso(created),
        "labels": {"llmfleet.io/deployment": NAME, "llmfleet.io/variant": variant, "llmfleet.io/revision": "r1"},
        "ownerReferences": [{"uid": owner, "controller": True}],
    }
    if draining:
        meta["labels"]["llmfleet.io/draining"] = "true"
    if deleting:
        meta["deletionTimestamp"] = _iso(T0)
    return {"metadata": meta, "status": {"phase": phase, "conditions": conditions, "podIP": f"127.0.9.{len(name)}"}}


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


# ------------------------------------------------------------------------------------------------- gateway


def test_queued_by_variant_sums_this_deployments_rows():
    answer = {"queued": [
        {"namespace": NS, "deployment": NAME, "variant": "a", "queued": 3},
        {"namespace": NS, "deployment": NAME, "variant": "b", "queued": 0},
        {"namespace": NS, "deployment": "other", "variant": "a", "queued": 9},
        {"namespace": "elsewhere", "deployment": NAME, "variant": "a", "queued": 9},
    ]}
    assert queued_by_variant(answer, NS, NAME) == {"a": 3.0, "b": 0.0}
    assert queued_by_variant({"queued": []}, NS, NAME) == {}


@pytest.mark.parametrize(
    "answer",
    [[], {"rows": []}, {"queued": ["x"]}, {"queued": [{"namespace": NS, "deployment": NAME, "queued": -1}]},
     {"queued": [{"namespace": NS, "deployment": NAME, "queued": "lots"}]}],
)
def test_queued_by_variant_refuses_other_shapes(answer):
    with pytest.raises(ValueError):
        queued_by_variant(answer, NS, NAME)


# -------------------------------------------------------------------------------------------------- alerts


def intent(alert: str = "QueueHigh", *, deployment: str = NAME, namespace: str | None = NS,
           variant: str | None = None, firing: bool = True, step: int = 2, at: float = T0) -> ScaleIntent:
    return ScaleIntent(deployment=deployment, namespace=namespace, variant=variant, alert=alert,
                       fingerprint="fp-" + alert, firing=firing, step=step, received_at=at, expires_at=at + 300,
                       reason="summary of " + alert)


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
        {"name": "default", "autoscaling": {"minReplicas": 1, "maxReplicas": 6,
                                            "targets": {"queueDepthPerReplica": 2},
                                            "scaleDownStabilizationSeconds": 30}},
        {"name": "fixed", "replicas": 2},
    ],
}


def _metrics(queue: float, ready: int = 1, at: float = T0) -> MetricsSample:
    return MetricsSample(observed_at=at, ready_pods=ready, queue_depth_per_replica=queue,
                         running_requests=float(ready), waiting_requests=queue * ready)


def _ready(n: int) -> PodCounts:
    return PodCounts(ready=n, ready_since=tuple(T0 - 600 for _ in range(n)))


def _evaluate(status: AutoscalingStatus, inputs: dict[str, VariantInputs], *, now: float = T0, spec=SPEC,
              intents=()) -> list:
    return evaluate_variants(parse_spec(spec), status, inputs, namespace=NS, deployment=NAME, now=now,
                             intents=intents)


def test_only_autoscaled_variants_with_inputs_are_decided_from_the_initial_size():
    (outcome,) = _evaluate(AutoscalingStatus(), {"default": VariantInputs(_ready(1), _metrics(8)),
                                                 "fixed": VariantInputs(_ready(2), _metrics(8))})
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
    (outcome,) = _evaluate(AutoscalingStatus(), {"default": VariantInputs(_ready(1), _metrics(0))},
                           intents=[intent(step=2), intent("Other", deployment="x")])
    assert outcome.trigger == DecisionTrigger.ALERT and outcome.decision.desired_replicas == 3
    (stored,) = outcome.entry.alert_intents
    assert (stored.alert, stored.replicas, stored.fingerprint, stored.reason) == (
        "QueueHigh", 3, "fp-QueueHigh", "summary of QueueHigh")
    assert stored.expires_at.timestamp() == T0 + 300
    status = AutoscalingStatus(variants=[outcome.entry])
    (later,) = _evaluate(status, {"default": VariantInputs(_ready(3), _metrics(0, 3))}, now=T0 + 10,
                         intents=[intent(firing=False, at=T0 + 10)])
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
    window = [{"time": _iso(T0 - 1000 + i), "replicas": 1 + i % 3} for i in range(1000)]
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
    assert patch == {"autoscaling": {"variants": [{"name": "default", "desiredReplicas": 2, "lastDecisions": [],
                                                   "recommendations": [], "alertIntents": []}]}}
    kept = AutoscalingStatus.model_validate(patch["autoscaling"])
    assert autoscaling_patch(spec, kept, []) is None
    (outcome,) = _evaluate(kept, {"default": VariantInputs(_ready(2), _metrics(8, 2))})
    decided = autoscaling_patch(spec, kept, [outcome])
    assert decided["autoscaling"]["variants"][0]["desiredReplicas"] == 6
    assert "Autoscaled" == scale_event(outcome).reason
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


# --------------------------------------------------------------------------------------------------- shell


class ScriptedApi:
    """An in-memory CR plus pods; records calls; `conflicts` status patches answer 409 first."""

    def __init__(self, resource: dict[str, Any] | None, pods: list[dict[str, Any]], conflicts: int = 0) -> None:
        self.resource, self.pods, self.conflicts = resource, pods, conflicts
        self.calls: list[tuple[str, str, Any]] = []
        self.fail_reads = False

    async def get(self, path: str) -> dict[str, Any] | None:
        self.calls.append(("get", path, None))
        if self.fail_reads:
            raise ApiError(503, "ServiceUnavailable", "down", f"GET {path}")
        return copy.deepcopy(self.resource) if path == CR_PATH else None

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        self.calls.append(("list", path, label_selector))
        if path.endswith("/pods"):
            return copy.deepcopy(self.pods)
        return [{"metadata": {"namespace": NS, "name": NAME}}, {"metadata": {"namespace": "other", "name": "x"}}]

    async def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        self.calls.append(("patch", path, body))
        assert self.resource is not None
        if self.conflicts:
            self.conflicts -= 1
            self.resource["metadata"]["resourceVersion"] = str(int(self.resource["metadata"]["resourceVersion"]) + 1)
            raise ApiError(409, "Conflict", "the object has been modified", f"PATCH {path}")
        assert body["metadata"]["resourceVersion"] == self.resource["metadata"]["resourceVersion"]
        self.resource.setdefault("status", {}).update(body["status"])
        return self.resource

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        self.calls.append(("create", path, body))
        return body

    def patches(self) -> list[Any]:
        return [body for verb, path, body in self.calls if verb == "patch"]

    def events(self) -> list[Any]:
        return [body for verb, path, body in self.calls if verb == "create" and path.endswith("/events")]


class ScriptedSource:
    """Answers `load` with the next scripted LoadSample (the last one repeats) and records the selectors."""

    def __init__(self, *samples: LoadSample) -> None:
        self.samples = list(samples)
        self.selectors: list[Any] = []
        self.targets: list[Any] = []

    async def load(self, selector, targets):
        self.selectors.append(selector)
        self.targets.append(targets)
        return self.samples.pop(0) if len(self.samples) > 1 else self.samples[0]

    async def revision(self, selector, targets, window_s):  # pragma: no cover - not used by the autoscaler
        raise AssertionError("the autoscaler never asks for revision samples")

    async def aclose(self) -> None:
        pass


def _resource(spec: dict[str, Any] = SPEC, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "llmfleet.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": NAME, "namespace": NS, "uid": UID, "resourceVersion": "7"},
            "spec": copy.deepcopy(spec), "status": copy.deepcopy(status or {})}


def _load(queue: float, ready: int = 1, at: float = T0, stale: bool = False, error: str | None = None) -> LoadSample:
    return LoadSample(observed_at=at, stale=stale, ready_pods=ready, queue_depth_per_replica=queue,
                      running_requests=float(ready), waiting_requests=queue * ready, error=error)


def _autoscaler(api, source, *, transport=None, **settings: Any) -> tuple[Autoscaler, list, OperatorMetrics]:
    woken: list[tuple[str, str]] = []
    metrics = OperatorMetrics()
    http = httpx.AsyncClient(transport=transport) if transport is not None else None
    scaler = Autoscaler(api, source, OperatorSettings(**settings), metrics, wake=lambda *key: woken.append(key),
                        http=http, clock=lambda: T0)
    return scaler, woken, metrics


def test_a_scale_up_is_patched_guarded_announced_counted_and_wakes_the_loop():
    api = ScriptedApi(_resource(), [pod("a", ready_at=T0 - 300), pod("x", ready_at=T0, owner="other")])
    source = ScriptedSource(_load(8))
    scaler, woken, metrics = _autoscaler(api, source)
    (outcome,) = asyncio.run(scaler.evaluate(NS, NAME))
    assert outcome.decision.desired_replicas == 4
    assert [t.pod for t in source.targets[0]] == ["a"] and source.selectors[0].variant == "default"
    (patch,) = api.patches()
    assert patch["metadata"] == {"resourceVersion": "7"} and list(patch["status"]) == ["autoscaling"]
    assert api.resource["status"]["autoscaling"]["variants"][0]["desiredReplicas"] == 4
    (event,) = api.events()
    assert event["reason"] == "Autoscaled" and "1 -> 4 replicas (timer)" in event["message"]
    assert woken == [(NS, NAME)]
    assert metrics.scale_decisions.labels(NS, NAME, "default", "up", "timer")._value.get() == 1


def test_a_conflict_decides_again_on_the_new_status():
    api = ScriptedApi(_resource(), [pod("a", ready_at=T0 - 300)], conflicts=2)
    scaler, woken, _ = _autoscaler(api, ScriptedSource(_load(8)))
    (outcome,) = asyncio.run(scaler.evaluate(NS, NAME))
    assert outcome.decision.desired_replicas == 4 and len(api.patches()) == 3
    assert [v for v, p, _ in api.calls].count("get") == 3  # the first read, then one per conflict


def test_a_steady_variant_is_not_rewritten_at_every_tick():
    api = ScriptedApi(_resource(), [pod("a", ready_at=T0 - 300)])
    scaler, _, _ = _autoscaler(api, ScriptedSource(_load(2)))
    ticks = iter(range(100))
    scaler.clock = lambda: T0 + next(ticks)  # metrics stay fresh (observed at T0)
    for _ in range(5):
        asyncio.run(scaler.evaluate(NS, NAME))
    (patch,) = api.patches()  # the first decision only: the same one since
    assert patch["status"]["autoscaling"]["variants"][0]["desiredReplicas"] == 1


def test_no_change_means_no_event_and_no_wake_and_unavailable_metrics_hold():
    status = {"autoscaling": {"variants": [{"name": "default", "desiredReplicas": 3}]}}
    api = ScriptedApi(_resource(status=status), [pod("a", ready_at=T0 - 300)])
    scaler, woken, _ = _autoscaler(api, ScriptedSource(_load(0, stale=True, error="pods did not answer")))
    (outcome,) = asyncio.run(scaler.evaluate(NS, NAME))
    assert outcome.decision.desired_replicas == 3 and outcome.decision.metrics is None
    assert api.events() == [] and woken == []


@pytest.mark.parametrize(
    "resource",
    [None, {**_resource(), "metadata": {**_resource()["metadata"], "deletionTimestamp": _iso(T0)}},
     _resource(spec={**SPEC, "variants": [{"name": "a", "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}]}),
     _resource(spec={**SPEC, "variants": [{"name": "a", "replicas": 1}]})],
    ids=["gone", "deleting", "invalid", "not-autoscaled"],
)
def test_nothing_is_written_for_deployments_the_autoscaler_leaves_alone(resource):
    api = ScriptedApi(resource, [])
    scaler, _, _ = _autoscaler(api, ScriptedSource(_load(8)))
    assert asyncio.run(scaler.evaluate(NS, NAME)) == []
    assert api.patches() == []


def test_the_timer_survives_api_errors():
    api = ScriptedApi(_resource(), [])
    api.fail_reads = True
    scaler, _, _ = _autoscaler(api, ScriptedSource(_load(8)))
    assert asyncio.run(scaler.tick(NS, NAME)) == []


def test_alerts_without_namespace_find_the_deployment_and_record_the_intent():
    api = ScriptedApi(_resource(), [pod("a", ready_at=T0 - 300)])
    scaler, woken, metrics = _autoscaler(api, ScriptedSource(_load(0)))
    asyncio.run(scaler.on_alerts(ParsedAlerts(intents=(intent(namespace=None, step=3),), ignored=())))
    entry = api.resource["status"]["autoscaling"]["variants"][0]
    assert entry["desiredReplicas"] == 4 and entry["alertIntents"][0]["alert"] == "QueueHigh"
    assert entry["lastDecisions"][-1]["trigger"] == "Alert"
    assert metrics.scale_decisions.labels(NS, NAME, "default", "up", "alert")._value.get() == 1
    api.fail_reads = True  # an API failure reaches the webhook (503: Alertmanager delivers again)
    with pytest.raises(ApiError):
        asyncio.run(scaler.on_alerts(ParsedAlerts(intents=(intent(),), ignored=())))


def test_watched_namespaces_are_searched_for_alerts_that_name_none():
    api = ScriptedApi(_resource(), [])
    scaler, _, _ = _autoscaler(api, ScriptedSource(_load(0)), namespaces=["a", NS])
    assert asyncio.run(scaler._namespaces_of(NAME)) == [NS]
    scaler, _, _ = _autoscaler(api, ScriptedSource(_load(0)))
    assert asyncio.run(scaler._namespaces_of(NAME)) == [NS]


def test_gateway_queue_from_the_gateway_or_prometheus_and_unknown_on_failure():
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "gw":
            return httpx.Response(200, json={"queued": [{"namespace": NS, "deployment": NAME, "variant": "default",
                                                         "queued": 4}]})
        if request.url.host == "prom":
            return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": {"variant": "default"}, "value": [T0, "2"]}]}})
        return httpx.Response(500)

    transport = httpx.MockTransport(answer)
    api = ScriptedApi(_resource(), [])
    via_gateway, _, _ = _autoscaler(api, ScriptedSource(_load(0)), transport=transport, gateway_url="http://gw:80/",
                                    gateway_api_key="sk-op")
    assert asyncio.run(via_gateway._gateway_queued(NS, NAME)) == {"default": 4.0}
    assert seen[-1].url.path == "/internal/queued" and seen[-1].headers["authorization"] == "Bearer sk-op"
    via_prom, _, _ = _autoscaler(api, ScriptedSource(_load(0)), transport=transport, prometheus_url="http://prom:9090")
    assert asyncio.run(via_prom._gateway_queued(NS, NAME)) == {"default": 2.0}
    assert 'llmfleet_gateway_queued_at_zero{namespace="ns",deployment="demo"}' in seen[-1].url.params["query"]
    broken, _, _ = _autoscaler(api, ScriptedSource(_load(0)), transport=transport, gateway_url="http://down")
    assert asyncio.run(broken._gateway_queued(NS, NAME)) is None
    neither, _, _ = _autoscaler(api, ScriptedSource(_load(0)), transport=transport)
    assert asyncio.run(neither._gateway_queued(NS, NAME)) is None


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ({"autoscaling": {"variants": [{"name": "a", "desiredReplicas": 0}, {"name": "b", "desiredReplicas": 2}]}},
         ["a"]),
        ({"autoscaling": {"variants": [{"name": "a", "desiredReplicas": 1}]}}, []),
        ({"autoscaling": {"variants": [{"name": "a"}]}}, []),  # not decided yet: not at zero
        ({}, []),
    ],
)
def test_variants_at_zero(status, expected):
    assert variants_at_zero({"status": status}) == expected


ZERO_SPEC = {
    "model": {"name": "m", "source": "bundled://smollm2-135m-instruct"},
    "variants": [{"name": "default", "autoscaling": {"minReplicas": 0, "maxReplicas": 3,
                                                     "targets": {"queueDepthPerReplica": 2},
                                                     "scaleToZeroAfterSeconds": 60}}],
}


@pytest.mark.parametrize(("queued", "woken"), [(3, True), (0, False), (None, False)],
                         ids=["held requests wake", "nothing held", "gateway unknown"])
def test_the_wake_check_evaluates_at_once_only_when_the_gateway_holds_requests(queued, woken):
    def answer(request: httpx.Request) -> httpx.Response:
        if queued is None:
            return httpx.Response(503)
        return httpx.Response(200, json={"queued": [{"namespace": NS, "deployment": NAME, "variant": "default",
                                                     "queued": queued}]})

    status = {"autoscaling": {"variants": [{"name": "default", "desiredReplicas": 0}]}}
    api = ScriptedApi(_resource(ZERO_SPEC, status), [])
    scaler, wakes, _ = _autoscaler(api, ScriptedSource(_load(0, ready=0)), transport=httpx.MockTransport(answer),
                                   gateway_url="http://gw")
    outcomes = asyncio.run(scaler.wake_check(NS, NAME, ["default"]))
    if woken:
        (outcome,) = outcomes
        assert outcome.decision.desired_replicas >= 1 and api.patches() and wakes == [(NS, NAME)]
    else:
        assert outcomes == [] and api.patches() == [] and not any(verb == "get" for verb, *_ in api.calls)
