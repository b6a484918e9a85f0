"""`WorkerService`: the per-app state of one worker and every decision the routes delegate to it.

It holds the engine, settings, metrics, in-flight table, drainer, fault injector and load state. The app
(`app.py`) builds one per `create_app` and its routes translate HTTP to calls on it; the generation path
(`generation.py`) and the uvicorn host (`serve.py`) take it as an argument. It lives in its own module so that
those three import it without importing each other.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

from worker.engine.protocol import EngineClient
from worker.metrics import ServerGauges, WorkerMetrics
from worker.server.drain import Drainer, Phase
from worker.server.errors import ApiError
from worker.server.faults import FaultInjector
from worker.server.inflight import InflightTable
from worker.server.settings import WorkerSettings
from worker.server.tokenizing import TokenizerPool

log = logging.getLogger(__name__)


class WorkerService:
    """Everything one worker app knows and decides with; the routes only translate HTTP to calls on it."""

    def __init__(
        self,
        engine: EngineClient,
        settings: WorkerSettings,
        on_exit: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        max_bytes_per_token: int | None = None,
    ) -> None:
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

    def check_drain_token(self, authorization: str | None) -> None:
        token = self.settings.drain_token
        if token is None:
            raise ApiError(
                403,
                "POST /drain is disabled: no drain token is configured (set LLMFLEET_DRAIN_TOKEN or "
                "--drain-token-file); SIGTERM still drains",
                code="drain_disabled",
            )
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.get_secret_value().encode()
        ):
            raise ApiError(
                401, "POST /drain needs the header 'Authorization: Bearer <drain token>'", code="invalid_drain_token"
            )
