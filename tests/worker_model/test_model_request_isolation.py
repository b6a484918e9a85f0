"""The torch engine on a tiny random Llama: parameters that used to reach torch ops and kill the engine step
(issue #18, finding 1) are refused or contained; logit_bias steers sampling."""

from __future__ import annotations

import dataclasses

import pytest
from worker import LLM, SamplingParams
from worker.core.request import FinishReason
from worker.model.testing import make_tiny_llama

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(model=str(make_tiny_llama(tmp_path_factory.mktemp("m"))), dtype="float32", num_blocks=64)


def sneak(params: SamplingParams, **fields) -> SamplingParams:
    """Params with fields set past validation: stands in for any fault the runner can pin on one request."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def test_a_seed_torch_cannot_take_fails_only_its_request(llm) -> None:
    alone = llm.generate([PROMPT], GREEDY)[0]
    bad = sneak(dataclasses.replace(GREEDY, temperature=1.0), seed=2**64)
    good, failed = llm.generate([PROMPT, [9, 10, 11]], [GREEDY, bad])
    assert failed.finish_reason is FinishReason.ERROR
    assert (good.token_ids, good.finish_reason) == (alone.token_ids, alone.finish_reason)
    assert llm.engine.runner.seeded_request_ids == frozenset()
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == alone.token_ids


def test_seeds_are_bounded_to_int64() -> None:
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=2**64)
    SamplingParams(seed=-(2**63))
    SamplingParams(seed=2**63 - 1)


def test_stop_token_ids_outside_the_vocabulary_are_refused_before_they_reach_the_sampler(llm) -> None:
    """With min_tokens, stop token ids are masked in the logits: an id past the vocabulary used to raise an
    IndexError inside the engine step."""
    with pytest.raises(ValueError, match="stop_token_ids must name token ids"):
        llm.generate([PROMPT], dataclasses.replace(GREEDY, stop_token_ids=(10**6,), min_tokens=2))
    assert len(llm.generate([PROMPT], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_a_tiny_temperature_samples_greedily(llm) -> None:
    """Dividing logits by a denormal temperature gives inf and NaN probabilities; such temperatures are greedy."""
    alone = llm.generate([PROMPT], GREEDY)[0]
    tiny = llm.generate([PROMPT], dataclasses.replace(GREEDY, temperature=1e-40, seed=3))[0]
    assert tiny.token_ids == alone.token_ids


def test_logit_bias_steers_sampling(llm) -> None:
    alone = llm.generate([PROMPT], GREEDY)[0]
    forced = llm.generate([PROMPT], dataclasses.replace(GREEDY, logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * GREEDY.max_tokens
    banned = llm.generate([PROMPT], dataclasses.replace(GREEDY, logit_bias={alone.token_ids[0]: -100.0}))[0]
    assert banned.token_ids[0] != alone.token_ids[0]
    with pytest.raises(ValueError, match="logit_bias must name token ids"):
        llm.generate([PROMPT], dataclasses.replace(GREEDY, logit_bias={10**6: 1.0}))
