"""Alertmanager webhooks -> bounded, expiring scale-up intents.

Why it exists: the autoscaler's timer looks every few seconds, but Prometheus alert rules (TTFT SLO burn, queue
depth high, KV-cache saturation; see the chart's PrometheusRule) may know sooner and better that a variant is in
trouble. Alertmanager POSTs its webhook (payload version 4) here; `parse_webhook` turns it into `ScaleIntent`s and
`create_alerts_app` serves the endpoint with bearer-token auth. What an intent does is decided elsewhere: the
operator triggers an immediate evaluation and hands the intent to `controllers.autoscaling` (`alert_intent` /
`add_alert`), which keeps a replica floor of `current + step` (bounded by the variant's `scaleUpMaxStep` and
`maxReplicas`) until the intent expires, and records it in status like any decision.

Only the active replica acts: with kopf peering (several operator replicas) a standby answers 503 with a body
saying "this operator replica is a standby" and applies nothing. Alertmanager retries 5xx deliveries, and the
Service spreads the retries over the replicas, so one reaches the active replica; a standby acting on an alert
would scale a fleet that its paused peers no longer watch.

Which alerts count: status `firing`, label `llmfleet_scale="up"`, label `deployment` (the InferenceDeployment's
name), optional `namespace` (without it: that name in every watched namespace) and optional `variant` (without it:
every autoscaled variant of the deployment). An optional `llmfleet_scale_step` label asks for a step other than the
default, capped at `AlertPolicy.max_step`. A `resolved` alert ends its intent. Other alerts are ignored (reported
back, not an error), so one Alertmanager receiver can carry all alerts. A payload that is not a version 4 webhook
is a 400 that says what is wrong.

Alertmanager receiver (the token file holds the same secret as the operator's alerts token):

    receivers:
      - name: llmfleet-operator
        webhook_configs:
          - url: http://llmfleet-operator.llmfleet.svc:8081/alerts
            send_resolved: true
            http_config:
              authorization: {type: Bearer, credentials_file: /etc/alertmanager/llmfleet-token}
"""

from __future__ import annotations

import hmac
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controllers.autoscaling_plan import ScaleIntent

log = logging.getLogger(__name__)

SCALE_LABEL = "llmfleet_scale"
STEP_LABEL = "llmfleet_scale_step"
ALERTS_PATH = "/alerts"
STANDBY_CODE = "standby"  # the error code of a standby's 503 (the delivery counter reads it)


class AlertPolicy(BaseModel):
    """How far and how long an alert may push a variant up."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int = Field(1, ge=1, le=100, description="Pods added by a firing alert that names no step.")
    max_step: int = Field(4, ge=1, le=100, description="Most pods one alert may add (caps `llmfleet_scale_step`).")
    ttl_seconds: float = Field(
        300.0, gt=0, le=86_400, description="An intent expires this long after the alert was last received."
    )


class PayloadError(ValueError):
    """The body is not an Alertmanager webhook (version 4); the message says what is wrong."""


class _Alert(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    fingerprint: str | None = None


class _Webhook(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: Literal["4"]
    status: Literal["firing", "resolved"] | None = None
    receiver: str | None = None
    alerts: list[_Alert] = Field(max_length=10_000)


@dataclass(frozen=True)
class ParsedAlerts:
    """The intents of one webhook call, and why the other alerts in it were ignored."""

    intents: tuple[ScaleIntent, ...]
    ignored: tuple[str, ...]


def _validation_message(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:10]:
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_webhook(payload: Any, *, now: float, policy: AlertPolicy) -> ParsedAlerts:
    """The scale-up intents of an Alertmanager webhook payload (already decoded from JSON).

    Raises PayloadError when the payload is not a version 4 webhook."""
    if not isinstance(payload, Mapping):
        raise PayloadError(f"expected an Alertmanager webhook JSON object, got {type(payload).__name__}")
    if "version" in payload and payload["version"] != "4":
        raise PayloadError(f"unsupported Alertmanager webhook version {payload['version']!r}: only '4' is understood")
    try:
        webhook = _Webhook.model_validate(payload)
    except ValidationError as error:
        raise PayloadError(f"not an Alertmanager webhook payload: {_validation_message(error)}") from None
    intents: list[ScaleIntent] = []
    ignored: list[str] = []
    for index, alert in enumerate(webhook.alerts):
        labels = alert.labels
        name = labels.get("alertname") or f"alert-{index}"
        scale = labels.get(SCALE_LABEL)
        if scale is None:
            ignored.append(f"{name}: no {SCALE_LABEL} label")
            continue
        if scale != "up":
            ignored.append(f"{name}: {SCALE_LABEL}={scale!r} is not 'up'")
            continue
        deployment = labels.get("deployment")
        if not deployment:
            ignored.append(f"{name}: no deployment label (the InferenceDeployment to scale)")
            continue
        step = policy.step
        if STEP_LABEL in labels:
            raw = labels[STEP_LABEL]
            if not raw.isdigit() or int(raw) < 1:
                ignored.append(f"{name}: {STEP_LABEL}={raw!r} is not a positive integer")
                continue
            step = int(raw)
        step = min(step, policy.max_step)
        reason = alert.annotations.get("summary") or alert.annotations.get("description") or name
        intents.append(
            ScaleIntent(
                deployment=deployment,
                namespace=labels.get("namespace") or None,
                variant=labels.get("variant") or None,
                alert=name,
                fingerprint=alert.fingerprint,
                firing=alert.status == "firing",
                step=step,
                received_at=now,
                expires_at=now + policy.ttl_seconds,
                reason=reason[:1024],
            )
        )
    return ParsedAlerts(intents=tuple(intents), ignored=tuple(ignored))


def _error(status: int, message: str, kind: str, code: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": code}}, status_code=status, headers=dict(headers or {})
    )


def _always_active() -> bool:
    return True


def create_alerts_app(
    on_intents: Callable[[ParsedAlerts], Awaitable[None] | None],
    token: str,
    *,
    policy: AlertPolicy | None = None,
    clock: Callable[[], float] = time.time,
    max_body_bytes: int = 1 << 20,
    is_active: Callable[[], bool] = _always_active,
) -> FastAPI:
    """The operator's Alertmanager endpoint: `POST /alerts` (bearer `token`) and `GET /healthz`.

    `on_intents` receives each call's intents (sync or async); if it raises, the call answers 503 so that
    Alertmanager retries. Calls without any scale intent answer 200 without calling it. While `is_active()` is
    False (a standby replica under kopf peering) an authenticated call answers 503 and nothing is applied."""
    if not token or not token.strip():
        raise ValueError("the alerts endpoint needs a non-empty bearer token: set the operator's alerts token")
    expected = f"Bearer {token}".encode()
    chosen = policy or AlertPolicy()
    app = FastAPI(title="llmfleet operator alerts", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(ALERTS_PATH)
    async def alerts(request: Request) -> JSONResponse:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return _error(
                401,
                "missing or invalid bearer token: send 'Authorization: Bearer <token>' with the operator's "
                "alerts token",
                "authentication_error",
                "invalid_token",
                {"WWW-Authenticate": "Bearer"},
            )
        if not is_active():
            return _error(
                503,
                "this operator replica is a standby (kopf peering paused it): it applies no alerts; Alertmanager "
                "retries, and the active replica applies them",
                "server_error",
                STANDBY_CODE,
                {"Retry-After": "5"},
            )
        declared = request.headers.get("content-length", "")
        size = int(declared) if declared.isdigit() else 0
        body = b"" if size > max_body_bytes else await request.body()  # refuse a declared oversize unread
        size = max(size, len(body))
        if size > max_body_bytes:
            return _error(
                413,
                f"payload of {size} bytes is over the {max_body_bytes}-byte limit",
                "invalid_request_error",
                "payload_too_large",
            )
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return _error(400, f"body is not JSON: {error}", "invalid_request_error", "invalid_json")
        try:
            parsed = parse_webhook(payload, now=clock(), policy=chosen)
        except PayloadError as error:
            return _error(400, str(error), "invalid_request_error", "invalid_payload")
        if parsed.intents:
            try:
                result = on_intents(parsed)
                if inspect.isawaitable(result):
                    await result
            except Exception as error:
                log.exception("applying alert intents failed")
                return _error(503, f"could not apply the alerts: {error}", "server_error", "apply_failed")
        for reason in parsed.ignored:
            log.debug("ignored alert: %s", reason)
        return JSONResponse(
            {
                "status": "ok",
                "accepted": len(parsed.intents),
                "intents": [asdict(intent) for intent in parsed.intents],
                "ignored": list(parsed.ignored),
            }
        )

    return app
