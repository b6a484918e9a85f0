"""bench/event_loop_lag.py: its summary of overruns, its ticker around a function, and a small engine run."""

from __future__ import annotations

import math
import time

import event_loop_lag
import pytest


@pytest.mark.parametrize(
    "late,want",
    [
        ([0.001, 0.002, 0.003], {"ticks": 3, "p50_ms": 2.0, "p99_ms": 3.0, "max_ms": 3.0}),
        ([0.0005], {"ticks": 1, "p50_ms": 0.5, "p99_ms": 0.5, "max_ms": 0.5}),
        ([i / 1e4 for i in range(200)], {"ticks": 200, "p50_ms": 10.0, "p99_ms": 19.8, "max_ms": 19.9}),
    ],
)
def test_summary_reads_sorted_overruns(late, want):
    assert event_loop_lag.summary(late) == want


def test_no_ticks_summarize_as_nan():
    s = event_loop_lag.summary([])
    assert s["ticks"] == 0 and all(math.isnan(s[k]) for k in ("p50_ms", "p99_ms", "max_ms"))


def test_the_ticker_runs_beside_the_function_and_stops_with_it():
    late, took = event_loop_lag.lateness(lambda: time.sleep(0.05))
    assert took >= 0.05
    assert len(late) >= 3 and late == sorted(late)


def test_a_small_engine_run_reports_both_phases():
    result = event_loop_lag.run("bundled://smollm2-135m-instruct", "float32", requests=2, prompt=48, tokens=2)
    assert result["engine_wall_s"] > 0
    for phase in ("idle", "during_batch"):
        assert result[phase]["ticks"] > 0 and result[phase]["max_ms"] >= result[phase]["p50_ms"] >= 0
