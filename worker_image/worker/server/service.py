"""`WorkerService`: the per-app state of one worker and every decision the routes delegate to it.

It holds the engine, settings, metrics, in-flight table, drainer, fault injector and load state. The app
(`app.py`) builds one per `create_app` and its routes translate HTTP to calls on it; the generation path
(`generation.py`) and the uvicorn host (`serve.py`) take it as an argument. It lives in its own module so that
those three import it without importing each other.

LoRA adapters (`--enable-lora`, either engine): a request's `model` is the base model's name, `BASE:ADAPTER`, or
an adapter's own name (as vLLM serves them; `resolve_model`); anything else is a 404 `model_not_found`, decided
here before the engine sees the request. `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` take the
same bearer token as `POST /drain` (one control-plane secret, one check); adapters given with `--lora-modules`
are loaded once the model is, and one that fails is logged and left out while the base serves.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from worker.engine.protocol import EngineClient, LoraEngineClient
from worker.metrics import ServerGauges, WorkerMetrics
from worker.server.drain import Drainer, Phase
from worker.server.errors import ApiError
from worker.server.faults import FaultInjector
from worker.server.inflight import InflightTable
from worker.server.settings import WorkerSettings
from worker.server.tokenizing import TokenizerPool

log = logging.getLogger(__name__)


def local_adapter_folder(source: str) -> str:
    """An adapter source (folder, file://, hf://) as a local folder; ValueError (ModelSourceError) if it cannot be."""
    from worker.model.source import resolve_adapter_source

    return str(resolve_adapter_source(source))


def resolve_model(requested: str | None, base: str, adapters: Collection[str]) -> str | None:
    """The adapter a request's `model` selects (None: the base model); ApiError 404 `model_not_found` if none.

    `None` or the base name select the base; `BASE:ADAPTER` and an adapter's own name select that adapter."""
    if requested is None or requested == base:
        return None
    if requested in adapters:
        return requested
    prefix, sep, adapter = requested.partition(":")
    if sep and prefix == base and adapter in adapters:
        return adapter
    served = ", ".join(f"`{name}`" for name in [base, *sorted(adapters)])
    raise ApiError(
        404,
        f"The model `{requested}` does not exist on this worker; it serves {served}.",
        param="model",
        code="model_not_found",
    )


class WorkerService:
    """Everything one worker app knows and decides with; the routes only translate HTTP to calls on it."""

    def __init__(
        self,
        engine: EngineClient,
        settings: WorkerSettings,
        on_exit: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        max_bytes_per_token: int | None = None,
        on_loaded: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self._on_loaded = on_loaded  # runs once, after the model and boot adapters load and before /ready says so
        # The most prompt bytes one token stands for (None: unknown): over-long prompts are refused untokenized.
        self.max_bytes_per_token = max_bytes_per_token
        self.tokenizer_pool = TokenizerPool(settings.tokenizer_threads, settings.max_waiting, settings.retry_after_s)
        self.clock = clock
        self.model_name = settings.served_model_name or engine.model_name
        self.created = int(time.time())
        self.inflight = InflightTable()
        self.faults = FaultInjector(settings.faults)
        # A backend that exports vLLM's metrics itself offers them as `prometheus_registry` (see WorkerMetrics).
        self.metrics = WorkerMetrics(
            self.model_name, engine.stats, self._gauges, getattr(engine, "prometheus_registry", None)
        )
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
        self.inflight.abort_all(
            f"the worker drained and its drain timeout ({self.settings.drain_timeout_s:g} s) "
            "passed; retry on another worker"
        )

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
        await self._load_boot_adapters()
        self._on_loaded()
        self.loaded = True
        log.info("model %s loaded (max_model_len %d); ready", self.model_name, self.engine.max_model_len)

    async def _load_boot_adapters(self) -> None:
        engine = self.lora_engine()
        for name, path in self.settings.lora_modules.items():
            if engine is None:
                log.error("LoRA adapter %s not loaded: this engine serves no adapters", name)
                continue
            try:
                await engine.load_lora(name, await asyncio.to_thread(local_adapter_folder, path))
            except ValueError as err:
                log.error("LoRA adapter %s (%s) not loaded, the base model serves without it: %s", name, path, err)
            else:
                log.info("LoRA adapter %s loaded from %s", name, path)

    # ---- LoRA adapters ----
    def lora_engine(self) -> LoraEngineClient | None:
        """The engine as an adapter-serving one, or None when it serves no adapters."""
        engine = self.engine
        if isinstance(engine, LoraEngineClient) and engine.lora_enabled:
            return engine
        return None

    def adapters(self) -> dict[str, str]:
        engine = self.lora_engine()
        return engine.lora_adapters() if engine is not None else {}

    def resolve_model(self, requested: str | None) -> str | None:
        """The adapter a request's `model` selects (None: the base model); ApiError 404 when it names nothing."""
        return resolve_model(requested, self.model_name, self.adapters())

    def _require_lora_engine(self) -> LoraEngineClient:
        engine = self.lora_engine()
        if engine is None:
            raise ApiError(
                400,
                "this worker serves no LoRA adapters: start it with --enable-lora",
                code="lora_disabled",
            )
        if not self.loaded:
            raise ApiError(503, "the model is still loading", code="loading", retry_after_s=self.settings.retry_after_s)
        return engine

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve a PEFT adapter folder as `name`; ApiError 400 with the reason when it cannot be served."""
        engine = self._require_lora_engine()
        if name == self.model_name:
            raise ApiError(
                400, f"{name!r} is the base model's name: give the adapter another name", code="invalid_value"
            )
        try:
            await engine.load_lora(name, await asyncio.to_thread(local_adapter_folder, path))
        except ValueError as err:
            raise ApiError(400, f"cannot load LoRA adapter {name!r}: {err}", code="invalid_lora_adapter") from err
        log.info("LoRA adapter %s loaded from %s", name, path)

    async def unload_adapter(self, name: str) -> None:
        engine = self._require_lora_engine()
        try:
            await engine.unload_lora(name)
        except KeyError:
            raise ApiError(
                404, f"no LoRA adapter named {name!r} is loaded", param="lora_name", code="model_not_found"
            ) from None
        log.info("LoRA adapter %s unloaded", name)

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
            return ApiError(
                503,
                f"the worker {what} and takes no new requests; retry on another worker",
                code="draining",
                retry_after_s=retry,
            )
        if self.load_error is not None:  # the reason is in the log, not in an answer to whoever asks
            return ApiError(
                503, "the model failed to load or the engine failed; the worker is exiting", code="load_failed"
            )
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

    def check_drain_token(self, authorization: str | None, what: str = "POST /drain") -> None:
        """The control-plane check (`POST /drain`, adapter load/unload): the drain token as a bearer token."""
        token = self.settings.drain_token
        if token is None:
            raise ApiError(
                403,
                f"{what} is disabled: no drain token is configured (set LLMFLEET_DRAIN_TOKEN or "
                "--drain-token-file)" + ("; SIGTERM still drains" if what == "POST /drain" else ""),
                code="drain_disabled",
            )
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.get_secret_value().encode()
        ):
            raise ApiError(
                401, f"{what} needs the header 'Authorization: Bearer <drain token>'", code="invalid_drain_token"
            )
