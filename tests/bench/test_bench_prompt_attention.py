"""bench/prompt_attention.py on small chunks: both paths run on every case, the native kernel's output matches
SDPA's (fp32) or is as near an fp32 reference as bf16 SDPA's (bf16), and a CPU without the kernel gets a clear
refusal."""

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


def test_bf16_chunks_are_timed_against_bf16_sdpa_and_both_are_near_an_fp32_reference():
    if load_prefill_attention(prompt_attention.torch.bfloat16, 64)[0] is None:
        with pytest.raises(SystemExit, match="does not run here"):
            prompt_attention.run(["smollm2-135m"], [9], [0], rounds=1, dtype=prompt_attention.torch.bfloat16)
        return
    result = prompt_attention.run(["smollm2-135m"], [9, 20], [0, 5], rounds=1, dtype=prompt_attention.torch.bfloat16)
    assert result["dtype"] == "bfloat16" and len(result["cases"]) == 4
    for case in result["cases"]:
        assert case["native_ms"] > 0 and case["sdpa_ms"] > 0
        assert case["max_abs_diff"] < 2e-2 and case["sdpa_max_abs_diff"] < 2e-2, case
