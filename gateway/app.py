"""The gateway's ASGI app factory: proxy routes, model list (models, variants and LoRA adapters), health and the
scale-from-zero queue view.

`create_app` wires one `GatewayState` (no module-level state) to a discovery source; the app's lifespan opens
the pooled upstream client, starts the internal metrics server (`gateway.metrics_server`: `/metrics` is never on
this public app), starts discovery (which publishes a first routing table before the app serves), and stops all
three on shutdown. `gateway.middleware` wraps every route: request ids, the fail-closed API-key gate (503 while
no key is loaded) and generic 500s; the proxy's routes are served in front of the FastAPI app (`DirectRoutes`),
the rest inside it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from gateway.auth import KeyStore
from gateway.errors import error_body
from gateway.metrics_server import MetricsServer
from gateway.middleware import DirectEndpoint, DirectRoutes, GatewayMiddleware
from gateway.proxy import ProxyEndpoint
from gateway.settings import GatewaySettings
from gateway.sources import Source
from gateway.state import GatewayState, make_client

log = logging.getLogger("llmfleet.gateway")

PROXY_PATHS = ("/v1/chat/completions", "/v1/completions")  # served by `ProxyEndpoint`, outside the FastAPI app

OPEN_MODE_WARNING = (
    "INSECURE OPEN MODE (--insecure-open-mode): the gateway accepts every request without authentication "
    "(all callers share one rate-limit identity at the default tier). Use --api-keys-file or --api-keys-secret "
    "anywhere but a development machine."
)


def create_app(
    settings: GatewaySettings, source: Source, keys: KeyStore, rng: random.Random | None = None
) -> GatewayApp:
    """A gateway app routing with `source`'s tables and authenticating with `keys`."""
    state = GatewayState(settings=settings, keys=keys, rng=rng if rng is not None else random.Random(settings.seed))

    metrics_server = (
        MetricsServer(state.metrics.registry, settings.metrics_host, settings.metrics_port)
        if settings.metrics_port is not None
        else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.keys.open_mode:
            log.warning(OPEN_MODE_WARNING)
        state.client, state.transport = make_client(settings)
        try:
            if metrics_server is not None:
                await metrics_server.start()
            await source.start(state)
            yield
        finally:
            await source.stop()
            if metrics_server is not None:
                await metrics_server.stop()
            await state.client.aclose()
            state.client = state.transport = None

    app = FastAPI(title="llmfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GatewayMiddleware, state=state)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown paths and methods answer in OpenAI's error shape too."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return Response(
            error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code),
            status_code=exc.status_code,
            media_type="application/json",
            headers=exc.headers,
        )

    def unauthorized(request: Request) -> Response | None:
        """A 401 unless the request carries a valid API key (every request passes in explicit open mode; while no
        key is loaded, `GatewayMiddleware` answers 503 before this runs)."""
        if state.keys.authenticate(request.headers.get("authorization")) is not None:
            return None
        return Response(
            error_body(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.", "invalid_api_key"),
            status_code=401,
            media_type="application/json",
        )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if (refused := unauthorized(request)) is not None:
            return refused
        """Every served model (and `MODEL:VARIANT` where it has several), then each LoRA adapter as vLLM lists
        one: `root` its source, `parent` the base model (`RoutingTable.adapter_entries` for its id)."""
        created = int(time.time())
        table = state.table
        data: list[dict[str, object]] = [
            {"id": name, "object": "model", "created": created, "owned_by": "llmfleet"} for name in table.model_names()
        ]
        data += [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "llmfleet",
                "root": adapter.source,
                "parent": dep.model,
            }
            for name, dep, adapter in table.adapter_entries()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        """503 until discovery has routed a first table, and while no API key is loaded (a gateway that refuses
        every request must not receive traffic); `/health` (liveness) stays 200 meanwhile."""
        if not state.ready:
            return JSONResponse({"status": "discovering"}, status_code=503)
        if (reason := state.keys.unavailable) is not None:
            return JSONResponse({"status": "no API keys", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "backends": len(state.table.endpoints())})

    @app.get("/internal/queued", response_model=None)
    async def queued(request: Request) -> dict[str, object] | Response:
        """Requests held per (namespace, deployment, variant) with no ready pod: demand for scale-from-zero. It names
        deployments, so it takes an API key like the API does (the operator sends one: LLMFLEET_OPERATOR_GATEWAY_API_KEY)."""
        if (refused := unauthorized(request)) is not None:
            return refused
        rows = [
            {"namespace": ns, "deployment": dep, "variant": variant, "queued": n}
            for (ns, dep, variant), n in sorted(state.hold.counts.items())
        ]
        return {"queued": rows}

    proxies: dict[str, DirectEndpoint] = {path: ProxyEndpoint(state, path) for path in PROXY_PATHS}
    return GatewayApp(DirectRoutes(app, state, proxies), app, state, metrics_server)


class GatewayApp:
    """The ASGI app a server runs: the proxy's direct routes in front of the FastAPI app (`api`, which owns the
    lifespan and every other route); `gateway` is its live state."""

    def __init__(
        self, front: DirectRoutes, api: FastAPI, gateway: GatewayState, metrics_server: MetricsServer | None
    ) -> None:
        self.front = front
        self.api = api
        self.gateway = gateway
        self.metrics_server = metrics_server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front(scope, receive, send)
