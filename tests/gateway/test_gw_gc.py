"""A served request leaves no reference cycle in the gateway: what it allocates is freed by reference counting, so
the garbage collector (tuned in `gateway.cli.tune_garbage_collector`) has nothing of ours to find.

A cancelled task keeps its CancelledError, whose traceback holds the task's frame: the per-request disconnect
listener used to be cancelled at the end of every request and left such a cycle each time."""

from __future__ import annotations

import asyncio
import gc
import types
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gateway.cli import GC_THRESHOLD_YOUNG, tune_garbage_collector
from gateway.testing import FixedSource, chat, one_variant_table, run_gateway, stubs

KEY = "sk-test-gc-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


def ours(obj: object) -> bool:
    """An object the gateway's code made or runs: its frames, its instances, or a cancellation."""
    if isinstance(obj, types.FrameType):
        return "/gateway/" in obj.f_code.co_filename
    if isinstance(obj, asyncio.CancelledError):
        return True
    return type(obj).__module__.startswith("gateway.")


@contextmanager
def cyclic_garbage() -> Iterator[list[object]]:
    """Collects, then yields the list that receives what the collector finds unreachable while the block runs."""
    gc.collect()
    found: list[object] = []
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("stream", [True, False])
async def test_served_requests_leave_no_reference_cycle_of_ours(stream: bool) -> None:
    async with (
        stubs(1, tokens=4) as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), {KEY: "premium"}) as gw,
        gw.client(headers=AUTH) as c,
    ):
        assert (await c.post("/v1/chat/completions", json=chat(model="m", stream=stream))).status_code == 200
        with cyclic_garbage() as garbage:
            for _ in range(5):
                r = await c.post("/v1/chat/completions", json=chat(model="m", stream=stream))
                assert r.status_code == 200
            await asyncio.sleep(0.05)  # the listeners' last wake-ups
        leaked = [o for o in garbage if ours(o)]
    assert leaked == [], sorted({type(o).__qualname__ for o in leaked})


def test_tuning_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    before = gc.get_threshold()
    try:
        tune_garbage_collector()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_THRESHOLD_YOUNG, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
