"""The worker's FastAPI app: `create_app(engine, settings)`.

`WorkerService` is the per-app state (engine, settings, metrics, in-flight table, drainer, fault injector, load
state); the routes are thin. The engine loads in the background after start-up, so `/health` answers while a
large model loads and `/ready` turns 200 only when it can serve. `on_exit(code)` is how the app asks its host
(the CLI's uvicorn runner) to stop: 0 after a signal-triggered drain, 1 when the model failed to load. A drain
started by `POST /drain` ends with the worker up and idle (not ready, alive) until SIGTERM (see drain.py).

Exposure: `POST /drain` needs the drain token; `GET /drain` does not, because the pod's preStop hook polls it
without one, and it reveals nothing more than /metrics does (phase, a fixed reason string, in-flight count,
remaining-token estimate, seconds left). There are no API docs routes (`/docs`, `/redoc`, `/openapi.json`).
"""

from __future__ import annotations

import asyncio
import hmac
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
from worker.metrics import CONTENT_TYPE, ServerGauges, WorkerMetrics
from worker.server import generation
from worker.server import openai_models as oai
from worker.server.body_limit import BodyLimit
from worker.server.drain import Drainer, Phase
from worker.server.errors import (
    ApiError,
    RequestIds,
    install_error_handlers,
    request_id_of,
    validation_error,
)
from worker.server.faults import FaultInjector
from worker.server.inflight import InflightTable
from worker.server.settings import WorkerSettings
from worker.server.streaming import DeferredJSONResponse, EventStreamResponse
from worker.server.tokenizing import TokenizerPool

log = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
BodyT = TypeVar("BodyT", bound=BaseModel)


class WorkerService:
    """Everything one worker app knows and decides with; the routes only translate HTTP to calls on it."""

    def __init__(self, engine: EngineClient, settings: WorkerSettings, on_exit: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic, max_bytes_per_token: int | None = None) -> None:
        self.engine = engine
        self.settings = settings
        # The most prompt bytes one token stands for (None: unknown): over-long prompts are refused untokenized.
        self.max_bytes_per_token = max_bytes_per_token
        self.tokenizer_pool = TokenizerPool(settings.tokenizer_threads, settings.max_waiting, settings.retry_after_s)
        self.clock = clock
        self.model_name = settings.served_model_name or engine.model_name
        self.created = int(time.time())
        self.inflight = InflightTable()
        self.faults = FaultInjector(settings.faults)
        # A backend that exports vLLM's metrics itself offers them as `prometheus_registry` (see WorkerMetrics).
        self.metrics = WorkerMetrics(self.model_name, engine.stats, self._gauges,
                                     getattr(engine, "prometheus_registry", None))
        self.loaded = False
        self.load_error: str | None = None
        self._on_exit = on_exit
        self._load_task: asyncio.Task[None] | None = None
        self.drainer = Drainer(
            timeout_s=settings.drain_timeout_s,
            clock=clock,
            inflight=lambda: len(self.inflight),
            wait_change=self.inflight.wait_change,
            abort_all=self._abort_all,
            on_exit=lambda: on_exit(0),
        )

    def _gauges(self) -> ServerGauges:
        return ServerGauges(self.drainer.state.draining, len(self.inflight), self.inflight.remaining_tokens())

    async def _abort_all(self) -> None:
        self.inflight.abort_all(f"the worker drained and its drain timeout ({self.settings.drain_timeout_s:g} s) "
                                "passed; retry on another worker")

    # ---- lifecycle ----
    async def startup(self) -> None:
        if self.settings.faults.enabled:
            log.warning("FAULT INJECTION ON: %s", self.settings.faults)
        self._load_task = asyncio.get_running_loop().create_task(self._load(), name="engine-load")

    async def _load(self) -> None:
        try:
            await self.engine.start()
        except Exception as err:
            log.exception("the engine failed to start")
            self.load_error = f"{type(err).__name__}: {err}"
            self._on_exit(1)
            return
        self.loaded = True
        log.info("model %s loaded (max_model_len %d); ready", self.model_name, self.engine.max_model_len)

    def engine_died(self, err: Exception) -> None:
        """The engine failed for good: stop being ready and exit non-zero so the kubelet restarts the pod."""
        if self.load_error is None:
            log.error("the engine died: %s; exiting", err)
            self.load_error = f"engine died: {err}"
            self._on_exit(1)

    async def shutdown(self) -> None:
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        self.drainer.cancel()
        self.inflight.abort_all("the worker is shutting down")
        self.tokenizer_pool.shutdown()
        await self.engine.shutdown()

    def begin_drain(self, reason: str) -> None:
        self.drainer.begin(reason)

    def on_signal(self, name: str) -> None:
        """SIGTERM/SIGINT: drain, then exit (at once when already drained); a later one shortens the drain to now."""
        self.drainer.signal(name)

    # ---- state for routes ----
    def not_ready_error(self) -> ApiError | None:
        retry = self.settings.retry_after_s
        if self.drainer.state.draining:
            what = "has drained" if self.drainer.state.phase is Phase.DRAINED else "is draining (lame duck)"
            return ApiError(503, f"the worker {what} and takes no new requests; retry on another worker",
                            code="draining", retry_after_s=retry)
        if self.load_error is not None:  # the reason is in the log, not in an answer to whoever asks
            return ApiError(503, "the model failed to load or the engine failed; the worker is exiting",
                            code="load_failed")
        if not self.loaded:
            return ApiError(503, "the model is still loading", code="loading", retry_after_s=retry)
        return None

    def check_accepting(self) -> None:
        error = self.not_ready_error()
        if error is not None:
            raise error

    def drain_status(self) -> dict[str, Any]:
        state = self.drainer.state
        return {
            "state": state.phase.value,
            "draining": state.draining,
            "reason": state.reason,
            "inflight": len(self.inflight),
            "remaining_tokens_estimate": self.inflight.remaining_tokens(),
            "seconds_left": self.drainer.seconds_left(),
            "timed_out": state.timed_out,
        }

    def check_drain_token(self, authorization: str | None) -> None:
        token = self.settings.drain_token
        if token is None:
            raise ApiError(403, "POST /drain is disabled: no drain token is configured (set LLMFLEET_DRAIN_TOKEN or "
                           "--drain-token-file); SIGTERM still drains", code="drain_disabled")
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 token.get_secret_value().encode()):
            raise ApiError(401, "POST /drain needs the header 'Authorization: Bearer <drain token>'",
                           code="invalid_drain_token")


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


def create_app(engine: EngineClient, settings: WorkerSettings, *,
               on_exit: Callable[[int], None] = lambda code: None,
               clock: Callable[[], float] = time.monotonic, max_bytes_per_token: int | None = None) -> FastAPI:
    """The worker app around `engine`. `on_exit(code)` is called when the worker wants its process to stop;
    `max_bytes_per_token` is the engine tokenizer's bound (see `admission.check_prompt_bytes`), None if unknown."""
    service = WorkerService(engine, settings, on_exit, clock, max_bytes_per_token)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.startup()
        try:
            yield
        finally:
            await service.shutdown()

    # No /docs, /redoc, /openapi.json: whoever reaches a worker needs no map of it (the API is OpenAI's).
    app = FastAPI(title="llmfleet worker", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
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
        return oai.models_list(service.model_name, service.created, engine.max_model_len)

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
        return respond(await generation.prepare(service, body, "completion",
                                                request.headers.get(generation.TIMEOUT_HEADER),
                                                request_id_of(request.scope)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, oai.ChatCompletionRequest)
        return respond(await generation.prepare(service, body, "chat", request.headers.get(generation.TIMEOUT_HEADER),
                                                request_id_of(request.scope)))

    return app

