"""`bench/int8_study.py`'s quantizers compute what they claim, so its figures measure rounding and nothing else."""

from __future__ import annotations

import pytest
import torch
from int8_study import _W8A8, _FakeQuant, fake_int8_rows


def test_int8_rows_round_each_row_to_within_half_a_step() -> None:
    x = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]
    step = x.abs().amax(1, keepdim=True) / 127
    err = (fake_int8_rows(x) - x).abs()
    assert bool((err <= step / 2 + 1e-6 * step).all())
    assert len(fake_int8_rows(x).div(step).round().unique()) <= 255


@pytest.mark.parametrize(
    ("scheme", "exact"),
    [
        ({}, True),  # nothing quantized
        ({"w": True, "a": True, "outliers": 32}, True),  # every input channel kept unquantized
        ({"alpha": 0.5}, False),  # smoothing alone is x / s times w * s: equal up to float rounding
    ],
)
def test_schemes_that_quantize_nothing_give_the_dense_answer(scheme: dict[str, object], exact: bool) -> None:
    torch.manual_seed(0)
    w, x, amax = torch.randn(16, 32), torch.randn(5, 32), torch.rand(32) + 0.1
    got = _FakeQuant(w, None, amax, **scheme)(x)
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5 if exact else 1e-4, atol=1e-5 if exact else 1e-4)


def test_outlier_channels_escape_activation_rounding() -> None:
    """One huge channel ruins per-token int8 for every other channel unless it is kept aside."""
    torch.manual_seed(0)
    w, x = torch.randn(16, 32), torch.randn(4, 32)
    x[:, 3] = 1000.0
    amax = x.abs().amax(0)
    dense = x @ w.t()
    plain = (_FakeQuant(w, None, amax, a=True)(x) - dense).abs().max()
    kept = (_FakeQuant(w, None, amax, a=True, outliers=1)(x) - dense).abs().max()
    assert kept < plain / 20


@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_the_timed_w8a8_path_matches_the_dense_product(rows: int) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(48, 64) * 0.05, torch.randn(rows, 64)
    got = _W8A8(w, torch.tensor([0, 5, 9]))(x)
    torch.testing.assert_close(got, x @ w.t(), rtol=0.05, atol=0.02)
