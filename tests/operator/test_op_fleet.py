"""The per-deployment loop: passes again when woken, stops when halted or when the deployment is gone, and a
deletion loop that only ends once the plan says everything is gone."""

from __future__ import annotations

import asyncio

from fleet_operator.fleet import Fleet, PassResult
from fleet_operator.settings import OperatorSettings

from controllers import Plan


class ScriptedFleet(Fleet):
    """A Fleet whose passes return scripted results (the last one repeats) and are counted."""

    def __init__(self, results: list[PassResult], **settings: float) -> None:
        super().__init__(api=None, policy=None, settings=OperatorSettings(**settings))  # type: ignore[arg-type]
        self.results = results
        self.passes = 0
        self.passed = asyncio.Event()

    async def reconcile_once(self, namespace: str, name: str) -> PassResult:
        self.passes += 1
        self.passed.set()
        return self.results[min(self.passes, len(self.results)) - 1]


async def _next_pass(fleet: ScriptedFleet) -> None:
    fleet.passed.clear()
    await asyncio.wait_for(fleet.passed.wait(), timeout=10)


async def test_wake_makes_another_pass_and_halt_stops_the_loop():
    fleet = ScriptedFleet([PassResult(Plan())], resync_seconds=3600)
    halt = asyncio.Event()
    loop = asyncio.create_task(fleet.run("ns", "a", halt))
    await _next_pass(fleet)
    assert fleet.passes == 1
    fleet.wake("ns", "other")  # another deployment's event does not wake this one
    fleet.wake("ns", "a")
    await _next_pass(fleet)
    assert fleet.passes == 2
    halt.set()
    await asyncio.wait_for(loop, timeout=10)
    fleet.wake("ns", "a")  # no loop registered any more: nothing happens
    assert fleet.passes == 2


async def test_loop_ends_when_the_deployment_is_gone():
    fleet = ScriptedFleet([PassResult(Plan()), PassResult(None, gone=True)], resync_seconds=3600)
    loop = asyncio.create_task(fleet.run("ns", "a", asyncio.Event()))
    await _next_pass(fleet)
    fleet.wake("ns", "a")
    await asyncio.wait_for(loop, timeout=10)
    assert fleet.passes == 2


async def test_errors_back_off_then_retry_without_a_wake():
    fleet = ScriptedFleet(
        [PassResult(None, ("observe: 500",)), PassResult(Plan())], resync_seconds=3600, error_backoff_seconds=0.05
    )
    halt = asyncio.Event()
    loop = asyncio.create_task(fleet.run("ns", "a", halt))
    await _next_pass(fleet)
    await _next_pass(fleet)  # came from the error back-off, not from the (hour-long) resync
    halt.set()
    await asyncio.wait_for(loop, timeout=10)


async def test_deletion_loop_runs_until_finished():
    results = [PassResult(Plan()), PassResult(Plan(), ("delete pod x: 500",)), PassResult(Plan(finished=True))]
    fleet = ScriptedFleet(results, deletion_retry_seconds=0.01, error_backoff_seconds=0.01)
    await asyncio.wait_for(fleet.run_deletion("ns", "a"), timeout=10)
    assert fleet.passes == 3
