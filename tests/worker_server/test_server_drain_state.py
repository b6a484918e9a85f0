"""The drain state machine (pure) and its async shell, driven with a fake clock and a fake in-flight count."""

from __future__ import annotations

import asyncio

import pytest
from worker.server.drain import (
    Decision,
    Drainer,
    DrainState,
    Phase,
    begin,
    decide,
    finish,
    hasten,
    request_exit,
    should_exit,
)

SERVING = DrainState()
DRAINING = DrainState(Phase.DRAINING, "SIGTERM", started_at=100.0, deadline=130.0)


@pytest.mark.parametrize(
    ("state", "inflight", "now", "expected"),
    [
        (SERVING, 0, 0.0, Decision.WAIT),  # not draining: nothing to decide
        (SERVING, 5, 0.0, Decision.WAIT),
        (DRAINING, 0, 101.0, Decision.DONE),  # idle: exit
        (DRAINING, 2, 101.0, Decision.WAIT),  # in flight, time left
        (DRAINING, 2, 130.0, Decision.ABORT_REST),  # deadline reached
        (DRAINING, 0, 200.0, Decision.DONE),  # idle wins over the deadline
        (finish(DRAINING, False), 3, 101.0, Decision.DONE),  # already drained
    ],
)
def test_decide(state: DrainState, inflight: int, now: float, expected: Decision) -> None:
    assert decide(state, inflight, now) is expected


def test_begin_is_idempotent_and_keeps_the_first_deadline() -> None:
    first = begin(SERVING, "POST /drain", now=10.0, timeout_s=30.0)
    assert (first.phase, first.reason, first.deadline) == (Phase.DRAINING, "POST /drain", 40.0)
    assert begin(first, "SIGTERM", now=20.0, timeout_s=5.0) == first


@pytest.mark.parametrize(
    ("state", "now", "deadline"),
    [
        (DRAINING, 110.0, 110.0),  # moved to now
        (DRAINING, 140.0, 130.0),  # already past: unchanged
        (SERVING, 110.0, None),  # not draining: nothing to hasten
    ],
)
def test_hasten(state: DrainState, now: float, deadline: float | None) -> None:
    assert hasten(state, now).deadline == deadline


EXITING = DrainState(Phase.DRAINING, "SIGTERM", started_at=100.0, deadline=130.0, exit_requested=True)
DRAINED_BY_POST = finish(DrainState(Phase.DRAINING, "POST /drain", started_at=100.0, deadline=130.0), False)


@pytest.mark.parametrize(
    ("state", "now", "expected"),
    [
        # first signal while serving: drain with the full timeout, then exit
        (SERVING, 10.0, DrainState(Phase.DRAINING, "SIGTERM", 10.0, 40.0, exit_requested=True)),
        # first signal during a POST /drain: keep that drain's deadline (no hastening), exit when it ends
        (DRAINING, 110.0, DrainState(Phase.DRAINING, "SIGTERM", 100.0, 130.0, exit_requested=True)),
        # first signal after a POST /drain finished: exit now
        (DRAINED_BY_POST, 200.0, DrainState(Phase.DRAINED, "POST /drain", 100.0, 130.0, exit_requested=True)),
        # a second signal: the deadline moves to now
        (EXITING, 110.0, DrainState(Phase.DRAINING, "SIGTERM", 100.0, 110.0, exit_requested=True)),
    ],
)
def test_request_exit(state: DrainState, now: float, expected: DrainState) -> None:
    assert request_exit(state, "SIGTERM", now, timeout_s=30.0) == expected


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (SERVING, False),
        (DRAINING, False),
        (EXITING, False),  # still draining
        (DRAINED_BY_POST, False),  # POST /drain: stay up, idle, until the pod is deleted
        (finish(EXITING, False), True),
    ],
)
def test_should_exit(state: DrainState, expected: bool) -> None:
    assert should_exit(state) is expected


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """An in-flight counter whose changes wake the drainer, and a record of aborts and exits."""

    def __init__(self, timeout_s: float) -> None:
        self.clock = FakeClock()
        self.inflight = 0
        self.aborts = 0
        self.exits = 0
        self.changed = asyncio.Event()
        self.drainer = Drainer(
            timeout_s,
            self.clock,
            lambda: self.inflight,
            self.wait_change,
            self.abort_all,
            self.on_exit,
            abort_grace_s=1.0,
        )

    async def wait_change(self, timeout: float) -> None:
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), timeout=0.5)  # wall-clock bound; the fake clock rules
        except TimeoutError:
            pass

    def set_inflight(self, n: int) -> None:
        self.inflight = n
        self.changed.set()

    async def abort_all(self) -> None:
        self.aborts += 1
        self.set_inflight(0)

    def on_exit(self) -> None:
        self.exits += 1


async def test_drainer_exits_when_the_last_request_ends() -> None:
    h = Harness(timeout_s=30)
    h.inflight = 2
    state = h.drainer.signal("SIGTERM")
    assert state.draining and h.drainer.seconds_left() == 30
    h.set_inflight(1)
    await asyncio.sleep(0)
    assert h.exits == 0
    h.set_inflight(0)
    await asyncio.wait_for(h.drainer.wait(), 5)
    assert (h.exits, h.aborts) == (1, 0)
    assert h.drainer.state.phase is Phase.DRAINED and not h.drainer.state.timed_out


async def test_drainer_aborts_the_rest_at_the_deadline() -> None:
    h = Harness(timeout_s=30)
    h.inflight = 3
    h.drainer.signal("SIGTERM")
    await asyncio.sleep(0)
    h.clock.now = 31.0
    h.set_inflight(3)  # wake it up
    await asyncio.wait_for(h.drainer.wait(), 5)
    assert (h.exits, h.aborts) == (1, 1)
    assert h.drainer.state.timed_out


async def test_hasten_aborts_now() -> None:
    h = Harness(timeout_s=300)
    h.inflight = 1
    h.drainer.signal("SIGTERM")
    await asyncio.sleep(0)
    h.drainer.signal("SIGTERM")  # the second one hastens
    h.set_inflight(1)
    await asyncio.wait_for(h.drainer.wait(), 5)
    assert (h.exits, h.aborts) == (1, 1)


async def test_idle_worker_drains_at_once() -> None:
    h = Harness(timeout_s=30)
    h.drainer.signal("SIGTERM")
    await asyncio.wait_for(h.drainer.wait(), 5)
    assert h.exits == 1 and h.aborts == 0


async def test_post_drain_stays_up_until_a_signal() -> None:
    h = Harness(timeout_s=30)
    h.inflight = 1
    h.drainer.begin("POST /drain")
    h.set_inflight(0)
    await asyncio.wait_for(h.drainer.wait(), 5)
    assert h.drainer.state.phase is Phase.DRAINED and h.exits == 0  # drained, idle, still up
    h.drainer.signal("SIGTERM")  # the kubelet deletes the pod
    assert h.exits == 1 and h.aborts == 0


async def test_signal_during_a_post_drain_exits_when_it_ends() -> None:
    h = Harness(timeout_s=30)
    h.inflight = 1
    h.drainer.begin("POST /drain")
    await asyncio.sleep(0)
    h.drainer.signal("SIGTERM")
    await asyncio.sleep(0)
    assert h.exits == 0 and h.drainer.seconds_left() == 30  # not hastened by the first signal
    h.set_inflight(0)
    await asyncio.wait_for(h.drainer.wait(), 5)
    assert (h.exits, h.aborts) == (1, 0)
