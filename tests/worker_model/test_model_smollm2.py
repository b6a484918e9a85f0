"""The bundled real model (SmolLM2-135M-Instruct): conversion equals transformers' own GGUF reading, and our
runner's greedy output equals transformers' LlamaForCausalLM on the converted folder. Marked slow (~1-2 min)."""

from __future__ import annotations

import pytest
import torch
from worker.model.bundled import bundled_gguf_path, ensure_bundled
from worker.model.quality import compare, reference
from worker.model.runner import ModelRunner
from worker.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors and explain, in a short paragraph, why people like each of them so much; "
    "mention numbers 1, 2 and 3.",
]


@pytest.fixture(scope="module")
def smol_dir():
    """The converted folder from the shared cache ($LLMFLEET_CACHE_DIR or ~/.cache/llmfleet/models)."""
    return ensure_bundled(NAME)


@pytest.fixture(scope="module")
def smol_runner(smol_dir):
    return ModelRunner(str(smol_dir), num_blocks=96)


def chat_ids(tok: Tokenizer, question: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))


def test_conversion_matches_transformers_gguf_reader(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = bundled_gguf_path(NAME)
    ours = ensure_bundled(NAME, tmp_path)  # a fresh conversion, not the shared cache
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    theirs = ref.state_dict()
    mine = load_file(str(ours / "model.safetensors"))
    assert set(mine) == set(theirs) - {"lm_head.weight"}  # tied: transformers materialises the alias
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
    ref_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok = Tokenizer(ours)
    for text in [*QUESTIONS, "café 東京 😀\n\n  x=12345;", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tok.encode(text) == ref_tok.encode(text), text
    msgs = [{"role": "user", "content": QUESTIONS[0]}]
    expected = ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs) == expected
    assert tok.eos_token_id == ref_tok.eos_token_id == 2


def test_capital_of_france(smol_runner, driver_cls, seq_cls):
    ids = chat_ids(smol_runner.tokenizer, QUESTIONS[0])
    seq = seq_cls("fr", ids, 12)
    driver_cls(smol_runner).run([seq])
    eos = smol_runner.eos_token_id
    out = seq.output[: seq.output.index(eos)] if eos in seq.output else seq.output
    assert smol_runner.tokenizer.decode(out) == "The capital of France is Paris."


def test_greedy_matches_transformers_batched_chunked_and_prefix_cached(
    smol_dir, smol_runner, driver_cls, seq_cls, load_hf_fn, hf_greedy_fn
):
    hf = load_hf_fn(smol_dir)
    tok = smol_runner.tokenizer
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    n = 12
    expected = [hf_greedy_fn(hf, p, n) for p in prompts]
    drv = driver_cls(smol_runner)
    seqs = [seq_cls(f"r{i}", list(p), n) for i, p in enumerate(prompts)]
    drv.run(seqs, chunk=20)  # chunked prefill next to decodes
    assert [s.output for s in seqs] == expected
    # the shared system-prompt prefix served from another request's cached blocks
    holder = seq_cls("holder", list(prompts[0]), 1)
    drv.step([holder])
    shared = 1  # one block of 16 tokens: inside the shared system prompt
    assert prompts[1][: shared * 16] == prompts[0][: shared * 16]
    b = seq_cls("b", list(prompts[1]), n)
    b.blocks, b.computed = list(holder.blocks[:shared]), shared * 16
    drv.run([b])
    assert b.output == expected[1]


def test_quantized_variants_agree_with_fp32(smol_dir, smol_runner):
    tok = smol_runner.tokenizer
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]
    base = reference(smol_runner, prompts, max_tokens=12)
    for quant, floor, max_kl in (("int8", 0.9, 0.02), ("fp8", 0.85, 0.06), ("int4", 0.85, 0.05)):
        report = compare(base, ModelRunner(str(smol_dir), num_blocks=4, quantization=quant))
        assert report.agreement >= floor, (quant, report)
        assert report.mean_kl <= max_kl, (quant, report)
