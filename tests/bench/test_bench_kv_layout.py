"""bench/kv_layout.py on a small workload: it records the engine's decode steps and replays them over both cache
layouts, which give the same outputs."""

from __future__ import annotations

import kv_layout
import pytest
import torch
import worker.model.attention as attention
import worker.model.llama as llama
from worker.model.kernels import head_major_cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_layouts_replay_the_recorded_steps_to_the_same_outputs(dtype):
    recorded = kv_layout.decode_steps(dtype, requests=3, prompt_len=(8, 40), output_len=(3, 6))
    assert llama.paged_attention is attention.paged_attention  # the recording spy is gone
    assert recorded["shape"] == (9, 3, 64) and recorded["block_size"] == 16
    steps = recorded["steps"]
    assert len(steps) >= 2  # decode-only steps after the prompts: the last tokens of the longest request
    for tables, lens in steps:
        assert tables.shape[0] == lens.shape[0] <= 3 and int(lens.min()) >= 9
    if not head_major_cache(getattr(torch, dtype), 64, 16):
        pytest.skip("the decode kernel reads no head-major cache on this CPU (needs AVX-512)")
    result = kv_layout.compare(recorded, dtype, every=1, rounds=2)
    assert result["same_outputs"] is True
    assert result["steps"] == len(steps) and result["tokens_attended"] == sum(int(lens.sum()) for _, lens in steps)
    assert result["token_major"]["s"] > 0 and result["head_major"]["s"] > 0
    assert result["x_head_major"]["min"] <= result["x_head_major"]["median"] <= result["x_head_major"]["max"]


def test_the_pools_tables_replay_over_one_cache():
    """`--blocks`: the queue pool (fresh and aged) and ours run the same steps; ours keeps each request's blocks in
    longer runs of consecutive ids."""
    args = ("bfloat16", 4, (20, 60), (20, 40))
    recorded = {
        "queue_fresh": kv_layout.decode_steps(*args, pool=kv_layout.QueuePool),
        "queue_aged": kv_layout.decode_steps(*args, pool=kv_layout.QueuePool, aged=True),
        "ours": kv_layout.decode_steps(*args),
    }
    assert llama.paged_attention is attention.paged_attention
    runs = {name: kv_layout.mean_run(rec["steps"], 16) for name, rec in recorded.items()}
    assert runs["ours"] > runs["queue_fresh"] >= 1.0, runs
    if not head_major_cache(torch.bfloat16, 64, 16):
        pytest.skip("the decode kernel reads no head-major cache on this CPU (needs AVX-512)")
    result = kv_layout.compare_pools(recorded, "bfloat16", every=1, rounds=2)
    assert result["queue_fresh"]["x_speed"]["median"] == 1.0
    assert result["ours"]["mean_run"] == round(runs["ours"], 2) and result["ours"]["s"] > 0


@pytest.mark.parametrize(
    ("tables", "lens", "expected"),
    [
        ([[3, 4, 5, 0]], [40], 3.0),  # 3 blocks, one run (the padding past the context is not read)
        ([[3, 7, 8, 0]], [49], 4 / 3),  # 4 blocks (49 tokens): runs 3 | 7, 8 | 0
        ([[1, 2], [9, 4]], [32, 17], 4 / 3),  # 2 + 2 blocks in 3 runs
    ],
)
def test_mean_run(tables, lens, expected):
    assert kv_layout.mean_run([(torch.tensor(tables), torch.tensor(lens))], 16) == pytest.approx(expected)


def test_the_queue_baseline_runs_with_prefix_caching():
    """The baseline pool keeps the prefix cache's bookkeeping (hits, LRU eviction) when the engine caches."""
    args = ("bfloat16", 4, (20, 60), (20, 40))
    queue = kv_layout.decode_steps(*args, pool=kv_layout.QueuePool, aged=True, prefix_caching=True)
    ours = kv_layout.decode_steps(*args, aged=True, prefix_caching=True)
    assert [lens.tolist() for _, lens in queue["steps"]] == [lens.tolist() for _, lens in ours["steps"]]


def test_a_build_compared_with_itself_gives_the_same_outputs():
    """`--base`: two builds over the same recorded steps and cache (here this tree's build on both sides)."""
    import panel_ab

    if not head_major_cache(torch.bfloat16, 64, 16):
        pytest.skip("the decode kernel reads no head-major cache on this CPU (needs AVX-512)")
    recorded = kv_layout.decode_steps("bfloat16", requests=3, prompt_len=(8, 40), output_len=(3, 6))
    module = panel_ab.load_module_file(panel_ab.module_file(panel_ab.ROOT / "worker_image"))
    result = kv_layout.compare_builds(recorded, "bfloat16", every=1, rounds=2, base=module)
    assert result["max_abs_diff"] == 0.0 and result["steps"] == len(recorded["steps"])
    assert result["base"]["s"] > 0 and result["new"]["s"] > 0
    assert result["x_new"]["min"] <= result["x_new"]["median"] <= result["x_new"]["max"]


def test_timed_rounds_alternate_the_order():
    calls: list[str] = []
    seconds = kv_layout.timed_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert {name: len(s) for name, s in seconds.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for s in seconds.values() for t in s)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_builds_replay_over_the_layout_the_runner_uses_here(dtype):
    """`--base REV`: the other build runs over the cache as the runner lays it out on this CPU (token-major where
    the AVX2 passes read it: a head-major cache there was refused). A build against itself gives the same outputs."""
    from worker.model.kernels import _load_module

    module, why = _load_module()
    if module is None:
        pytest.skip(f"the native kernels cannot be built here: {why}")
    recorded = kv_layout.decode_steps(dtype, requests=3, prompt_len=(8, 40), output_len=(3, 6))
    result = kv_layout.compare_builds(recorded, dtype, every=1, rounds=2, base=module)
    assert result["max_abs_diff"] == 0.0
    assert result["steps"] == len(recorded["steps"]) and result["base"]["s"] > 0 and result["new"]["s"] > 0
    assert result["x_new"]["min"] <= result["x_new"]["median"] <= result["x_new"]["max"]
