"""Tokenization and chat-template rendering off the event loop, a few at a time.

Why it exists: tokenizing a large prompt on the event loop froze every other stream and `/health` (a 16 MB
prompt: 15.7 s). Here that work runs on a small pool of threads of its own (so it never competes with other
`to_thread` users), at most `threads` at once; a request beyond that waits for a slot, and when `max_waiting`
requests already wait it gets a 429 with `Retry-After`. The tokenizer must release the GIL while it works (the
builtin engine's does, see worker.model.tokenizer) for the loop to keep running. Imports only the server's errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from worker.server.errors import ApiError

T = TypeVar("T")


class TokenizerPool:
    """`await pool.run(fn, *args)`: `fn(*args)` on one of `threads` threads, with bounded waiting."""

    def __init__(self, threads: int, max_waiting: int, retry_after_s: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self._slots = asyncio.Semaphore(threads)
        self._max_waiting = max_waiting
        self._retry_after_s = retry_after_s
        self.waiting = 0
        self.running = 0

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self._slots.locked() and self.waiting >= self._max_waiting:
            raise ApiError(
                429,
                f"the worker is tokenizing {self.running} prompts and {self.waiting} more wait; retry "
                "later or on another worker",
                code="tokenizer_busy",
                retry_after_s=self._retry_after_s,
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.running -= 1
            self._slots.release()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
