"""Run the worker app under uvicorn, programmatically, with our own SIGTERM/SIGINT handling.

uvicorn's own handler would start its shutdown at once (closing idle connections, waiting a bounded time for the
rest) and re-raise the signal at the end, so the process would die by SIGTERM instead of exiting 0. Here a signal
starts the lame-duck drain instead: the listener stays open (new requests get 503 so routers retry elsewhere),
in-flight streams complete, and only when the drain is done does uvicorn shut down and the process exit 0
(at once when a `POST /drain` had already drained it).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn

from worker.engine.protocol import EngineClient
from worker.heap import freeze_startup_heap
from worker.server.app import create_app
from worker.server.service import WorkerService
from worker.server.settings import WorkerSettings

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: WorkerService) -> None:
        super().__init__(config)
        self._service = service

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._service.on_signal, sig.name)
        try:
            yield
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)


class WorkerServer:
    """The app plus its uvicorn server. `run()` blocks and returns the exit code (0 after a drain).
    `freeze_heap_after_load`: `worker.heap.freeze_startup_heap` once the model is loaded (the CLI's worker
    process; off for workers that share a process, such as tests')."""

    def __init__(
        self,
        engine: EngineClient,
        settings: WorkerSettings,
        *,
        configure_logging: bool = True,
        log_level: str = "info",
        graceful_shutdown_s: int = 5,
        max_bytes_per_token: int | None = None,
        freeze_heap_after_load: bool = False,
    ) -> None:
        self.exit_code = 0
        self.app = create_app(
            engine,
            settings,
            on_exit=self._on_exit,
            max_bytes_per_token=max_bytes_per_token,
            on_loaded=freeze_startup_heap if freeze_heap_after_load else lambda: None,
        )
        self.service: WorkerService = self.app.state.service
        config = uvicorn.Config(
            self.app,
            host=settings.host,
            port=settings.port,
            lifespan="on",
            log_config=uvicorn.config.LOGGING_CONFIG if configure_logging else None,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=graceful_shutdown_s,
        )
        self.server = _DrainingServer(config, self.service)

    def _on_exit(self, code: int) -> None:
        self.exit_code = code
        self.server.should_exit = True

    @property
    def port(self) -> int:
        """The bound port (after start-up; useful with port 0)."""
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def serve(self) -> int:
        await self.server.serve()
        return self.exit_code

    def run(self) -> int:
        return asyncio.run(self.serve())
