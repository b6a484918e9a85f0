"""Greedy output of the ModelRunner equals transformers' LlamaForCausalLM (fp32) token for token, however the
steps are cut: mixed lengths in one batch, chunked prefill next to decodes, prefixes served from cached blocks,
recompute after preemption."""

from __future__ import annotations

import random

import pytest
import torch
from worker.model.runner import ModelRunner
from worker.model.testing import make_tiny_llama

N_OUT = 12


def prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths[:n]]


@pytest.fixture(scope="module", params=[False, True], ids=["native-decode", "eager"])
def runner(tiny_dir, request):
    r = ModelRunner(str(tiny_dir), num_blocks=128, block_size=4, enforce_eager=request.param)
    assert (r.native.decode is None) == request.param
    return r


@pytest.fixture(scope="module")
def cases(tiny_dir, tiny_hf, runner):
    ps = prompts(5, [1, 3, 17, 40, 91], runner.config.vocab_size)
    return ps, [hf_greedy_ref(tiny_hf, p) for p in ps]


def hf_greedy_ref(model, prompt):
    out, past, x = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(N_OUT):
            o = model(x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            out.append(int(o.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def test_batched_requests_of_very_different_lengths(runner, cases, driver_cls, seq_cls):
    ps, expected = cases
    seqs = [seq_cls(f"r{i}", list(p), N_OUT) for i, p in enumerate(ps)]
    driver_cls(runner).run(seqs)
    assert [s.output for s in seqs] == expected


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_mixed_with_decodes(runner, cases, driver_cls, seq_cls, chunk):
    ps, expected = cases
    seqs = [seq_cls(f"r{i}", list(p), N_OUT) for i, p in enumerate(ps)]
    driver_cls(runner).run(seqs, chunk=chunk)
    assert [s.output for s in seqs] == expected


def test_staggered_arrivals_mix_prefill_chunks_and_decodes_in_one_step(runner, cases, driver_cls, seq_cls):
    ps, expected = cases
    drv = driver_cls(runner)
    seqs = [seq_cls(f"r{i}", list(p), N_OUT) for i, p in enumerate(ps)]
    active: list = []
    for step in range(200):
        if step % 3 == 0 and len(active) < len(seqs):
            active.append(seqs[len(active)])  # a new request joins while others decode
        todo = [s for s in active if not s.done]
        if not todo and len(active) == len(seqs):
            break
        if todo:
            drv.step(todo, chunk=7)
    assert [s.output for s in seqs] == expected


def test_prefix_served_from_cached_blocks(runner, tiny_hf, driver_cls, seq_cls):
    bs = runner.block_size
    vocab = runner.config.vocab_size
    shared = prompts(1, [6 * bs], vocab, seed=1)[0]
    a_prompt = shared + prompts(1, [5], vocab, seed=2)[0]
    b_prompt = shared + prompts(1, [9], vocab, seed=3)[0]
    drv = driver_cls(runner)
    a = seq_cls("a", list(a_prompt), N_OUT)
    drv.step([a])  # prefill A: its first 6 blocks now hold the shared prefix
    b = seq_cls("b", list(b_prompt), N_OUT)
    b.blocks = list(a.blocks[:6])  # B reuses them (same block ids), starting at position 6 * bs
    b.computed = 6 * bs
    drv.run([a, b])
    assert a.output == hf_greedy_ref(tiny_hf, a_prompt)
    assert b.output == hf_greedy_ref(tiny_hf, b_prompt)


def test_recompute_after_preemption(runner, cases, driver_cls, seq_cls):
    ps, expected = cases
    drv = driver_cls(runner)
    seqs = [seq_cls(f"r{i}", list(p), N_OUT) for i, p in enumerate(ps)]
    for _ in range(5):
        drv.step([s for s in seqs if not s.done])
    victim = seqs[3]
    drv.preempt(victim)
    others = [s for s in seqs if s is not victim]
    for _ in range(3):  # the victim's freed blocks get reused (overwritten) by a new request meanwhile
        intruder = seq_cls("x", prompts(1, [30], runner.config.vocab_size, seed=9)[0], 1)
        drv.step([intruder, *[s for s in others if not s.done]])
        drv.release(intruder)
    drv.run(seqs, chunk=9)  # the victim recomputes prompt + its 5 outputs in chunks, then continues
    assert [s.output for s in seqs] == expected


@pytest.mark.parametrize(
    "sizes",
    [
        {"num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 48, "tie_word_embeddings": True},
        {
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "hidden_size": 60,
            "intermediate_size": 37,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "hidden_size": 40,
            "head_dim": 32,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ],
    ids=["mha-tied", "gqa3-llama3-rope", "explicit-head-dim-linear-rope"],
)
def test_model_variants_match_reference(tmp_path, sizes, load_hf_fn, driver_cls, seq_cls):
    path = make_tiny_llama(tmp_path, num_hidden_layers=2, seed=5, **sizes)
    ref = load_hf_fn(path)
    runner = ModelRunner(str(path), num_blocks=64, block_size=16)
    ps = prompts(3, [2, 33, 70], runner.config.vocab_size, seed=4)
    seqs = [seq_cls(f"r{i}", list(p), N_OUT) for i, p in enumerate(ps)]
    driver_cls(runner).run(seqs, chunk=24)
    assert [s.output for s in seqs] == [hf_greedy_ref(ref, p) for p in ps]


def test_logits_close_to_reference(runner, tiny_hf):
    """Beyond argmax: the full next-token distribution matches (fp32 rounding only)."""
    from worker.core.outputs import ScheduledSeq, SchedulerOutput
    from worker.core.request import SamplingParams

    p = prompts(1, [23], runner.config.vocab_size, seed=7)[0]
    meta_seq = ScheduledSeq("l", p, 0, list(range(6)), True, SamplingParams(temperature=0.0, logprobs=True))
    out = runner.execute_model(SchedulerOutput([meta_seq], len(p), finished_req_ids=frozenset()))
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf(torch.tensor([p])).logits[0, -1], -1)
    tok = out.sampled_token_ids["l"]
    assert tok == int(ref.argmax())
    assert out.logprobs["l"] == pytest.approx(float(ref[tok]), abs=1e-4)
    runner.execute_model(SchedulerOutput([], 0, finished_req_ids=frozenset({"l"})))


def test_offline_helpers_match_reference(runner, tiny_hf, cases):
    ps, expected = cases
    assert runner.greedy(ps[3], N_OUT) == expected[3]
    with torch.no_grad():
        ref = tiny_hf(torch.tensor([ps[3]])).logits[0]
    assert torch.allclose(runner.score(ps[3]), ref, atol=1e-4)
    with pytest.raises(ValueError, match="tokens"):
        runner.score([])


def test_missing_or_misshapen_weights_are_clear_errors(tiny_dir):
    from worker.model.config import ModelConfig
    from worker.model.llama import LlamaModel
    from worker.model.loader import load_weights

    cfg = ModelConfig.from_dir(tiny_dir)
    weights = load_weights(tiny_dir, torch.float32)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj\.weight"):
        LlamaModel(cfg, weights)
    weights = load_weights(tiny_dir, torch.float32)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:-1]
    with pytest.raises(ValueError, match="embed_tokens has shape"):
        LlamaModel(cfg, weights)


def test_no_weights_in_folder(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(str(tmp_path), enforce_eager=True)
