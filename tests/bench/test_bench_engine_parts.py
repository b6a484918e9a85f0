"""bench/engine_parts.py on a small workload: every part is timed, the parts fit in the wall time, and the module
timers it installs are removed afterwards."""

from __future__ import annotations

import engine_parts
import pytest
import torch
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


@pytest.mark.parametrize(
    ("rows", "label"),
    [(1, "1-8"), (8, "1-8"), (9, "9-16"), (32, "17-32"), (33, "33-64"), (64, "33-64"), (65, "65-512"), (2048, "513+")],
)
def test_row_buckets_are_inclusive_upper_bounds(rows, label):
    assert engine_parts.row_bucket(rows) == label


def test_a_row_timer_counts_flops_from_the_call_shapes():
    """A quantized layer keeps no `in_features`: the FLOPs come from x's and y's shapes (the timer once read them
    from the layer, and `--by-rows --quantization int8` failed)."""
    timers = engine_parts._RowTimers()
    timed = timers.wrap(lambda x: torch.zeros(x.shape[0], 5))
    assert timed(torch.ones(3, 7)).shape == (3, 5)
    timed(torch.ones(40, 7))
    calls, _, flops = timers.calls["1-8"]
    assert (calls, flops) == (1, 2 * 3 * 7 * 5)
    assert timers.calls["33-64"][2] == 2 * 40 * 7 * 5


def test_a_gated_row_timer_counts_gate_and_ups_columns():
    """`gated_linear(x, operands..., n)` returns silu(gate) * up, n / 2 columns: its FLOPs are gate+up's n."""
    timers = engine_parts._RowTimers()
    timed = timers.wrap(lambda x, *ops: torch.zeros(x.shape[0], ops[-1] // 2), gated=True)
    assert timed(torch.ones(3, 7), "operands", 10).shape == (3, 5)
    assert timers.calls["1-8"][2] == 2 * 3 * 7 * 10


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_by_rows_splits_every_linear_call_of_the_run(quantization):
    result = engine_parts.run(
        "float32", requests=3, prompt_len=(8, 40), output_len=(3, 6), quantization=quantization, by_rows=True
    )
    table = result["linears_by_rows"]
    assert set(table) <= {label for _, label in engine_parts.ROW_BUCKETS}
    assert "1-8" in table  # decode steps of at most 3 requests
    calls = sum(cell["calls"] for cell in table.values())
    assert calls % 4 == 0 and calls >= 4 * result["steps"]  # four projections a layer, every layer, every step
    seconds = sum(cell["s"] for cell in table.values())
    assert 0 < seconds <= result["parts_s"]["linears"] + 0.01
    assert all(cell["gflop_s"] > 0 for cell in table.values())
