"""A pure decode step runs its decoder layers in one native call (`decode_layers`, LlamaModel.decode_stack) where
every linear runs on panels and the fused steps are native: the same calls in the same order as the layer-by-layer
Python path, so the same tokens, logprobs and KV cache, bit for bit, in fp32 and bf16, int8, fp8 and int4 (a bf16
model's codes on the pair panels, an fp32 model's on the fp32 panels, as a CPU without AVX512-BF16 runs them:
`testing.Fp32PanelsOnly`), with and without projection biases. Steps with a prompt chunk stay on the Python path,
and so do an fp32 model's quantized layers on the pair panels (their activations rounded to bf16 on the way in). Gate+up with
SiLU in its epilogue (LlamaModel.gated_mlp: `gated_linear` from Python, the stack's gated passes) gives the same
bits as gate+up then SiLU, on the same panel kinds; a model takes it only where gate's and up's columns each fill
whole panels. Skipped on CPUs where the panels or the fused steps do not run (there the model has no stack)."""

from __future__ import annotations

import pytest
import torch
from worker.model.runner import ModelRunner
from worker.model.testing import Fp32PanelsOnly, add_projection_biases, make_tiny_llama

SIZES = dict(hidden_size=128, intermediate_size=192, num_attention_heads=2, num_key_value_heads=1, init_std=0.1)


def _runner(path, dtype: str, quantization: str | None = None) -> ModelRunner:
    """A runner whose model has the stack (skipped where it has none); an fp32 model's quantized layers on the fp32
    code panels (`fp32_code_panels_only`)."""
    runner = ModelRunner(str(path), num_blocks=64, dtype=dtype, quantization=quantization)
    fused = runner.model.fused
    assert dtype == "bfloat16" or fused is None or isinstance(fused, Fp32PanelsOnly)  # the fixture took hold
    if runner.model.decode_stack is None:
        pytest.skip(f"no native decode stack for {dtype} {quantization} here (on {runner.model.linear_kernel})")
    return runner


def _decode(runner: ModelRunner, prompts: list[list[int]], driver_cls, seq_cls) -> list:
    seqs = [seq_cls(f"r{i}", list(p), max_tokens=6 + i) for i, p in enumerate(prompts)]
    driver_cls(runner).run(seqs)
    return seqs


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "bias"])
def tiny_path(request, tmp_path_factory):
    """The tiny Llama (3 layers, head dim 64), with or without biases on every projection (as a Qwen2- or
    Llama-with-bias checkpoint has them)."""
    root = make_tiny_llama(tmp_path_factory.mktemp("stack"), num_hidden_layers=3, **SIZES)
    return add_projection_biases(root) if request.param else root


@pytest.fixture(autouse=True)
def fp32_code_panels_only(monkeypatch):
    """The runners' extension as a CPU without AVX512-BF16 (and AMX) sees it wherever a test builds an fp32 model with
    quantized layers: they take the fp32 code panels (`panel_linear_i8` / `_fp8` / `_int4`), which such CPUs run,
    rather than the pair panels; bf16 models and dense ones are untouched (Fp32PanelsOnly only refuses bf16 panels
    an fp32 model's codes would take)."""
    import worker.model.runner as runner_module

    load = runner_module.load_fused_ops

    def fp32_panels_only(dtype, *sizes):
        fused, why = load(dtype, *sizes)
        return (Fp32PanelsOnly(fused) if fused is not None and dtype == torch.float32 else fused), why

    monkeypatch.setattr(runner_module, "load_fused_ops", fp32_panels_only)
    monkeypatch.setattr(runner_module, "load_quant_amx_ops", lambda *a: (None, "not in these tests"))


# the panel kinds the stack multiplies by: fp32 and bf16 panels, int8/fp8 codes and int4 groups on either
PANEL_KINDS = [
    ("float32", None),
    ("bfloat16", None),
    ("bfloat16", "int8"),
    ("bfloat16", "fp8"),
    ("bfloat16", "int4"),
    ("float32", "int8"),
    ("float32", "fp8"),
    ("float32", "int4"),
]


@pytest.mark.parametrize(("dtype", "quantization"), PANEL_KINDS)
def test_the_stack_gives_the_python_paths_tokens_logprobs_and_cache_bit_for_bit(
    tiny_path, dtype, quantization, driver_cls, seq_cls, counting_cls
):
    stacked, python = _runner(tiny_path, dtype, quantization), _runner(tiny_path, dtype, quantization)
    python.model.decode_stack = None
    counting = counting_cls(stacked.model.fused, "decode_layers")
    stacked.model.fused = counting
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, stacked.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 40, 1)]
    got = _decode(stacked, prompts, driver_cls, seq_cls)
    want = _decode(python, prompts, driver_cls, seq_cls)
    assert counting.calls > 0  # the decode steps ran on the stack
    assert [s.output for s in got] == [s.output for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]
    for (k1, v1), (k2, v2) in zip(stacked.kv_caches, python.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_only_pure_decode_steps_take_the_stack(tiny_path, driver_cls, seq_cls, counting_cls):
    runner = _runner(tiny_path, "bfloat16")
    counting = counting_cls(runner.model.fused, "decode_layers")
    runner.model.fused = counting
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, runner.config.vocab_size, (30,), generator=gen).tolist()
    driver = driver_cls(runner)
    seqs = [seq_cls("a", list(prompt), max_tokens=4)]
    driver.step(seqs)  # the prompt: no stack
    assert counting.calls == 0
    driver.step(seqs)  # one decode row: the stack
    assert counting.calls == 1
    seqs.append(seq_cls("b", list(prompt[:9]), max_tokens=4))
    driver.step(seqs)  # a decode row beside a prompt: no stack
    assert counting.calls == 1
    driver.step(seqs)  # two decode rows
    assert counting.calls == 2


@pytest.mark.parametrize("quantization", ["int8", "fp8", "int4"])
def test_an_fp32_models_quantized_layers_on_the_pair_panels_have_no_stack(tiny_path, quantization, monkeypatch):
    monkeypatch.undo()  # the extension as this CPU has it
    runner = ModelRunner(str(tiny_path), num_blocks=64, quantization=quantization)
    path = runner.model.layers[0].qkv.path
    if "pair panels" not in path:
        pytest.skip(f"no pair panels here: {path}")
    assert runner.model.decode_stack is None and runner.model.gated_mlp is None


@pytest.mark.parametrize(("dtype", "quantization"), PANEL_KINDS)
def test_a_gated_model_gives_the_same_tokens_logprobs_and_cache(
    tiny_path, dtype, quantization, driver_cls, seq_cls, counting_cls
):
    gated = ModelRunner(str(tiny_path), num_blocks=64, dtype=dtype, quantization=quantization)
    if gated.model.gated_mlp is None:
        pytest.skip(f"no gated MLP for {dtype} {quantization} here (on {gated.model.linear_kernel})")
    plain = ModelRunner(str(tiny_path), num_blocks=64, dtype=dtype, quantization=quantization)
    plain.model.gated_mlp = None
    counting = counting_cls(gated.model.fused, "gated_linear")
    gated.model.fused = counting
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, gated.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 300, 1)]
    got = [seq_cls(f"r{i}", list(p), max_tokens=6 + i) for i, p in enumerate(prompts)]
    want = [seq_cls(f"r{i}", list(p), max_tokens=6 + i) for i, p in enumerate(prompts)]
    driver_cls(gated).run(got)
    driver_cls(plain).run(want)
    assert counting.calls > 0  # the prompt steps (Python path) ran gated
    assert [s.output for s in got] == [s.output for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]
    for (k1, v1), (k2, v2) in zip(gated.kv_caches, plain.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_model_whose_gate_and_up_do_not_fill_whole_panels_runs_them_apart(tmp_path):
    sizes = {**SIZES, "intermediate_size": 176}  # 16k (the fused steps run), not 48k
    runner = ModelRunner(str(make_tiny_llama(tmp_path, num_hidden_layers=2, **sizes)), num_blocks=16)
    if runner.model.decode_stack is None:
        pytest.skip(f"no panels here (on {runner.model.linear_kernel})")
    assert runner.model.gated_mlp is None  # on panels, yet gate's last panel would hold up's first columns
