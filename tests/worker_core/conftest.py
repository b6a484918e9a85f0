"""Shared helpers for the torch-free engine tests: an independent reference for the toy model, engine builders.

Tests reach them through the `kit` fixture (pytest runs with --import-mode=importlib, so test modules cannot
import this file by name).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from worker.core.config import EngineConfig
from worker.core.request import FinishReason, SamplingParams
from worker.core.scheduler import Scheduler
from worker.engine.core import EngineCore
from worker.engine.toy import EOS, ToyRunner, toy_next_token


def reference(
    prompt: Sequence[int], params: SamplingParams, max_len: int = 10**9, eos: int = EOS
) -> tuple[list[int], FinishReason]:
    """What the toy model generates for one prompt run alone, token by token, with the stop rules applied.

    Written without the engine: every engine configuration must reproduce it exactly.
    """
    context = list(prompt)
    out: list[int] = []
    rng = None if params.greedy else random.Random(params.seed)
    while True:
        draw = 0 if rng is None else rng.randrange(1 << 30)
        token = toy_next_token(context, draw)
        out.append(token)
        context.append(token)
        if len(out) >= params.min_tokens:
            if token == eos and not params.ignore_eos:
                return out, FinishReason.STOP
            if token in params.stop_token_ids:
                return out, FinishReason.STOP
        if len(out) >= params.max_tokens or len(context) >= max_len:
            return out, FinishReason.LENGTH


def make_core(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 4096, **config) -> EngineCore:
    cfg = EngineConfig(block_size=block_size, **config)
    runner = ToyRunner(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
    return EngineCore.from_config(cfg, runner)


def run_to_completion(core: EngineCore, max_steps: int = 100_000) -> int:
    """Step until idle; returns the number of steps (bounded, so a scheduling bug fails instead of hanging)."""
    for step in range(max_steps):
        if not core.has_unfinished_requests():
            return step
        core.step()
    raise AssertionError(f"not finished after {max_steps} steps")


def assert_pool_empty(scheduler: Scheduler) -> None:
    """Every block is back in the free queue with no reference left."""
    pool = scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert scheduler.kv.usage == 0.0


def assert_refcounts_consistent(scheduler: Scheduler) -> None:
    """Each block's ref count equals the number of running requests whose block table holds it."""
    counts: dict[int, int] = {}
    for req in scheduler.running:
        for bid in scheduler.kv.get_block_ids(req.request_id):
            counts[bid] = counts.get(bid, 0) + 1
    for block in scheduler.kv.pool.blocks:
        assert block.ref_cnt == counts.get(block.block_id, 0), block
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks - len(counts)


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    return SimpleNamespace(
        reference=reference,
        make_core=make_core,
        run_to_completion=run_to_completion,
        assert_pool_empty=assert_pool_empty,
        assert_refcounts_consistent=assert_refcounts_consistent,
    )
