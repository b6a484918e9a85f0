"""The requests this server is serving right now: count, remaining-tokens estimate, and a way to abort each.

Drain waits on it, `/metrics` and `GET /drain` read it, admission uses its size. One table per app (no globals).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(eq=False)
class InflightRequest:
    request_id: str
    max_tokens: int
    generated: int = 0
    abort_reason: str | None = None  # set when the server aborts it (deadline, drain timeout)
    timeout: asyncio.Timeout | None = field(default=None, repr=False)  # the scope of the current engine wait

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_tokens - self.generated)

    def abort(self, reason: str) -> None:
        """Ask the request's own task to stop now with `reason` (it aborts the engine request itself)."""
        if self.abort_reason is None:
            self.abort_reason = reason
        if self.timeout is not None and not self.timeout.expired():
            self.timeout.reschedule(asyncio.get_running_loop().time())


class InflightTable:
    def __init__(self) -> None:
        self._requests: dict[str, InflightRequest] = {}
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, max_tokens: int) -> InflightRequest:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        entry = InflightRequest(request_id, max_tokens)
        self._requests[request_id] = entry
        self._notify()
        return entry

    def remove(self, entry: InflightRequest) -> None:
        if self._requests.get(entry.request_id) is entry:
            del self._requests[entry.request_id]
            self._notify()

    def remaining_tokens(self) -> int:
        return sum(r.remaining_tokens for r in self._requests.values())

    def abort_all(self, reason: str) -> int:
        entries = list(self._requests.values())
        for entry in entries:
            entry.abort(reason)
        return len(entries)

    async def wait_change(self, timeout: float) -> None:
        """Return when a request was added or removed, or after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
