"""The gateway's internal metrics server: `GET /metrics` on its own port, never on the public one.

Why it exists: the gateway's series name backend pod URLs, deployments and namespaces, which callers of the public
API must not see, so they are served on a second port (`GatewaySettings.metrics_host`/`metrics_port`, the chart's
`metrics` container port that its ServiceMonitor/PodMonitor scrapes and its Service does not expose). It runs
uvicorn inside the public app's event loop (started and stopped by the app's lifespan), so the live gauges read the
app's state on the loop that changes it; the public server owns the process's signals. The socket is bound here, so
a port already in use fails start-up with a message saying which setting to change.

Imports: prometheus_client, uvicorn, starlette's ASGI types and `gateway.errors` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import error_body

log = logging.getLogger("llmfleet.gateway")
METRICS_PATH = "/metrics"


def metrics_app(registry: CollectorRegistry) -> ASGIApp:
    """An ASGI app answering `GET /metrics` with `registry`'s exposition and 404 to anything else."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == METRICS_PATH and scope["method"] in ("GET", "HEAD"):
            status, body, media = 200, generate_latest(registry), CONTENT_TYPE_LATEST
        else:
            message = f"{scope['method']} {scope['path']}: this port serves GET {METRICS_PATH} only"
            status, body, media = 404, error_body(404, message, "not_found"), "application/json"
        headers = [(b"content-type", media.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body if scope["method"] != "HEAD" else b""})

    return app


class _NoSignals(uvicorn.Server):
    """uvicorn without signal handlers: the public server owns SIGTERM/SIGINT and its shutdown stops this one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class MetricsServer:
    """`metrics_app(registry)` under uvicorn on (host, port) in the running event loop."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.host, self.requested_port = host, port
        self.port: int | None = None  # the bound port, once started
        self._app = metrics_app(registry)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind and serve; a RuntimeError names the setting to change when the address cannot be bound."""
        try:
            family, _type, _proto, _name, address = socket.getaddrinfo(
                self.host, self.requested_port, type=socket.SOCK_STREAM
            )[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                sock.listen(128)
            except OSError:
                sock.close()
                raise
        except OSError as e:
            raise RuntimeError(
                f"cannot serve {METRICS_PATH} on {self.host}:{self.requested_port}: {e.strerror or e}; choose a free "
                "port with --metrics-port (or the metrics_port setting; 0 picks one)"
            ) from None
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(self._app, lifespan="off", log_config=None, log_level="warning", access_log=False)
        self._server = _NoSignals(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway-metrics-server")
        log.info("serving %s on %s:%d (internal)", METRICS_PATH, self.host, self.port)

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout_s)
        except TimeoutError:
            log.warning("the metrics server did not stop within %.0f s", timeout_s)
        self._server = self._task = None
