"""bench/decode_stack.py on a small workload: for each part, both ways run every round and give the same tokens,
and the model is left as it was."""

from __future__ import annotations

import decode_stack
import pytest


@pytest.mark.parametrize("part", sorted(decode_stack.PARTS))
def test_both_ways_run_each_round_and_give_the_same_tokens(part):
    try:
        result = decode_stack.run("float32", requests=3, prompt_len=(8, 40), output_len=(3, 6), rounds=2, part=part)
    except SystemExit as exc:  # a CPU whose linears do not run on the panels
        pytest.skip(str(exc))
    assert result["part"] == part
    assert len(result["off_s"]) == len(result["on_s"]) == 2
    assert all(s > 0 for s in result["off_s"] + result["on_s"])
    assert result["same_tokens"] is True
    spread = result["off_over_on"]
    assert 0 < spread["min"] <= spread["median"] <= spread["max"]
