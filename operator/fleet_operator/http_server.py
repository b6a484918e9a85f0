"""The operator's HTTP server: Alertmanager's `POST /alerts`, `GET /metrics` and `GET /healthz`.

Why it exists: alert-driven scaling needs an endpoint inside the operator process (the autoscaler that acts on an
alert lives there, with its API client and per-deployment locks), and the chart scrapes the operator's own series
from the same port. It runs uvicorn inside kopf's event loop, so alert handlers call the autoscaler directly;
kopf owns the process's signals (uvicorn's own handler would take SIGTERM away from it), and the socket is bound
here, so a port already in use is an error message, not uvicorn's `sys.exit` inside kopf's loop.

`POST /alerts` is `alerts.create_alerts_app` (bearer token, Alertmanager payload version 4); every delivery is
counted in `llmfleet_operator_alerts_received_total` by result: `unauthorized` (401), `accepted` (at least one
scale intent), `ignored` (a valid call without scale intents, or a payload that is not a webhook). Without a
token the endpoint answers 404 with how to turn it on.
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

from fleet_operator.alerts import ALERTS_PATH, AlertPolicy, ParsedAlerts, create_alerts_app
from fleet_operator.operator_metrics import AlertResult, OperatorMetrics

log = logging.getLogger(__name__)
ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def create_operator_app(
    metrics: OperatorMetrics,
    on_intents: Callable[[ParsedAlerts], Awaitable[None]],
    token: str | None,
    policy: AlertPolicy,
) -> ASGIApp:
    """The app: `/alerts` (when `token` is set), `/metrics`, `/healthz`; deliveries to `/alerts` are counted."""
    if token and token.strip():
        app = create_alerts_app(on_intents, token, policy=policy)
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

    @app.get("/metrics")
    async def exposition() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return _CountDeliveries(app, metrics)


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
    """How a delivery counts: 401 unauthorized; 200 with scale intents accepted; other 2xx/4xx ignored; 5xx not
    at all (Alertmanager retries it, and the retry is counted)."""
    if status == 401:
        return "unauthorized"
    if status >= 500:
        return None
    if status == 200:
        try:
            accepted = int(json.loads(body).get("accepted") or 0)
        except (ValueError, TypeError, AttributeError):
            accepted = 0
        return "accepted" if accepted > 0 else "ignored"
    return "ignored"


class _KopfOwnsSignals(uvicorn.Server):
    """uvicorn without its signal handlers: SIGTERM stops kopf, and kopf's cleanup stops this server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class OperatorHttpServer:
    """The app under uvicorn in the running event loop. `start` returns False (and logs why) when the address
    cannot be bound: the operator keeps reconciling and autoscaling on its timer without alerts and metrics."""

    def __init__(self, app: ASGIApp, host: str, port: int) -> None:
        self.host, self.requested_port = host, port
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
                "cannot serve /alerts and /metrics on %s:%s: %s; set LLMFLEET_OPERATOR_HTTP_HOST/_HTTP_PORT to a "
                "free address (the operator goes on without them)",
                self.host,
                self.requested_port,
                error,
            )
            return False
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(self._app, lifespan="off", log_config=None, log_level="warning", access_log=False)
        self._server = _KopfOwnsSignals(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="llmfleet-operator-http")
        log.info("serving /alerts and /metrics on %s:%d", self.host, self.port)
        return True

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout_s)  # cancels the server task when it takes longer
        except asyncio.TimeoutError:
            log.warning("the HTTP server did not stop within %.0f s; cancelled it", timeout_s)
        finally:
            self._server = self._task = None
