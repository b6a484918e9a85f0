"""The operator's HTTP servers: the public one (Alertmanager's `POST /alerts`, `GET /healthz`) and the internal
metrics one (`GET /metrics`).

Why it exists: alert-driven scaling needs an endpoint inside the operator process (the autoscaler that acts on an
alert lives there, with its API client and per-deployment locks). The operator's own series name deployments and
namespaces, so they are served on a second, internal port (`metrics_host`/`metrics_port`, scraped by the chart's
PodMonitor and never behind the operator's Service), not on the port Alertmanager reaches. Both run uvicorn inside
kopf's event loop, so alert handlers call the autoscaler directly; kopf owns the process's signals (uvicorn's own
handler would take SIGTERM away from it), and each socket is bound here, so a port already in use is an error
message, not uvicorn's `sys.exit` inside kopf's loop.

`POST /alerts` is `alerts.create_alerts_app` (bearer token, Alertmanager payload version 4); every delivery is
counted in `llmfleet_operator_alerts_received_total` by result: `unauthorized` (401), `accepted` (at least one
scale intent), `ignored` (a valid call without scale intents, or a payload that is not a webhook), `standby` (a
replica that kopf peering paused answered 503: only the active replica applies alerts). Without a token the
endpoint answers 404 with how to turn it on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from fleet_operator.alerts import (
    ALERTS_PATH,
    STANDBY_CODE,
    AlertPolicy,
    ParsedAlerts,
    create_alerts_app,
)
from fleet_operator.operator_metrics import AlertResult, OperatorMetrics

log = logging.getLogger(__name__)
ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def _always_active() -> bool:
    return True


def create_operator_app(
    metrics: OperatorMetrics,
    on_intents: Callable[[ParsedAlerts], Awaitable[None]],
    token: str | None,
    policy: AlertPolicy,
    is_active: Callable[[], bool] = _always_active,
) -> ASGIApp:
    """The public app: `/alerts` (when `token` is set; applied only while `is_active()`), `/healthz`; deliveries
    to `/alerts` are counted in `metrics`, which this app does not serve (see `create_metrics_app`)."""
    if token and token.strip():
        app = create_alerts_app(on_intents, token, policy=policy, is_active=is_active)
    else:
        app = FastAPI(title="llmfleet operator", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok"}

        @app.post(ALERTS_PATH)
        async def alerts_off() -> JSONResponse:
            message = (
                "alert-driven scaling is off: set LLMFLEET_OPERATOR_ALERTS_TOKEN (the bearer token Alertmanager "
                "sends) to enable POST /alerts"
            )
            return JSONResponse({"error": {"message": message, "type": "not_found", "code": "alerts_disabled"}}, 404)

    return _CountDeliveries(app, metrics)


def create_metrics_app(metrics: OperatorMetrics) -> FastAPI:
    """The internal app: `GET /metrics` only (the operator's series; for the metrics port)."""
    app = FastAPI(title="llmfleet operator metrics", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def exposition() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


class _CountDeliveries:
    """ASGI wrapper counting each `POST /alerts` delivery by its answer (status, and the `accepted` count)."""

    def __init__(self, app: ASGIApp, metrics: OperatorMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") != ALERTS_PATH:
            await self.app(scope, receive, send)
            return
        seen: dict[str, Any] = {"status": 500, "body": b""}

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["body"] += message.get("body", b"")
            await send(message)

        await self.app(scope, receive, capture)
        result = delivery_result(seen["status"], seen["body"])
        if result is not None:
            self.metrics.count_alert_delivery(result)


def delivery_result(status: int, body: bytes) -> AlertResult | None:
    """How a delivery counts: 401 unauthorized; 200 with scale intents accepted; other 2xx/4xx ignored; a
    standby's 503 standby; other 5xx not at all (Alertmanager retries it, and the retry is counted)."""
    if status == 401:
        return "unauthorized"
    if status >= 500:
        return "standby" if _error_code(body) == STANDBY_CODE else None
    if status == 200:
        try:
            accepted = int(json.loads(body).get("accepted") or 0)
        except (ValueError, TypeError, AttributeError):
            accepted = 0
        return "accepted" if accepted > 0 else "ignored"
    return "ignored"


def _error_code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error")
        return str(error.get("code")) if isinstance(error, dict) else None
    except (ValueError, TypeError, AttributeError):
        return None


class _KopfOwnsSignals(uvicorn.Server):
    """uvicorn without its signal handlers: SIGTERM stops kopf, and kopf's cleanup stops this server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class OperatorHttpServer:
    """An app under uvicorn in the running event loop. `start` returns False (and logs why) when the address
    cannot be bound: the operator keeps reconciling and autoscaling on its timer without what this server serves
    (`serves`, for the log, e.g. "/alerts"; `settings`, the variables that choose the address)."""

    def __init__(
        self, app: ASGIApp, host: str, port: int, serves: str = "/alerts", settings: str = "HTTP_HOST/_HTTP_PORT"
    ) -> None:
        self.host, self.requested_port = host, port
        self.serves, self.settings = serves, settings
        self.port: int | None = None
        self._app = app
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> bool:
        try:
            infos = socket.getaddrinfo(self.host, self.requested_port, type=socket.SOCK_STREAM)
            family, _type, _proto, _name, address = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
                sock.listen(128)
            except OSError:
                sock.close()
                raise
        except OSError as error:
            log.error(
                "cannot serve %s on %s:%s: %s; set LLMFLEET_OPERATOR_%s to a free address (the operator goes on "
                "without it)",
                self.serves,
                self.host,
                self.requested_port,
                error,
                self.settings,
            )
            return False
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(self._app, lifespan="off", log_config=None, log_level="warning", access_log=False)
        self._server = _KopfOwnsSignals(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="llmfleet-operator-http")
        log.info("serving %s on %s:%d", self.serves, self.host, self.port)
        return True

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout_s)  # cancels the server task when it takes longer
        except TimeoutError:
            log.warning("the HTTP server did not stop within %.0f s; cancelled it", timeout_s)
        finally:
            self._server = self._task = None
