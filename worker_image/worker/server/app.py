"""The worker's FastAPI app: `create_app(engine, settings)`.

`WorkerService` (service.py) is the per-app state (engine, settings, metrics, in-flight table, drainer, fault
injector, load state); the routes are thin. The engine loads in the background after start-up, so `/health`
answers while a large model loads and `/ready` turns 200 only when it can serve. `on_exit(code)` is how the app
asks its host (the CLI's uvicorn runner) to stop: 0 after a signal-triggered drain, 1 when the model failed to
load. A drain started by `POST /drain` ends with the worker up and idle (not ready, alive) until SIGTERM (see
drain.py).

Exposure: `POST /drain` and the LoRA adapter endpoints (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`)
need the drain token; `GET /drain` does not, because the pod's preStop hook polls it
without one, and it reveals nothing more than /metrics does (phase, a fixed reason string, in-flight count,
remaining-token estimate, seconds left). There are no API docs routes (`/docs`, `/redoc`, `/openapi.json`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.engine.protocol import EngineClient
from worker.metrics import CONTENT_TYPE
from worker.server import generation
from worker.server import openai_models as oai
from worker.server.body_limit import BodyLimit
from worker.server.errors import (
    ApiError,
    RequestIds,
    install_error_handlers,
    request_id_of,
    validation_error,
)
from worker.server.service import WorkerService
from worker.server.settings import WorkerSettings
from worker.server.streaming import DeferredJSONResponse, EventStreamResponse

log = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
BodyT = TypeVar("BodyT", bound=BaseModel)


class GenerationAccounting:
    """Counts generation requests and their HTTP error answers (whatever produced them: validation, admission,
    faults, the engine) for `llmfleet:requests_total` / `llmfleet:request_errors_total`."""

    def __init__(self, app: ASGIApp, service: WorkerService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        metrics = self.service.metrics
        metrics.request_received()

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                metrics.error(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            metrics.error(500)
            raise


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """The JSON body as `model`, whatever the Content-Type (curl -d sends form encoding); 400 when not JSON
    (including numbers past int's digit limit and nesting past the parser's recursion limit) or not valid."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise ApiError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(list(err.errors())) from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_value") from None


def create_app(
    engine: EngineClient,
    settings: WorkerSettings,
    *,
    on_exit: Callable[[int], None] = lambda code: None,
    clock: Callable[[], float] = time.monotonic,
    max_bytes_per_token: int | None = None,
    on_loaded: Callable[[], None] = lambda: None,
) -> FastAPI:
    """The worker app around `engine`. `on_exit(code)` is called when the worker wants its process to stop;
    `max_bytes_per_token` is the engine tokenizer's bound (see `admission.check_prompt_bytes`), None if unknown;
    `on_loaded()` runs once the model is loaded, before the worker reports ready."""
    service = WorkerService(engine, settings, on_exit, clock, max_bytes_per_token, on_loaded)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.startup()
        try:
            yield
        finally:
            await service.shutdown()

    # No /docs, /redoc, /openapi.json: whoever reaches a worker needs no map of it (the API is OpenAI's).
    app = FastAPI(
        title="llmfleet worker", version="1", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.service = service
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(GenerationAccounting, service=service)  # outside BodyLimit: counts its 413s
    app.add_middleware(RequestIds)  # outermost: every answer, even a crash's, gets the id

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        error = service.not_ready_error()
        if error is not None:
            return error.response()
        return JSONResponse({"status": "ready", "model": service.model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return oai.models_list(service.model_name, service.created, engine.max_model_len, service.adapters())

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request, authorization: str | None = Header(None)) -> Response:
        service.check_drain_token(authorization, "POST /v1/load_lora_adapter")
        body = await parse_body(request, oai.LoadLoraAdapterRequest)
        await service.load_adapter(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request, authorization: str | None = Header(None)) -> Response:
        service.check_drain_token(authorization, "POST /v1/unload_lora_adapter")
        body = await parse_body(request, oai.UnloadLoraAdapterRequest)
        await service.unload_adapter(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.get("/drain")
    async def drain_state() -> dict[str, Any]:
        return service.drain_status()

    @app.post("/drain", status_code=202)
    async def drain(authorization: str | None = Header(None)) -> dict[str, Any]:
        service.check_drain_token(authorization)
        service.begin_drain("POST /drain")
        return service.drain_status()

    def respond(prep: generation.Prepared) -> Response:
        if prep.stream:
            return EventStreamResponse(generation.stream(service, prep))
        return DeferredJSONResponse(lambda: generation.complete(service, prep))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, oai.CompletionRequest)
        return respond(
            await generation.prepare(
                service,
                body,
                "completion",
                request.headers.get(generation.TIMEOUT_HEADER),
                request_id_of(request.scope),
            )
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, oai.ChatCompletionRequest)
        return respond(
            await generation.prepare(
                service, body, "chat", request.headers.get(generation.TIMEOUT_HEADER), request_id_of(request.scope)
            )
        )

    return app
