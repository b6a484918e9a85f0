"""Prompt logprobs and top-k logprobs from the real model runner, checked against the transformers reference.

Teacher-forced scoring (`SamplingParams.prompt_logprobs`) is what the canary quality probe measures a quantized
canary with, so it must be exact whatever the scheduling: whole prompt, chunked prefill, batched with others."""

from __future__ import annotations

import pytest
import torch
from worker import LLM, SamplingParams

PROMPT = [3, 17, 42, 8, 99, 5, 23, 61, 7, 12, 88, 40, 2, 31, 77, 19, 54, 9, 66, 28, 45]


def reference_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 6, "max_num_seqs": 2}],
    ids=["whole", "chunked"],
)
def test_prompt_logprobs_match_transformers(tiny_dir, tiny_hf, engine_args) -> None:
    llm = LLM(str(tiny_dir), block_size=4, num_blocks=64, **engine_args)
    other = [50, 51, 52, 53, 54, 55, 56, 57, 58]  # batched alongside, without prompt logprobs
    outs = llm.generate(
        [PROMPT, other],
        [
            SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3),
            SamplingParams(max_tokens=2, temperature=0.0),
        ],
    )
    scored = outs[0].prompt_logprobs
    assert scored is not None and len(scored) == len(PROMPT) - 1 and outs[1].prompt_logprobs is None
    ref = reference_logprobs(tiny_hf, PROMPT)
    for position, entry in enumerate(scored, start=1):
        row = ref[position - 1]  # logits at position p - 1 predict token p
        assert entry.logprob == pytest.approx(float(row[PROMPT[position]]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_top_logprobs_of_generated_tokens_match_transformers(tiny_dir, tiny_hf) -> None:
    llm = LLM(str(tiny_dir), block_size=4, num_blocks=64)
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2))
    ref = reference_logprobs(tiny_hf, PROMPT + out.token_ids)
    assert out.top_logprobs is not None
    for i, (token, top) in enumerate(zip(out.token_ids, out.top_logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + i]
        assert top[0][0] == token and [t for t, _ in top] == row.topk(2).indices.tolist()
        assert out.logprobs[i] == pytest.approx(float(row[token]), abs=1e-4)
