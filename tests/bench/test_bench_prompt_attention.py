"""bench/prompt_attention.py on small chunks: both paths run on every case, the native kernel's output matches
SDPA's, and a CPU without the kernel gets a clear refusal."""

from __future__ import annotations

import prompt_attention
import pytest
from worker.model.kernels import load_prefill_attention


def test_every_case_is_timed_and_the_outputs_agree():
    if load_prefill_attention(prompt_attention.torch.float32, 64)[0] is None:
        with pytest.raises(SystemExit, match="does not run here"):
            prompt_attention.run(["smollm2-135m"], [9], [0], rounds=1)
        return
    result = prompt_attention.run(["smollm2-135m", "llama3-8b"], [9, 20], [0, 5], rounds=1)
    cases = result["cases"]
    assert [(c["shape"], c["chunk"], c["start"]) for c in cases] == [
        (shape, n, start) for shape in ("smollm2-135m", "llama3-8b") for n in (9, 20) for start in (0, 5)
    ]
    for case in cases:
        assert case["native_ms"] > 0 and case["sdpa_ms"] > 0
        assert case["max_abs_diff"] < 1e-5, case
