"""The worker process freezes its start-up heap once the model is loaded (`worker.heap.freeze_startup_heap`): the
collector's full passes then skip the model's and tokenizer's objects, which made them stall every stream."""

from __future__ import annotations

import asyncio
import gc
import weakref

from worker.heap import freeze_startup_heap, startup_heap_frozen
from worker.server.fake_engine import FakeEngine
from worker.server.serve import WorkerServer
from worker.server.settings import WorkerSettings

SETTINGS = WorkerSettings(model="fake://fake-model", engine="fake", host="127.0.0.1", port=0)


def test_freeze_moves_the_live_heap_out_of_the_collectors_reach() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # the test process shares one heap: give it back


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_frozen_block_gives_the_heap_back_and_collects_what_it_left() -> None:
    # The benchmark loads one model after another in one process: each must be freed once its run is over.
    gc.unfreeze()
    cycle = Cycle()  # only the collector can free it
    ref = weakref.ref(cycle)
    try:
        with startup_heap_frozen():
            del cycle
            gc.collect()
            assert ref() is not None  # frozen: out of the collector's reach
        assert gc.get_freeze_count() == 0
        assert ref() is None
    finally:
        gc.unfreeze()


def test_the_worker_freezes_after_the_model_loads_and_before_it_reports_ready() -> None:
    seen: list[tuple[bool, int]] = []
    worker = WorkerServer(FakeEngine(), SETTINGS, configure_logging=False, freeze_heap_after_load=True)
    service = worker.service
    inner = service._on_loaded

    def watched() -> None:
        inner()
        seen.append((service.loaded, gc.get_freeze_count()))

    service._on_loaded = watched
    gc.unfreeze()
    try:
        asyncio.run(service._load())
        assert service.loaded
        assert len(seen) == 1 and seen[0][0] is False and seen[0][1] > 0  # frozen, then ready
    finally:
        gc.unfreeze()


def test_workers_that_share_a_process_do_not_freeze_it() -> None:
    worker = WorkerServer(FakeEngine(), SETTINGS, configure_logging=False)
    gc.unfreeze()
    asyncio.run(worker.service._load())
    assert worker.service.loaded and gc.get_freeze_count() == 0
