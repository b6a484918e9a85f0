"""Lame-duck drain: stop taking work, finish what is in flight, then exit when the pod is going away.

Two ways in, one drain: `POST /drain` (the operator, or the preStop hook) drains and then stays up, idle, not
ready and alive, because the pod is about to be deleted and a process that exited would be restarted by the
kubelet (`restartPolicy: Always`: a full model load in a doomed pod). A signal (SIGTERM from the kubelet deleting
the pod, or SIGINT) drains if not yet draining, and the process exits once drained (at once when a `POST /drain`
already finished); a second signal moves the deadline to now (abort what is left, then exit).

The state machine is pure (`begin`, `request_exit`, `decide`, `should_exit`: state, in-flight count and time in,
decision out) and table-tested; `Drainer` is the thin async shell that waits for in-flight requests to end,
aborts what is left at the deadline and calls the exit callback when a signal asked for it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)


class Phase(enum.StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"  # nothing left in flight (or the rest aborted): idle until a signal, then exit


@dataclass(frozen=True)
class DrainState:
    phase: Phase = Phase.SERVING
    reason: str | None = None  # "POST /drain", "SIGTERM", ...
    started_at: float | None = None
    deadline: float | None = None
    timed_out: bool = False
    exit_requested: bool = False  # a signal came: exit once drained

    @property
    def draining(self) -> bool:
        return self.phase is not Phase.SERVING


class Decision(enum.Enum):
    WAIT = "wait"  # requests still in flight, time left
    ABORT_REST = "abort_rest"  # deadline passed: abort what is left
    DONE = "done"  # idle: drained


def begin(state: DrainState, reason: str, now: float, timeout_s: float) -> DrainState:
    """Enter drain mode. Idempotent: a second request keeps the first deadline and reason."""
    if state.draining:
        return state
    return DrainState(Phase.DRAINING, reason, now, now + timeout_s)


def hasten(state: DrainState, now: float) -> DrainState:
    """Move the deadline to now (abort what is left, then finish)."""
    if state.phase is not Phase.DRAINING or state.deadline is None or state.deadline <= now:
        return state
    return replace(state, deadline=now)


def request_exit(state: DrainState, reason: str, now: float, timeout_s: float) -> DrainState:
    """A SIGTERM/SIGINT: the first drains (keeping a drain already under way as it is) and asks for an exit once
    drained; a later one hastens the drain."""
    if state.exit_requested:
        return hasten(state, now)
    return replace(begin(state, reason, now, timeout_s), exit_requested=True)


def should_exit(state: DrainState) -> bool:
    """Drained and a signal asked for the exit (a `POST /drain` alone leaves the process up, idle)."""
    return state.phase is Phase.DRAINED and state.exit_requested


def decide(state: DrainState, inflight: int, now: float) -> Decision:
    if state.phase is Phase.SERVING:
        return Decision.WAIT
    if inflight == 0 or state.phase is Phase.DRAINED:
        return Decision.DONE
    if state.deadline is not None and now >= state.deadline:
        return Decision.ABORT_REST
    return Decision.WAIT


def finish(state: DrainState, timed_out: bool) -> DrainState:
    return replace(state, phase=Phase.DRAINED, timed_out=timed_out)


class Drainer:
    """Runs one drain: wait until idle or the deadline, abort the rest; call `on_exit` once drained if a signal
    asked for it (`signal`), whenever that signal comes.

    `inflight` returns the in-flight count, `wait_change(timeout)` returns when that count may have changed or the
    timeout passed, `abort_all()` aborts every in-flight request (they then end quickly with finish reason abort).
    """

    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float],
        inflight: Callable[[], int],
        wait_change: Callable[[float], Awaitable[None]],
        abort_all: Callable[[], Awaitable[None]],
        on_exit: Callable[[], None],
        abort_grace_s: float = 5.0,
    ) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._inflight = inflight
        self._wait_change = wait_change
        self._abort_all = abort_all
        self._on_exit = on_exit
        self._abort_grace_s = abort_grace_s
        self.state = DrainState()
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None

    def begin(self, reason: str) -> DrainState:
        """Start draining (idempotent) and stay up once drained; returns the state. Must run on the event loop."""
        self.state = begin(self.state, reason, self._clock(), self._timeout_s)
        self._start(reason)
        return self.state

    def signal(self, reason: str) -> DrainState:
        """A SIGTERM/SIGINT (see `request_exit`); exits at once when already drained. Must run on the event loop."""
        hastening = self.state.exit_requested
        self.state = request_exit(self.state, reason, self._clock(), self._timeout_s)
        if should_exit(self.state):
            log.warning("%s: already drained; exiting", reason)
            self._on_exit()
            return self.state
        if hastening:
            log.warning("%s again: aborting what is left and exiting", reason)
            if self._waiter is not None:
                self._waiter.cancel()  # re-decide now
        self._start(reason)
        return self.state

    def _start(self, reason: str) -> None:
        if self._task is None:
            log.warning(
                "drain started (%s): not ready, refusing new requests, %d in flight, timeout %.1fs",
                reason,
                self._inflight(),
                self._timeout_s,
            )
            self._task = asyncio.get_running_loop().create_task(self._run(), name="drain")

    def seconds_left(self) -> float | None:
        if self.state.phase is not Phase.DRAINING or self.state.deadline is None:
            return None
        return max(0.0, self.state.deadline - self._clock())

    async def wait(self) -> None:
        """Until the drain has finished (for shutdown and tests)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _sleep(self, timeout: float) -> None:
        """Until the in-flight count changes, `timeout` passes or `hasten` interrupts."""
        self._waiter = asyncio.ensure_future(self._wait_change(max(0.0, timeout)))
        try:
            await asyncio.wait({self._waiter})
        finally:
            self._waiter = None

    async def _run(self) -> None:
        timed_out = False
        while True:
            decision = decide(self.state, self._inflight(), self._clock())
            if decision is Decision.DONE:
                break
            if decision is Decision.ABORT_REST:
                timed_out = True
                log.warning("drain timeout: aborting %d in-flight request(s)", self._inflight())
                await self._abort_all()
                grace_end = self._clock() + self._abort_grace_s
                while self._inflight() and self._clock() < grace_end:
                    await self._wait_change(grace_end - self._clock())
                break
            assert self.state.deadline is not None
            await self._sleep(self.state.deadline - self._clock())
        self.state = finish(self.state, timed_out)
        log.warning(
            "drain finished (%s)%s",
            "timed out, rest aborted" if timed_out else "idle",
            "; exiting" if should_exit(self.state) else "; idle until the pod is deleted (SIGTERM exits)",
        )
        if should_exit(self.state):
            self._on_exit()
