"""Alertmanager webhooks: payload parsing into scale-up intents (tables) and the authenticated endpoint."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fleet_operator.alerts import (
    AlertPolicy,
    ParsedAlerts,
    PayloadError,
    create_alerts_app,
    parse_webhook,
)
from pydantic import ValidationError

NOW = 1_700_000_000.0
POLICY = AlertPolicy(step=1, max_step=3, ttl_seconds=120)
TOKEN = "s3cret-token"


def alert(status: str = "firing", **labels: str) -> dict[str, Any]:
    base = {"alertname": "LLMTTFTHigh", "llmfleet_scale": "up", "deployment": "smol", "namespace": "ns"}
    base.update(labels)
    return {
        "status": status,
        "labels": {k: v for k, v in base.items() if v != "-"},  # "-" removes a label
        "annotations": {"summary": "TTFT p95 over SLO"},
        "startsAt": "2025-01-01T00:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": "abc123",
    }


def webhook(*alerts: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    body = {
        "version": "4",
        "groupKey": '{}:{alertname="LLMTTFTHigh"}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "llmfleet-operator",
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": list(alerts),
    }
    body.update(overrides)
    return body


# (id, alert, expected intent fields or None, ignored-reason fragment)
INTENT_CASES: list[tuple[str, dict[str, Any], dict[str, Any] | None, str | None]] = [
    (
        "firing alert for a deployment",
        alert(),
        {
            "deployment": "smol",
            "namespace": "ns",
            "variant": None,
            "firing": True,
            "step": 1,
            "alert": "LLMTTFTHigh",
            "fingerprint": "abc123",
            "reason": "TTFT p95 over SLO",
        },
        None,
    ),
    ("variant label narrows it", alert(variant="int4"), {"variant": "int4"}, None),
    ("no namespace label: any watched namespace", alert(namespace="-"), {"namespace": None}, None),
    ("resolved ends the intent", alert("resolved"), {"firing": False}, None),
    ("step label", alert(llmfleet_scale_step="2"), {"step": 2}, None),
    ("step label is capped at max_step", alert(llmfleet_scale_step="50"), {"step": 3}, None),
    ("expiry from the policy", alert(), {"received_at": NOW, "expires_at": NOW + 120}, None),
    ("no scale label: ignored", alert(llmfleet_scale="-"), None, "no llmfleet_scale label"),
    ("scale down is not ours", alert(llmfleet_scale="down"), None, "llmfleet_scale='down' is not 'up'"),
    ("no deployment label", alert(deployment="-"), None, "no deployment label"),
    ("bad step label", alert(llmfleet_scale_step="two"), None, "llmfleet_scale_step='two' is not a positive"),
    ("zero step label", alert(llmfleet_scale_step="0"), None, "is not a positive integer"),
]


@pytest.mark.parametrize(
    ("payload_alert", "expected", "ignored"), [pytest.param(*c[1:], id=c[0]) for c in INTENT_CASES]
)
def test_parse_webhook(payload_alert: dict[str, Any], expected: dict[str, Any] | None, ignored: str | None) -> None:
    parsed = parse_webhook(webhook(payload_alert), now=NOW, policy=POLICY)
    if expected is None:
        assert parsed.intents == ()
        assert len(parsed.ignored) == 1 and ignored in parsed.ignored[0]
    else:
        assert parsed.ignored == () and len(parsed.intents) == 1
        intent = parsed.intents[0]
        for field, value in expected.items():
            assert getattr(intent, field) == value, field
        assert intent.ttl_seconds == 120


def test_mixed_payload_keeps_scale_alerts_and_reports_the_rest() -> None:
    parsed = parse_webhook(
        webhook(alert(variant="a"), alert(llmfleet_scale="-", alertname="DiskFull"), alert("resolved", variant="b")),
        now=NOW,
        policy=POLICY,
    )
    assert [(i.variant, i.firing) for i in parsed.intents] == [("a", True), ("b", False)]
    assert parsed.ignored == ("DiskFull: no llmfleet_scale label",)


BAD_PAYLOADS = [
    ("not an object", [1, 2], "expected an Alertmanager webhook JSON object, got list"),
    ("wrong version", webhook(alert(), version="3"), "unsupported Alertmanager webhook version '3'"),
    ("no version", {k: v for k, v in webhook(alert()).items() if k != "version"}, "version: Field required"),
    ("alerts not a list", webhook(alerts={"a": 1}), "alerts: Input should be a valid list"),
    ("alert without labels", webhook({"status": "firing"}), "alerts.0.labels: Field required"),
    ("unknown alert status", webhook(alert(status="pending")), "alerts.0.status"),
    ("label value not a string", webhook({**alert(), "labels": {"deployment": 3}}), "alerts.0.labels.deployment"),
]


@pytest.mark.parametrize(("payload", "message"), [pytest.param(*c[1:], id=c[0]) for c in BAD_PAYLOADS])
def test_malformed_payloads_are_clear_errors(payload: Any, message: str) -> None:
    with pytest.raises(PayloadError, match="webhook") as raised:
        parse_webhook(payload, now=NOW, policy=POLICY)
    assert message in str(raised.value)


def test_policy_bounds_are_validated() -> None:
    with pytest.raises(ValidationError):
        AlertPolicy(ttl_seconds=0)
    with pytest.raises(ValidationError):
        AlertPolicy(step=0)


# ------------------------------------------------------------------------------------------------- the endpoint


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[ParsedAlerts] = []
        self.fail = fail

    async def __call__(self, parsed: ParsedAlerts) -> None:
        if self.fail:
            raise RuntimeError("API server unavailable")
        self.calls.append(parsed)


def client_for(recorder: Any, **kwargs: Any) -> httpx.AsyncClient:
    app = create_alerts_app(recorder, TOKEN, policy=POLICY, clock=lambda: NOW, **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://operator")


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_post_applies_intents() -> None:
    recorder = Recorder()
    async with client_for(recorder) as client:
        response = await client.post("/alerts", json=webhook(alert(variant="default")), headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["accepted"] == 1 and body["ignored"] == []
    assert body["intents"][0]["variant"] == "default" and body["intents"][0]["expires_at"] == NOW + 120
    assert len(recorder.calls) == 1 and recorder.calls[0].intents[0].deployment == "smol"


async def test_sync_callbacks_work_too() -> None:
    seen: list[ParsedAlerts] = []
    async with client_for(seen.append) as client:
        response = await client.post("/alerts", json=webhook(alert()), headers=AUTH)
    assert response.status_code == 200 and len(seen) == 1


async def test_no_scale_alerts_answer_ok_without_calling_back() -> None:
    recorder = Recorder()
    async with client_for(recorder) as client:
        response = await client.post("/alerts", json=webhook(alert(llmfleet_scale="-")), headers=AUTH)
    assert response.status_code == 200 and response.json()["accepted"] == 0
    assert response.json()["ignored"] == ["LLMTTFTHigh: no llmfleet_scale label"]
    assert recorder.calls == []


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
    ],
    ids=["missing", "wrong token", "no scheme", "basic", "longer token"],
)
async def test_bad_or_missing_token_is_401(headers: dict[str, str]) -> None:
    recorder = Recorder()
    async with client_for(recorder) as client:
        response = await client.post("/alerts", json=webhook(alert()), headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and "bearer token" in error["message"]
    assert recorder.calls == []


@pytest.mark.parametrize(
    ("content", "code", "fragment"),
    [
        (b"{not json", "invalid_json", "body is not JSON"),
        (json.dumps(webhook(alert(), version="2")).encode(), "invalid_payload", "version '2'"),
        (json.dumps({"alerts": []}).encode(), "invalid_payload", "version: Field required"),
    ],
    ids=["not json", "old version", "missing version"],
)
async def test_malformed_posts_are_400(content: bytes, code: str, fragment: str) -> None:
    async with client_for(Recorder()) as client:
        response = await client.post("/alerts", content=content, headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == code and fragment in error["message"]


async def test_oversized_payload_is_413() -> None:
    async with client_for(Recorder(), max_body_bytes=100) as client:
        response = await client.post("/alerts", json=webhook(alert()), headers=AUTH)
    assert response.status_code == 413 and "over the 100-byte limit" in response.json()["error"]["message"]


async def test_callback_failure_is_503_so_alertmanager_retries() -> None:
    async with client_for(Recorder(fail=True)) as client:
        response = await client.post("/alerts", json=webhook(alert()), headers=AUTH)
    assert response.status_code == 503
    assert "API server unavailable" in response.json()["error"]["message"]


async def test_healthz_needs_no_token() -> None:
    async with client_for(Recorder()) as client:
        response = await client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.mark.parametrize("token", ["", "   "])
def test_empty_token_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="non-empty bearer token"):
        create_alerts_app(Recorder(), token)


class Switch:
    """Whether this operator replica is active (kopf peering), flipped by the test."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def __call__(self) -> bool:
        return self.active


async def test_a_standby_answers_503_and_applies_nothing_until_it_becomes_active() -> None:
    recorder, switch = Recorder(), Switch(active=False)
    async with client_for(recorder, is_active=switch) as client:
        standby = await client.post("/alerts", json=webhook(alert()), headers=AUTH)
        unauthorized = await client.post("/alerts", json=webhook(alert()))
        switch.active = True
        active = await client.post("/alerts", json=webhook(alert()), headers=AUTH)
    assert standby.status_code == 503, standby.text  # Alertmanager retries 5xx (and may reach the active replica)
    error = standby.json()["error"]
    assert error["code"] == "standby" and "this operator replica is a standby" in error["message"]
    assert unauthorized.status_code == 401  # the token is checked first: a standby tells nothing to strangers
    assert active.status_code == 200 and active.json()["accepted"] == 1
    assert len(recorder.calls) == 1  # only the delivery to the active replica reached the autoscaler
