"""bench/engine_parts.py on a small workload: every part is timed, the parts fit in the wall time, and the module
timers it installs are removed afterwards."""

from __future__ import annotations

import engine_parts
import pytest
import torch.nn.functional as F
import worker.model.attention as attention
import worker.model.llama as llama
from worker.model.kernels import load_paged_decode


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parts_are_timed_and_fit_in_the_wall_time(dtype):
    result = engine_parts.run(dtype, requests=3, prompt_len=(8, 40), output_len=(3, 6))
    parts = result["parts_s"]
    for name in ("linears", "output head", "prefill attention", "attention, rest", "sampler", "runner, rest"):
        assert name in parts, name
    if load_paged_decode()[0] is not None:
        assert "decode attention" in parts
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(result["wall_s"], rel=0.02)
    assert result["steps"] >= 6
    assert attention.F is F and llama.paged_attention is attention.paged_attention
