"""Prompt logprobs (teacher-forced scoring) through the scheduler and engine, over the toy runner.

The toy runner derives each logprob from the context it reads back through the block table, so a chunk boundary,
a prefix-cache hit or a recompute that feeds the wrong context changes the values."""

from __future__ import annotations

import pytest
from worker import LLM, SamplingParams
from worker.core.config import EngineConfig
from worker.core.request import Logprob
from worker.engine.core import EngineCore
from worker.engine.toy import ToyRunner, toy_logprob, toy_top


def _llm(**engine_args) -> LLM:
    engine_args.setdefault("block_size", 4)
    runner = ToyRunner(num_blocks=engine_args.pop("runner_blocks", 128), block_size=engine_args["block_size"])
    return LLM(runner=runner, **engine_args)


def expected(prompt: list[int], k: int) -> list[Logprob]:
    return [Logprob(toy_logprob(prompt[: i + 1]), toy_top(prompt[:i], k)) for i in range(1, len(prompt))]


PROMPT = list(range(40, 77))  # 37 tokens: several blocks and chunks


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 2048},  # one chunk
        {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill
        {"max_num_batched_tokens": 5, "max_num_seqs": 1},  # chunks not aligned to blocks
    ],
    ids=["whole", "chunked", "odd-chunks"],
)
@pytest.mark.parametrize("k", [0, 3])
def test_every_prompt_token_after_the_first_is_scored(engine_args, k) -> None:
    llm = _llm(**engine_args)
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=k))
    assert out.prompt_logprobs == expected(PROMPT, k)
    assert len(out.token_ids) == 3


def test_prefix_cache_hits_are_bypassed_but_the_answer_is_unchanged() -> None:
    llm = _llm(enable_prefix_caching=True)
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    [first] = llm.generate([PROMPT], plain)
    [cached] = llm.generate([PROMPT], plain)
    assert cached.num_cached_tokens > 0  # the prompt is in the cache
    [scored] = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1))
    assert scored.num_cached_tokens == 0 and scored.token_ids == first.token_ids
    assert scored.prompt_logprobs == expected(PROMPT, 1)


def test_preempted_request_keeps_one_logprob_per_prompt_token() -> None:
    # Few blocks: the two requests cannot both hold their contexts, so one is preempted and recomputed.
    llm = _llm(runner_blocks=14, max_num_batched_tokens=8, max_num_seqs=2)
    prompts = [PROMPT, list(range(90, 120))]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions_total > 0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_logprobs == expected(prompt, 2)


def test_without_prompt_logprobs_nothing_is_scored() -> None:
    [out] = _llm().generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))
    assert out.prompt_logprobs is None


def test_one_token_prompt_has_no_prompt_logprobs() -> None:
    [out] = _llm().generate([[65]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))
    assert out.prompt_logprobs == []


def test_prompt_logprobs_come_on_the_first_delta_only() -> None:
    core = EngineCore.from_config(
        EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=2), ToyRunner(block_size=4)
    )
    core.add_request("r", PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=0))
    deltas = []
    while core.has_unfinished_requests():
        deltas += core.step()
    assert deltas[0].prompt_logprobs == expected(PROMPT, 0)
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_top_logprobs_of_generated_tokens() -> None:
    [out] = _llm().generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2))
    assert out.top_logprobs is not None and len(out.top_logprobs) == 4
    context = list(PROMPT)
    for token, top in zip(out.token_ids, out.top_logprobs):
        assert top == toy_top(context, 2) and top[0][0] == token  # greedy: the chosen token is the top one
        context.append(token)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"top_logprobs": 2}, "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in"),
    ],
)
def test_bad_logprob_settings_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
