"""The operator's HTTP server (Alertmanager webhook, /metrics), its metrics, and the settings that configure them:
the app over ASGI, the server on a real loopback socket, the metrics from CR bodies and plans."""

from __future__ import annotations

import asyncio
import random
import socket

import httpx
import pytest
from fleet_operator.alerts import AlertPolicy, ParsedAlerts
from fleet_operator.http_server import OperatorHttpServer, create_metrics_app, create_operator_app, delivery_result
from fleet_operator.main import peering_priority
from fleet_operator.operator_metrics import OperatorMetrics
from fleet_operator.settings import OperatorSettings, SettingsError
from prometheus_client.parser import text_string_to_metric_families

from controllers import EmitEvent, EventType, Plan

TOKEN = "s3cret"
ALERT = {"status": "firing", "labels": {"alertname": "QueueHigh", "llmfleet_scale": "up", "deployment": "demo"}}


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def _post(app, path: str, payload, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://op") as client:
        return await client.post(path, json=payload, headers=headers)


async def _get(app, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://op") as client:
        return await client.get(path)


def test_alert_deliveries_reach_the_autoscaler_and_are_counted_by_result():
    received: list[ParsedAlerts] = []

    async def on_intents(parsed: ParsedAlerts) -> None:
        received.append(parsed)

    metrics = OperatorMetrics()
    app = create_operator_app(metrics, on_intents, TOKEN, AlertPolicy(step=2, max_step=3, ttl_seconds=60))

    async def scenario() -> list[int]:
        answers = [
            await _post(app, "/alerts", {"version": "4", "alerts": [ALERT]}),
            await _post(app, "/alerts", {"version": "4", "alerts": [{"status": "firing", "labels": {"a": "b"}}]}),
            await _post(app, "/alerts", {"version": "4", "alerts": [ALERT]}, token="wrong"),
            await _post(app, "/alerts", {"version": "4", "alerts": [ALERT]}, token=None),
            await _post(app, "/alerts", {"not": "a webhook"}),
        ]
        return [a.status_code for a in answers]

    assert asyncio.run(scenario()) == [200, 200, 401, 401, 400]
    (parsed,) = received
    (intent,) = parsed.intents
    assert intent.step == 2 and intent.ttl_seconds == 60 and intent.deployment == "demo"
    text = asyncio.run(_get(create_metrics_app(metrics), "/metrics")).text
    assert _samples(text, "llmfleet_operator_alerts_received_total") == {
        (("result", "accepted"),): 1.0,
        (("result", "ignored"),): 2.0,
        (("result", "unauthorized"),): 2.0,
    }


def test_a_failing_autoscaler_answers_503_and_is_not_counted():
    async def on_intents(parsed: ParsedAlerts) -> None:
        raise RuntimeError("API down")

    metrics = OperatorMetrics()
    app = create_operator_app(metrics, on_intents, TOKEN, AlertPolicy())
    assert asyncio.run(_post(app, "/alerts", {"version": "4", "alerts": [ALERT]})).status_code == 503
    assert _samples(metrics.exposition().decode(), "llmfleet_operator_alerts_received_total") == {}


def test_without_a_token_alerts_are_off_but_health_is_served():
    async def on_intents(parsed: ParsedAlerts) -> None:
        raise AssertionError("never called")

    app = create_operator_app(OperatorMetrics(), on_intents, None, AlertPolicy())
    answer = asyncio.run(_post(app, "/alerts", {"version": "4", "alerts": [ALERT]}))
    assert answer.status_code == 404 and "LLMFLEET_OPERATOR_ALERTS_TOKEN" in answer.json()["error"]["message"]
    assert asyncio.run(_get(app, "/healthz")).status_code == 200


@pytest.mark.parametrize("token", [TOKEN, None], ids=["alerts on", "alerts off"])
def test_metrics_are_served_only_by_the_internal_app(token):
    """/metrics names deployments and namespaces: never on the public (Alertmanager) port, only on the metrics
    port, which serves nothing else."""

    async def on_intents(parsed: ParsedAlerts) -> None:
        return None

    metrics = OperatorMetrics()
    metrics.observe_deployment(_body("secret-name", [("a", 1, 1, 1)]))
    public = create_operator_app(metrics, on_intents, token, AlertPolicy())
    internal = create_metrics_app(metrics)
    answer = asyncio.run(_get(public, "/metrics"))
    assert answer.status_code == 404 and "secret-name" not in answer.text
    exposition = asyncio.run(_get(internal, "/metrics"))
    assert exposition.status_code == 200 and exposition.headers["content-type"].startswith("text/plain")
    assert "secret-name" in exposition.text
    assert asyncio.run(_post(internal, "/alerts", {"version": "4", "alerts": [ALERT]})).status_code == 404


def test_a_standby_refuses_deliveries_and_counts_them_as_standby():
    received: list[ParsedAlerts] = []
    active = {"now": False}

    async def on_intents(parsed: ParsedAlerts) -> None:
        received.append(parsed)

    metrics = OperatorMetrics()
    app = create_operator_app(metrics, on_intents, TOKEN, AlertPolicy(), is_active=lambda: active["now"])
    standby = asyncio.run(_post(app, "/alerts", {"version": "4", "alerts": [ALERT]}))
    assert standby.status_code == 503 and "standby" in standby.json()["error"]["message"]
    assert received == []
    active["now"] = True
    assert asyncio.run(_post(app, "/alerts", {"version": "4", "alerts": [ALERT]})).status_code == 200
    assert len(received) == 1
    assert _samples(metrics.exposition().decode(), "llmfleet_operator_alerts_received_total") == {
        (("result", "standby"),): 1.0,
        (("result", "accepted"),): 1.0,
    }


@pytest.mark.parametrize(
    ("status", "body", "result"),
    [
        (401, b"", "unauthorized"),
        (200, b'{"accepted": 2}', "accepted"),
        (200, b'{"accepted": 0}', "ignored"),
        (200, b"not json", "ignored"),
        (400, b"{}", "ignored"),
        (413, b"{}", "ignored"),
        (503, b"{}", None),
        (503, b'{"error": {"code": "standby"}}', "standby"),
        (503, b'{"error": {"code": "apply_failed"}}', None),
    ],
)
def test_delivery_result(status, body, result):
    assert delivery_result(status, body) == result


def test_the_server_serves_on_loopback_and_a_busy_port_is_reported_not_fatal():
    async def on_intents(parsed: ParsedAlerts) -> None:
        return None

    async def scenario() -> tuple[int, bool]:
        app = create_operator_app(OperatorMetrics(), on_intents, TOKEN, AlertPolicy())
        server = OperatorHttpServer(app, "127.0.0.1", 0)
        assert await server.start() and server.port
        try:
            async with httpx.AsyncClient() as client:
                status = (await client.get(f"http://127.0.0.1:{server.port}/healthz")).status_code
            busy = OperatorHttpServer(app, "127.0.0.1", server.port)
            started = await busy.start()
            await busy.stop()  # nothing to stop: harmless
        finally:
            await server.stop()
        return status, started

    assert asyncio.run(scenario()) == (200, False)


def test_the_port_is_free_again_after_stop():
    async def on_intents(parsed: ParsedAlerts) -> None:
        return None

    async def scenario() -> int:
        server = OperatorHttpServer(
            create_operator_app(OperatorMetrics(), on_intents, None, AlertPolicy()), "127.0.0.1", 0
        )
        assert await server.start()
        port = server.port
        await server.stop()
        return port

    port = asyncio.run(scenario())
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "still listening after stop"


# ------------------------------------------------------------------------------------------------- metrics


def _body(name: str, variants: list[tuple[str, int, int, int]], canary: int = 0) -> dict:
    return {
        "metadata": {"namespace": "ns", "name": name},
        "status": {
            "variants": [
                {"name": v, "replicas": r, "readyReplicas": ready, "desiredReplicas": d} for v, r, ready, d in variants
            ],
            "rollout": {"canaryWeight": canary},
        },
    }


def test_gauges_follow_the_status_and_disappear_with_variants_and_deployments():
    metrics = OperatorMetrics()
    metrics.observe_deployment(_body("demo", [("a", 3, 2, 4), ("b", 1, 1, 1)], canary=34))
    text = metrics.exposition().decode()
    assert _samples(text, "llmfleet_operator_replicas") == {
        (("deployment", "demo"), ("namespace", "ns"), ("variant", "a")): 3.0,
        (("deployment", "demo"), ("namespace", "ns"), ("variant", "b")): 1.0,
    }
    assert (
        _samples(text, "llmfleet_operator_ready_replicas")[
            (("deployment", "demo"), ("namespace", "ns"), ("variant", "a"))
        ]
        == 2.0
    )
    assert (
        _samples(text, "llmfleet_operator_desired_replicas")[
            (("deployment", "demo"), ("namespace", "ns"), ("variant", "a"))
        ]
        == 4.0
    )
    assert _samples(text, "llmfleet_operator_canary_weight") == {(("deployment", "demo"), ("namespace", "ns")): 34.0}
    metrics.observe_deployment(_body("demo", [("a", 4, 4, 4)]))
    assert set(_samples(metrics.exposition().decode(), "llmfleet_operator_replicas")) == {
        (("deployment", "demo"), ("namespace", "ns"), ("variant", "a"))
    }
    metrics.forget_deployment("ns", "demo")
    text = metrics.exposition().decode()
    assert _samples(text, "llmfleet_operator_replicas") == {}
    assert _samples(text, "llmfleet_operator_canary_weight") == {}
    metrics.forget_deployment("ns", "never-seen")  # harmless


def test_a_standby_exports_no_deployment_gauges():
    metrics = OperatorMetrics()
    metrics.set_active(True)
    metrics.observe_deployment(_body("demo", [("a", 3, 2, 4)], canary=34))
    metrics.observe_deployment(_body("other", [("b", 1, 1, 1)]))
    assert _samples(metrics.exposition().decode(), "llmfleet_operator_active") == {(): 1.0}
    metrics.set_active(False)
    text = metrics.exposition().decode()
    assert _samples(text, "llmfleet_operator_active") == {(): 0.0}
    assert (
        _samples(text, "llmfleet_operator_replicas") == {} and _samples(text, "llmfleet_operator_canary_weight") == {}
    )


def test_plan_events_count_verdicts_and_rollout_results():
    metrics = OperatorMetrics()
    plan = Plan(
        actions=(
            EmitEvent(EventType.NORMAL, "AnalysisPass", "ok"),
            EmitEvent(EventType.WARNING, "AnalysisFail", "slow"),
            EmitEvent(EventType.NORMAL, "AnalysisPass", "ok"),
            EmitEvent(EventType.WARNING, "CanaryRolledBack", "bad"),
            EmitEvent(EventType.NORMAL, "CreatedPod", "not counted"),
        )
    )
    metrics.observe_plan({"metadata": {"namespace": "ns", "name": "demo"}}, plan)
    text = metrics.exposition().decode()
    assert _samples(text, "llmfleet_operator_analysis_verdicts_total") == {
        (("deployment", "demo"), ("namespace", "ns"), ("verdict", "pass")): 2.0,
        (("deployment", "demo"), ("namespace", "ns"), ("verdict", "fail")): 1.0,
    }
    assert _samples(text, "llmfleet_operator_rollouts_total") == {
        (("deployment", "demo"), ("namespace", "ns"), ("result", "rolled_back")): 1.0
    }


def test_two_metrics_objects_share_nothing():
    one, two = OperatorMetrics(), OperatorMetrics()
    one.count_alert_delivery("accepted")
    assert _samples(two.exposition().decode(), "llmfleet_operator_alerts_received_total") == {}


# ------------------------------------------------------------------------------------------------ settings


def test_http_alert_and_autoscaling_settings_from_the_environment():
    settings = OperatorSettings.load(
        {
            "LLMFLEET_OPERATOR_HTTP_HOST": "10.1.2.3",
            "LLMFLEET_OPERATOR_HTTP_PORT": "9090",
            "LLMFLEET_OPERATOR_ALERTS_TOKEN": "zq-9x7-secret",
            "LLMFLEET_OPERATOR_ALERT_STEP": "2",
            "LLMFLEET_OPERATOR_ALERT_TTL_SECONDS": "120",
            "LLMFLEET_OPERATOR_AUTOSCALE_INTERVAL_SECONDS": "2.5",
            "LLMFLEET_OPERATOR_GATEWAY_URL": "",
        }
    )
    assert (settings.http_host, settings.http_port, settings.alert_step, settings.alert_ttl_seconds) == (
        "10.1.2.3",
        9090,
        2,
        120.0,
    )
    assert settings.alerts_token is not None and settings.alerts_token.get_secret_value() == "zq-9x7-secret"
    assert "zq-9x7-secret" not in repr(settings)  # the token never shows in logs
    assert settings.autoscale_interval_seconds == 2.5 and settings.gateway_url is None
    defaults = OperatorSettings.load({})
    assert (defaults.http_host, defaults.http_port, defaults.autoscale_interval_seconds) == ("127.0.0.1", 8081, 10)
    assert defaults.alerts_token is None and defaults.expected_startup_seconds == 300
    assert (defaults.metrics_host, defaults.metrics_port) == ("127.0.0.1", 8082)


def test_metrics_address_from_the_environment_and_the_flag():
    settings = OperatorSettings.load(
        {"LLMFLEET_OPERATOR_METRICS_HOST": "10.1.2.3", "LLMFLEET_OPERATOR_METRICS_PORT": "9100"}
    )
    assert (settings.metrics_host, settings.metrics_port) == ("10.1.2.3", 9100)
    assert OperatorSettings.load({"LLMFLEET_OPERATOR_METRICS_PORT": "9100"}, metrics_port=9200).metrics_port == 9200
    assert OperatorSettings.load({"LLMFLEET_OPERATOR_HTTP_PORT": "0", "LLMFLEET_OPERATOR_METRICS_PORT": "0"})


def test_the_metrics_port_must_differ_from_the_public_port():
    with pytest.raises(SettingsError, match="LLMFLEET_OPERATOR_METRICS_PORT"):
        OperatorSettings.load({"LLMFLEET_OPERATOR_HTTP_PORT": "9000", "LLMFLEET_OPERATOR_METRICS_PORT": "9000"})


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"LLMFLEET_OPERATOR_HTTP_PORT": "70000"}, "LLMFLEET_OPERATOR_HTTP_PORT"),
        ({"LLMFLEET_OPERATOR_AUTOSCALE_INTERVAL_SECONDS": "0"}, "LLMFLEET_OPERATOR_AUTOSCALE_INTERVAL_SECONDS"),
        ({"LLMFLEET_OPERATOR_ALERT_MAX_STEP": "0"}, "LLMFLEET_OPERATOR_ALERT_MAX_STEP"),
    ],
)
def test_bad_http_and_autoscaling_settings_name_the_variable(env, needle):
    with pytest.raises(SettingsError, match=needle):
        OperatorSettings.load(env)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 0),
        ({"LLMFLEET_OPERATOR_PRIORITY": "7"}, 7),
        ({"LLMFLEET_OPERATOR_PEERING": "llmfleet", "LLMFLEET_OPERATOR_PRIORITY": "7"}, 7),
    ],
)
def test_peering_priority_as_configured(env, expected):
    assert peering_priority(OperatorSettings.load(env), random.Random(1)) == expected


def test_peering_without_a_priority_picks_a_random_one_per_process():
    settings = OperatorSettings.load({"LLMFLEET_OPERATOR_PEERING": "llmfleet"})
    picks = {peering_priority(settings, random.Random(seed)) for seed in range(5)}
    assert len(picks) == 5 and all(p > 0 for p in picks)
