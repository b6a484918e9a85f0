"""The engine on a CUDA device keeps the exactness the CPU tests prove: fp32 greedy output equals transformers'
(on the CPU) token for token however the steps are cut, a batch that mixes LoRA adapters and the base equals
transformers with each adapter merged, and the bf16 and fp8 variants agree with fp32 under teacher forcing.

Marked `gpu`: the default run (`make test`) deselects it and CI has no GPU. On a CUDA machine:
`python -m pytest -m gpu tests/worker_model/test_model_cuda.py`."""

from __future__ import annotations

import random

import pytest
import torch
from worker.core.request import SamplingParams
from worker.engine.llm import LLM
from worker.model.quality import compare, reference
from worker.model.runner import ModelRunner
from worker.model.testing import make_random_lora, merge_lora_into

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N_OUT = 12
GREEDY = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("chunk", [None, 5])
def test_fp32_greedy_equals_transformers(tiny_dir, tiny_hf, driver_cls, seq_cls, hf_greedy_fn, chunk):
    runner = ModelRunner(str(tiny_dir), device="cuda", num_blocks=128, block_size=4)
    assert runner.kv_cache.is_cuda and runner.native.decode is None  # the native kernel is CPU-only
    ps = prompts([1, 3, 17, 40, 91], runner.config.vocab_size)
    seqs = [seq_cls(f"r{i}", list(p), N_OUT) for i, p in enumerate(ps)]
    driver_cls(runner).run(seqs, chunk=chunk)
    assert [s.output for s in seqs] == [hf_greedy_fn(tiny_hf, p, N_OUT) for p in ps]


def test_mixed_lora_batch_equals_merged_transformers(tiny_dir, tmp_path, load_hf_fn, hf_greedy_fn):
    scales = {"a": 16 / 8, "b": 8 / 4}
    tensors = {
        "a": make_random_lora(tmp_path / "a", tiny_dir, rank=8, alpha=16, seed=1),
        "b": make_random_lora(tmp_path / "b", tiny_dir, rank=4, alpha=8, targets=("q_proj", "down_proj"), seed=2),
    }
    refs = {None: load_hf_fn(tiny_dir)}
    for name, t in tensors.items():
        refs[name] = load_hf_fn(tiny_dir)
        with torch.no_grad():
            merge_lora_into(refs[name].state_dict(), t, scales[name])
    llm = LLM(str(tiny_dir), device="cuda", enable_lora=True, max_loras=2, block_size=4, num_blocks=256)
    for name in tensors:
        llm.add_lora(name, str(tmp_path / name))
    ps = prompts([5, 9, 23, 4, 30, 12, 7, 18, 26], llm.engine.runner.vocab_size, seed=3)
    names = [None, "a", "b"] * 3
    outs = llm.generate(ps, GREEDY, lora=names)
    assert [o.token_ids for o in outs] == [hf_greedy_fn(refs[n], p, N_OUT) for p, n in zip(ps, names, strict=True)]


@pytest.mark.parametrize(
    ("dtype", "quantization", "floor"), [("bfloat16", None, 0.9), ("float32", "fp8", 0.75), ("float32", "int8", 0.9)]
)
def test_variants_agree_with_fp32(tiny_dir, dtype, quantization, floor):
    ref = ModelRunner(str(tiny_dir), device="cuda", num_blocks=16)
    cand = ModelRunner(str(tiny_dir), device="cuda", num_blocks=16, dtype=dtype, quantization=quantization)
    base = reference(ref, prompts([5, 17, 30], ref.config.vocab_size, seed=4), max_tokens=10)
    report = compare(base, cand)
    assert report.positions == 30 and report.agreement >= floor


def test_seeded_sampling_repeats_on_cuda(tiny_dir):
    llm = LLM(str(tiny_dir), device="cuda", block_size=4, num_blocks=64)
    p = prompts([8], llm.engine.runner.vocab_size, seed=5)[0]
    params = SamplingParams(max_tokens=N_OUT, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    first, again = (llm.generate([p], params)[0].token_ids for _ in range(2))
    assert first == again and len(first) == N_OUT
