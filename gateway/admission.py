"""Async bookkeeping for admission (priority queue under saturation) and the scale-to-zero hold.

`tiers.admission_decision` decides; `Admission` keeps the in-flight count and the waiters, and hands a freed
slot straight to the highest-priority waiter. `ZeroHold` counts the requests waiting for a variant that has no
ready pod (exported per (namespace, deployment, variant) so the autoscaler wakes it) and wakes them whenever the
routing table changes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.settings import GatewaySettings, TierSettings
from gateway.tiers import Admit, admission_decision


class Rejected(Exception):
    """The gateway refuses the request (503 with Retry-After); `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class Admission:
    """In-flight count with a priority queue of waiters for when it reaches `max_in_flight`."""

    settings: GatewaySettings
    in_flight: int = 0
    queued: int = 0
    _heap: list[tuple[int, int, asyncio.Future[None]]] = field(default_factory=list)
    _seq: itertools.count = field(default_factory=itertools.count)

    async def acquire(self, tier: TierSettings) -> None:
        """Take an in-flight slot, waiting (bounded) if saturated; raise Rejected when shed or timed out."""
        s = self.settings
        decision = admission_decision(tier, self.in_flight, s.max_in_flight, self.queued, s.admission_queue_size)
        if decision is Admit.ADMIT:
            self.in_flight += 1
            return
        if decision is Admit.SHED:
            raise Rejected("shed", f"the gateway is saturated; tier {tier.name!r} is shed first, retry later")
        if decision is Admit.QUEUE_FULL:
            raise Rejected("queue_full", "the gateway is saturated and its admission queue is full, retry later")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (-tier.priority, next(self._seq), fut))
        self.queued += 1
        try:
            await asyncio.wait_for(asyncio.shield(fut), s.admission_wait_seconds)
        except TimeoutError:
            if fut.done():
                return  # the slot was handed over just as the wait ran out
            fut.cancel()
            self.queued -= 1
            raise Rejected("queue_timeout", "the gateway is saturated; no slot freed in time, retry later") from None
        except asyncio.CancelledError:
            if fut.done():
                self.release()  # the slot was handed over as the client left: pass it on
            else:
                fut.cancel()
                self.queued -= 1
            raise

    def release(self) -> None:
        """Free a slot: hand it to the highest-priority live waiter, else decrement."""
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                self.queued -= 1
                fut.set_result(None)  # the slot moves to the waiter: in_flight unchanged
                return
        self.in_flight -= 1


HoldKey = tuple[str, str, str]  # (namespace, deployment, variant)


@dataclass
class ZeroHold:
    """Requests waiting for a variant with no ready pod, and the signal that the routing table changed."""

    settings: GatewaySettings
    counts: dict[HoldKey, int] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def table_changed(self) -> None:
        """Wake every held request to re-check readiness."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, key: HoldKey, ready: Callable[[], bool], now: Callable[[], float]) -> None:
        """Wait until `ready()` holds, at most zero_hold_seconds; raise Rejected when full or timed out."""
        s = self.settings
        if self.counts.get(key, 0) >= s.zero_hold_queue_size:
            raise Rejected("hold_full", f"variant {key[2]!r} of {key[1]!r} has no ready pod and its hold queue is full")
        self.counts[key] = self.counts.get(key, 0) + 1
        deadline = now() + s.zero_hold_seconds
        try:
            while not ready():
                remaining = deadline - now()
                if remaining <= 0:
                    raise Rejected(
                        "hold_timeout", f"variant {key[2]!r} of {key[1]!r} has no ready pod yet (scaling up), retry"
                    )
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    continue
        finally:
            left = self.counts[key] - 1
            if left:
                self.counts[key] = left
            else:
                del self.counts[key]
