"""Speculative decoding on the real torch runner: greedy output token-identical with and without it (mixed batch,
prefix cache, preemption), seeded sampling reproducible and equal too, and the verification sampler's
distribution (rejection sampling with a point-mass draft) checked on a small vocabulary with a fixed seed.
"""

from __future__ import annotations

import pytest
import torch
from worker import LLM
from worker.core.config import SpeculativeConfig
from worker.core.request import SamplingParams
from worker.model.sampler import Sampler, SampleRequest

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, disable_by_batch_size=8)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "Hello, world! How are you today? Hello, world! How",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Numbers: 0 1 2 3",
]


def params_for(i: int) -> SamplingParams:
    if i % 5 == 3:  # logprobs: not speculated, shares the batch with speculating requests
        return SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True)
    if i % 5 == 4:  # seeded sampling
        return SamplingParams(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True)
    return SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=i % 2 == 0, min_tokens=2)


CONFIGS = {
    "batched": dict(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=256),
    "chunked": dict(max_num_seqs=4, max_num_batched_tokens=12, num_blocks=256),
    "tight-memory": dict(max_num_seqs=5, max_num_batched_tokens=96, num_blocks=40),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_outputs_equal_decoding_without_speculation(name: str, tiny_dir) -> None:
    cfg = dict(block_size=4, **CONFIGS[name])
    plain = LLM(str(tiny_dir), **cfg)
    spec = LLM(str(tiny_dir), speculative=SPEC, **cfg)
    params = [params_for(i) for i in range(len(PROMPTS))]
    for _ in range(2):  # the second round is served partly from the prefix cache
        expected = plain.generate(PROMPTS, params)
        got = spec.generate(PROMPTS, params)
        for e, g in zip(expected, got, strict=True):
            assert g.token_ids == e.token_ids, e.prompt_token_ids
            assert (g.text, g.finish_reason) == (e.text, e.finish_reason)
            assert (g.logprobs is None) == (e.logprobs is None)
            assert g.logprobs is None or g.logprobs == pytest.approx(e.logprobs, abs=1e-4)  # batch-size rounding
    stats = spec.engine.stats()
    assert stats.spec_decode is not None and stats.spec_decode.num_accepted_tokens > 0
    if name == "tight-memory":
        assert stats.num_preemptions_total > 0
    pool = spec.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_seeded_sampling_with_speculation_is_reproducible(tiny_dir) -> None:
    llm = LLM(str(tiny_dir), speculative=SPEC, block_size=4, num_blocks=128)
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=1234, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(list(reversed(PROMPTS)), params)
    assert [o.token_ids for o in first] == [o.token_ids for o in reversed(again)]


def _sample_many(logits: torch.Tensor, drafts: list[int], n: int, seed: int) -> list[list[int]]:
    sampler = Sampler(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    req = SampleRequest(SamplingParams(temperature=1.0, max_tokens=8), gen)
    return [sampler.verify(logits.clone(), drafts, req) for _ in range(n)]


def test_verification_preserves_the_target_distribution() -> None:
    """Rejection sampling with a point-mass draft d: P(first token = x) = p(x) for every x (d accepted with
    probability p(d), otherwise a draw from p without d); after an accepted draft the next position is p' again.
    Fixed seeds make the counts deterministic; the tolerance is about 4 standard errors for 20k draws."""
    p0 = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])
    p1 = torch.tensor([0.30, 0.10, 0.10, 0.20, 0.30])
    logits = torch.stack([p0.log(), p1.log(), p1.log()])
    n = 20_000
    draws = _sample_many(logits, drafts=[1, 4], n=n, seed=2024)
    first = torch.bincount(torch.tensor([d[0] for d in draws]), minlength=5).float() / n
    assert torch.allclose(first, p0, atol=0.015), first
    accepted = [d for d in draws if d[0] == 1]
    assert abs(len(accepted) / n - 0.40) < 0.015
    second = torch.bincount(torch.tensor([d[1] for d in accepted]), minlength=5).float() / len(accepted)
    assert torch.allclose(second, p1, atol=0.02), second
    # a rejected first draft: the residual, p0 without token 1, renormalised
    rejected = [d[0] for d in draws if d[0] != 1]
    residual = torch.bincount(torch.tensor(rejected), minlength=5).float() / len(rejected)
    expected = p0.clone()
    expected[1] = 0
    assert torch.allclose(residual, expected / expected.sum(), atol=0.015), residual
    assert all(len(d) == 1 for d in draws if d[0] != 1)  # nothing after a rejection


def test_verification_draws_once_per_produced_token() -> None:
    """A seeded request's random stream advances by exactly the tokens it gains, so plain decoding with the same
    seed produces the same tokens."""
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(5))
    gen_spec, gen_plain = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    sampler = Sampler(torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, max_tokens=8)
    plain_first = sampler(logits[:1].clone(), [SampleRequest(params, gen_plain)]).tokens[0]
    got = sampler.verify(logits.clone(), [plain_first, 3, 3], SampleRequest(params, gen_spec))
    assert got[0] == plain_first
    # the streams are in the same state after as many draws as tokens produced
    for i in range(1, len(got)):
        assert sampler(logits[i : i + 1].clone(), [SampleRequest(params, gen_plain)]).tokens[0] == got[i]
    assert torch.equal(gen_spec.get_state(), gen_plain.get_state())


def test_verification_applies_min_tokens_per_position() -> None:
    """The EOS ban of min_tokens lifts at the position where plain decoding would lift it."""
    eos = 2
    logits = torch.zeros(3, 5)
    logits[:, eos] = 10.0  # EOS is the greedy choice everywhere unless banned
    logits[:, 4] = 5.0
    req = SampleRequest(SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2), None, 1, eos)
    # output index 1 is still banned (1 < 2): token 4; at index 2 EOS is allowed
    assert Sampler(torch.Generator()).verify(logits, [4, 4], req) == [4, eos]


def test_speculation_with_lora_adapters_is_exact(tiny_dir, tmp_path) -> None:
    """Drafts of requests on different adapters (and the base) are verified with each one's own weights."""
    from worker.model.testing import make_random_lora

    make_random_lora(tmp_path / "a", tiny_dir, rank=4, alpha=8, seed=3)
    args = dict(enable_lora=True, max_loras=2, block_size=4, num_blocks=256)
    plain = LLM(str(tiny_dir), **args)
    spec = LLM(str(tiny_dir), speculative=SPEC, **args)
    for llm in (plain, spec):
        llm.add_lora("a", str(tmp_path / "a"))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    loras = ["a", None, "a", None, "a"]
    expected = plain.generate(PROMPTS, params, lora=loras)
    got = spec.generate(PROMPTS, params, lora=loras)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0
