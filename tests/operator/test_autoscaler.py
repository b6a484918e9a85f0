"""The autoscaler's shell (`Autoscaler.evaluate`, `on_alerts`, the wake check, the gateway source) against a
scripted API and scripted metrics, and its reading of the gateway's answer. The decisions it calls are tested
as tables in tests/controllers/test_autoscaling_plan.py."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from fleet_operator.alerts import ParsedAlerts
from fleet_operator.autoscaler import Autoscaler, queued_by_variant
from fleet_operator.kube import ApiError
from fleet_operator.metrics_source import LoadSample
from fleet_operator.operator_metrics import OperatorMetrics
from fleet_operator.settings import OperatorSettings

from controllers.autoscaling_plan import ScaleIntent
from controllers.testing import iso, scale_intent, worker_pod

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC).timestamp()
NS, NAME, UID = "ns", "demo", "uid-demo"
CR_PATH = f"/apis/llmfleet.io/v1alpha1/namespaces/{NS}/inferencedeployments/{NAME}"


def pod(name: str, **kwargs: Any) -> dict[str, Any]:
    """A worker pod of NAME in NS owned by UID, 100 s old at T0 (see controllers.testing.worker_pod)."""
    return worker_pod(name, **{"namespace": NS, "deployment": NAME, "now": T0, "owner": UID, **kwargs})


# ------------------------------------------------------------------------------------------------- gateway


def test_queued_by_variant_sums_this_deployments_rows():
    answer = {
        "queued": [
            {"namespace": NS, "deployment": NAME, "variant": "a", "queued": 3},
            {"namespace": NS, "deployment": NAME, "variant": "b", "queued": 0},
            {"namespace": NS, "deployment": "other", "variant": "a", "queued": 9},
            {"namespace": "elsewhere", "deployment": NAME, "variant": "a", "queued": 9},
        ]
    }
    assert queued_by_variant(answer, NS, NAME) == {"a": 3.0, "b": 0.0}
    assert queued_by_variant({"queued": []}, NS, NAME) == {}


@pytest.mark.parametrize(
    "answer",
    [
        [],
        {"rows": []},
        {"queued": ["x"]},
        {"queued": [{"namespace": NS, "deployment": NAME, "queued": -1}]},
        {"queued": [{"namespace": NS, "deployment": NAME, "queued": "lots"}]},
    ],
)
def test_queued_by_variant_refuses_other_shapes(answer):
    with pytest.raises(ValueError):
        queued_by_variant(answer, NS, NAME)


# -------------------------------------------------------------------------------------------------- helpers


def intent(alert: str = "QueueHigh", **kwargs: Any) -> ScaleIntent:
    """An alert for NAME in NS received at T0 (see controllers.testing.scale_intent)."""
    return scale_intent(alert, **{"deployment": NAME, "namespace": NS, "at": T0, **kwargs})


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
    return {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": NS, "uid": UID, "resourceVersion": "7"},
        "spec": copy.deepcopy(spec),
        "status": copy.deepcopy(status or {}),
    }


def _load(queue: float, ready: int = 1, at: float = T0, stale: bool = False, error: str | None = None) -> LoadSample:
    return LoadSample(
        observed_at=at,
        stale=stale,
        ready_pods=ready,
        queue_depth_per_replica=queue,
        running_requests=float(ready),
        waiting_requests=queue * ready,
        error=error,
    )


def _autoscaler(api, source, *, transport=None, **settings: Any) -> tuple[Autoscaler, list, OperatorMetrics]:
    woken: list[tuple[str, str]] = []
    metrics = OperatorMetrics()
    http = httpx.AsyncClient(transport=transport) if transport is not None else None
    scaler = Autoscaler(
        api,
        source,
        OperatorSettings(**settings),
        metrics,
        wake=lambda *key: woken.append(key),
        http=http,
        clock=lambda: T0,
    )
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
    scaler, _woken, _ = _autoscaler(api, ScriptedSource(_load(8)))
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
    [
        None,
        {**_resource(), "metadata": {**_resource()["metadata"], "deletionTimestamp": iso(T0)}},
        _resource(spec={**SPEC, "variants": [{"name": "a", "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}]}),
        _resource(spec={**SPEC, "variants": [{"name": "a", "replicas": 1}]}),
    ],
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
    scaler, _woken, metrics = _autoscaler(api, ScriptedSource(_load(0)))
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
            return httpx.Response(
                200, json={"queued": [{"namespace": NS, "deployment": NAME, "variant": "default", "queued": 4}]}
            )
        if request.url.host == "prom":
            return httpx.Response(
                200,
                json={
                    "status": "success",
                    "data": {
                        "resultType": "vector",
                        "result": [{"metric": {"variant": "default"}, "value": [T0, "2"]}],
                    },
                },
            )
        return httpx.Response(500)

    transport = httpx.MockTransport(answer)
    api = ScriptedApi(_resource(), [])
    via_gateway, _, _ = _autoscaler(
        api, ScriptedSource(_load(0)), transport=transport, gateway_url="http://gw:80/", gateway_api_key="sk-op"
    )
    assert asyncio.run(via_gateway._gateway_queued(NS, NAME)) == {"default": 4.0}
    assert seen[-1].url.path == "/internal/queued" and seen[-1].headers["authorization"] == "Bearer sk-op"
    via_prom, _, _ = _autoscaler(api, ScriptedSource(_load(0)), transport=transport, prometheus_url="http://prom:9090")
    assert asyncio.run(via_prom._gateway_queued(NS, NAME)) == {"default": 2.0}
    assert 'llmfleet_gateway_queued_at_zero{namespace="ns",deployment="demo"}' in seen[-1].url.params["query"]
    broken, _, _ = _autoscaler(api, ScriptedSource(_load(0)), transport=transport, gateway_url="http://down")
    assert asyncio.run(broken._gateway_queued(NS, NAME)) is None
    neither, _, _ = _autoscaler(api, ScriptedSource(_load(0)), transport=transport)
    assert asyncio.run(neither._gateway_queued(NS, NAME)) is None


ZERO_SPEC = {
    "model": {"name": "m", "source": "bundled://smollm2-135m-instruct"},
    "variants": [
        {
            "name": "default",
            "autoscaling": {
                "minReplicas": 0,
                "maxReplicas": 3,
                "targets": {"queueDepthPerReplica": 2},
                "scaleToZeroAfterSeconds": 60,
            },
        }
    ],
}


@pytest.mark.parametrize(
    ("queued", "woken"),
    [(3, True), (0, False), (None, False)],
    ids=["held requests wake", "nothing held", "gateway unknown"],
)
def test_the_wake_check_evaluates_at_once_only_when_the_gateway_holds_requests(queued, woken):
    def answer(request: httpx.Request) -> httpx.Response:
        if queued is None:
            return httpx.Response(503)
        return httpx.Response(
            200, json={"queued": [{"namespace": NS, "deployment": NAME, "variant": "default", "queued": queued}]}
        )

    status = {"autoscaling": {"variants": [{"name": "default", "desiredReplicas": 0}]}}
    api = ScriptedApi(_resource(ZERO_SPEC, status), [])
    scaler, wakes, _ = _autoscaler(
        api, ScriptedSource(_load(0, ready=0)), transport=httpx.MockTransport(answer), gateway_url="http://gw"
    )
    outcomes = asyncio.run(scaler.wake_check(NS, NAME, ["default"]))
    if woken:
        (outcome,) = outcomes
        assert outcome.decision.desired_replicas >= 1 and api.patches() and wakes == [(NS, NAME)]
    else:
        assert outcomes == [] and api.patches() == [] and not any(verb == "get" for verb, *_ in api.calls)
