"""Engine errors become the right answers: a full engine queue is a 429 to retry, a dead engine is a 503 and the
worker stops being ready and exits non-zero so the kubelet restarts it (never a ready worker with a dead engine)."""

from __future__ import annotations

from typing import Any

import httpx
from worker.engine.protocol import EngineDeadError, QueueFullError
from worker.server.fake_engine import FakeEngine


class _Refusing(FakeEngine):
    """A fake engine whose generate() fails before the first output with a given error."""

    def __init__(self, error: Exception, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._error = error

    async def generate(self, prompt, params, request_id, priority=0):  # type: ignore[override]
        raise self._error
        yield  # pragma: no cover - makes this an async generator


def _complete(live: Any) -> Any:
    with live.http() as client:
        return client.post("/v1/completions", json={"model": live.service.model_name, "prompt": "hi", "max_tokens": 2})


def test_engine_queue_full_is_429_with_retry_after(start_worker) -> None:
    live = start_worker(_Refusing(QueueFullError("3 requests are already waiting")))
    answer = _complete(live)
    assert answer.status_code == 429
    assert answer.headers["Retry-After"] == "1"
    assert answer.json()["error"]["code"] == "queue_full"
    assert live.http().get("/ready").status_code == 200


def test_dead_engine_is_503_then_not_ready_and_exit_code_1(start_worker) -> None:
    live = start_worker(_Refusing(EngineDeadError("the engine failed: IndexError()")))
    answer = _complete(live)
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "engine_dead"
    assert live.worker.exit_code == 1
    try:  # it may already have exited; while it has not, it must not claim to be ready
        status = live.http().get("/ready").status_code
    except httpx.TransportError:
        status = None
    assert status in (503, None)
