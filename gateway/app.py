"""The gateway's ASGI app factory: proxy routes, model list, health, metrics and the scale-from-zero queue view.

`create_app` wires one `GatewayState` (no module-level state) to a discovery source; the app's lifespan opens
the pooled upstream client, starts discovery (which publishes a first routing table before the app serves), and
closes both on shutdown.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import KeyStore
from gateway.errors import error_body
from gateway.proxy import ProxyEndpoint
from gateway.settings import GatewaySettings
from gateway.sources import Source
from gateway.state import GatewayState, make_client

log = logging.getLogger("llmfleet.gateway")

OPEN_MODE_WARNING = (
    "NO API KEYS CONFIGURED: the gateway runs in OPEN MODE and accepts every request without authentication "
    "(all callers share one rate-limit identity at the default tier). Pass --api-keys-file or --api-keys-secret."
)


def create_app(
    settings: GatewaySettings, source: Source, keys: KeyStore, rng: random.Random | None = None
) -> FastAPI:
    """A gateway app routing with `source`'s tables and authenticating with `keys`."""
    state = GatewayState(
        settings=settings, keys=keys, rng=rng if rng is not None else random.Random(settings.seed)
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.keys.open_mode:
            log.warning(OPEN_MODE_WARNING)
        state.client, state.transport = make_client(settings)
        try:
            await source.start(state)
            yield
        finally:
            await source.stop()
            await state.client.aclose()
            state.client = state.transport = None

    app = FastAPI(title="llmfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = state

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

    app.add_route("/v1/chat/completions", ProxyEndpoint(state, "/v1/chat/completions"))
    app.add_route("/v1/completions", ProxyEndpoint(state, "/v1/completions"))

    def unauthorized(request: Request) -> Response | None:
        """A 401 unless the request carries a valid API key (every request passes in open mode)."""
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
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "llmfleet"}
            for name in state.table.model_names()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        if not state.ready:
            return JSONResponse({"status": "discovering"}, status_code=503)
        return JSONResponse({"status": "ready", "backends": len(state.table.endpoints())})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

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

    return app
