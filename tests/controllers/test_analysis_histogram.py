"""Histogram quantiles from cumulative buckets (PromQL `histogram_quantile` semantics) and scrape deltas."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controllers.analysis import bucket_deltas, counter_delta, histogram_quantile, merge_buckets

INF = math.inf
# 100 observations: 50 <= 0.1 s, 40 in (0.1, 0.5], 10 in (0.5, 1].
H = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, INF: 100.0}

QUANTILES = [
    ("median in first bucket", 0.5, H, 0.1),  # rank 50 -> end of the first bucket
    ("interpolates from 0 in the first bucket", 0.25, H, 0.05),
    ("interpolates in a middle bucket", 0.7, H, 0.1 + 0.4 * (20 / 40)),
    ("p95 in the last finite bucket", 0.95, H, 0.5 + 0.5 * (5 / 10)),
    ("q=1 ends at the highest finite bucket", 1.0, H, 1.0),
    ("q=0", 0.0, H, 0.0),
    ("q=0 with an empty first bucket", 0.0, {0.1: 0.0, 0.2: 5.0, INF: 5.0}, 0.0),
    ("rank in +Inf bucket returns highest finite bound", 0.99, {0.1: 10.0, 1.0: 50.0, INF: 100.0}, 1.0),
    ("non-positive first bound is returned as is", 0.1, {-1.0: 5.0, 1.0: 10.0, INF: 10.0}, -1.0),
    ("non-monotonic counts are fixed", 0.5, {0.1: 50.0, 0.5: 40.0, 1.0: 100.0, INF: 100.0}, 0.1),
    ("unsorted pairs", 0.5, [(INF, 100.0), (1.0, 100.0), (0.1, 50.0), (0.5, 90.0)], 0.1),
    ("no observations", 0.95, {0.1: 0.0, INF: 0.0}, None),
    ("no +Inf bucket", 0.5, {0.1: 5.0, 1.0: 10.0}, None),
    ("only +Inf bucket", 0.5, {INF: 10.0}, None),
    ("empty", 0.5, {}, None),
]


@pytest.mark.parametrize(("q", "buckets", "expected"), [pytest.param(*c[1:], id=c[0]) for c in QUANTILES])
def test_histogram_quantile(q: float, buckets: object, expected: float | None) -> None:
    value = histogram_quantile(q, buckets)  # type: ignore[arg-type]
    if expected is None:
        assert value is None
    else:
        assert value == pytest.approx(expected)


@pytest.mark.parametrize("q", [-0.1, 1.1, math.nan])
def test_quantile_out_of_range_is_an_error(q: float) -> None:
    with pytest.raises(ValueError, match=r"quantile must be within 0\.\.1"):
        histogram_quantile(q, H)


@given(
    counts=st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=12),
    q=st.floats(min_value=0, max_value=1),
)
def test_quantile_lies_within_the_bucket_range_and_grows_with_q(counts: list[int], q: float) -> None:
    bounds = [0.01 * 2**i for i in range(len(counts))]
    cumulative: dict[float, float] = {}
    running = 0
    for bound, count in zip(bounds, counts, strict=True):
        running += count
        cumulative[bound] = running
    cumulative[INF] = running
    value = histogram_quantile(q, cumulative)
    if running == 0:
        assert value is None
        return
    assert value is not None and 0 <= value <= bounds[-1]
    higher = histogram_quantile(min(1.0, q + 0.1), cumulative)
    assert higher is not None and higher >= value - 1e-12


DELTAS = [
    ("plain increase", {0.1: 5.0, INF: 8.0}, {0.1: 7.0, INF: 12.0}, {0.1: 2.0, INF: 4.0}),
    ("no previous scrape: nothing measured", None, {0.1: 7.0, INF: 12.0}, {0.1: 0.0, INF: 0.0}),
    (
        "reset (process restarted): current counts are the increase",
        {0.1: 50.0, INF: 80.0},
        {0.1: 3.0, INF: 4.0},
        {0.1: 3.0, INF: 4.0},
    ),
    ("new bucket counts from zero", {INF: 8.0}, {0.1: 1.0, INF: 9.0}, {0.1: 1.0, INF: 1.0}),
]


@pytest.mark.parametrize(("previous", "current", "expected"), [pytest.param(*c[1:], id=c[0]) for c in DELTAS])
def test_bucket_deltas(
    previous: dict[float, float] | None, current: dict[float, float], expected: dict[float, float]
) -> None:
    assert bucket_deltas(previous, current) == expected


@pytest.mark.parametrize(
    ("previous", "current", "expected"),
    [(None, 10.0, 0.0), (4.0, 10.0, 6.0), (10.0, 10.0, 0.0), (10.0, 3.0, 3.0)],
)
def test_counter_delta(previous: float | None, current: float, expected: float) -> None:
    assert counter_delta(previous, current) == expected


def test_merge_then_quantile_is_sum_by_le() -> None:
    fast = {0.1: 10.0, 1.0: 10.0, INF: 10.0}
    slow = {0.1: 0.0, 1.0: 10.0, INF: 10.0}
    merged = merge_buckets([fast, slow])
    assert merged == {0.1: 10.0, 1.0: 20.0, INF: 20.0}
    assert histogram_quantile(0.75, merged) == pytest.approx(0.1 + 0.9 * 0.5)
