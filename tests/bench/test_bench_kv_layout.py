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
