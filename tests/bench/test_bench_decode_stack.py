"""bench/decode_stack.py on a small workload: both ways run every round and give the same tokens."""

from __future__ import annotations

import decode_stack
import pytest


def test_both_ways_run_each_round_and_give_the_same_tokens():
    try:
        result = decode_stack.run("float32", requests=3, prompt_len=(8, 40), output_len=(3, 6), rounds=2)
    except SystemExit as exc:  # a CPU whose linears do not run on the panels
        pytest.skip(str(exc))
    assert len(result["python_s"]) == len(result["stack_s"]) == 2
    assert all(s > 0 for s in result["python_s"] + result["stack_s"])
    assert result["same_tokens"] is True
    spread = result["python_over_stack"]
    assert 0 < spread["min"] <= spread["median"] <= spread["max"]
