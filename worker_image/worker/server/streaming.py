"""Responses that notice a client disconnect at once, whatever the ASGI server's spec version.

Starlette's `StreamingResponse` only watches for `http.disconnect` under ASGI < 2.4; otherwise it learns of a
disconnect at its next write, which for a request still waiting for its first token may be many seconds later.
Here the work (generation plus writing) runs in the request's task while a watcher awaits `http.disconnect` and
cancels that task the moment the client goes away; the body generator's own cleanup then aborts the engine
request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


async def run_until_disconnect(
    receive: Receive, work: Callable[[], Awaitable[None]], finishing: Callable[[], bool]
) -> bool:
    """Run `work` in this task; cancel it if the client disconnects first. True when it did.

    `finishing()` tells the watcher the response is complete (a server reports `http.disconnect` once it is),
    so a normal end is never mistaken for a client leaving.
    """
    task = asyncio.current_task()
    assert task is not None
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except OSError:
            pass
        if not finishing():
            disconnected = True
            task.cancel()

    watcher = asyncio.create_task(watch(), name="disconnect-watch")
    try:
        await work()
    except asyncio.CancelledError:
        if not disconnected:
            raise
        task.uncancel()
    finally:
        watcher.cancel()
    return disconnected


class EventStreamResponse(Response):
    """`text/event-stream` from an async iterator of ready-made SSE bytes. On disconnect the iterator is closed
    (its `finally` runs) before this returns."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background: BackgroundTask | None = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        done = False

        async def work() -> None:
            nonlocal done
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                done = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]

        await run_until_disconnect(receive, work, lambda: done)


class DeferredJSONResponse(Response):
    """A JSON answer computed inside the response, so the client going away cancels the computation.

    `produce()` returns (status, body, headers).
    """

    media_type = "application/json"

    def __init__(self, produce: Callable[[], Awaitable[tuple[int, dict[str, Any], dict[str, str]]]]) -> None:
        self._produce = produce
        self.status_code = 200
        self.background = None
        self.init_headers({})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        done = False

        async def work() -> None:
            nonlocal done
            status, body, headers = await self._produce()
            done = True
            content = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            response = Response(content, status_code=status, headers=headers, media_type=self.media_type)
            await response(scope, receive, send)

        await run_until_disconnect(receive, work, lambda: done)
