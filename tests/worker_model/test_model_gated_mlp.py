"""Gate+up with SiLU in the linear's epilogue (`gated_linear`, LlamaModel.gated_mlp): the fused gate+up linear on
panels and `silu_and_mul` in one pass must give the two calls' output bit for bit, for every panel kind the decode
stack multiplies by (fp32, bf16, a bf16 model's int8/fp8 codes and int4 groups), across passes of rows; a model
takes it only where gate's and up's columns each fill whole panels, and the same tokens, logprobs and cache come
out with it as without it. Skipped on CPUs where the panels do not run."""

from __future__ import annotations

import pytest
import torch
from worker.model import kernels
from worker.model.linear import PanelLinear
from worker.model.runner import ModelRunner
from worker.model.testing import add_projection_biases, make_tiny_llama

SIZES = dict(hidden_size=128, intermediate_size=192, num_attention_heads=2, num_key_value_heads=1, init_std=0.1)


def _module():
    module, why = kernels._load_module()
    if module is None or not module.f32_panels_ready():
        pytest.skip(f"the panels do not run here ({why or 'no AVX2 + FMA'})")
    return module


def _operands(lin) -> list[torch.Tensor]:
    return [torch.empty(0) if t is None else t for t in lin.stack_operands()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 5, 9, 64, 257, 600])  # one block, blocks, one pass, passes with a short last
def test_gated_linear_is_the_linear_then_silu_and_mul_bit_for_bit(dtype, bias, rows):
    module = _module()
    if dtype == torch.bfloat16 and not module.bf16_panels_ready():
        pytest.skip("this CPU has no AVX512-BF16")
    gen = torch.Generator().manual_seed(rows)
    inter, k = 2 * module.f32_panel_cols(), 96
    w = torch.randn(2 * inter, k, generator=gen) * 0.1
    b = torch.randn(2 * inter, generator=gen) if bias else None
    lin = PanelLinear(w.to(dtype), b, module)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    got = module.gated_linear(x, *_operands(lin), 2 * inter)
    assert got.shape == (rows, inter) and got.dtype == dtype
    assert torch.equal(got, module.silu_and_mul(lin(x)))


def test_gated_linear_refuses_gate_and_up_that_do_not_fill_whole_panels():
    module = _module()
    cols = module.f32_panel_cols()
    inter = cols + 16  # gate's last panel would hold up's first columns
    assert not module.gated_cols(2 * inter) and module.gated_cols(2 * cols)
    lin = PanelLinear(torch.randn(2 * inter, 32), None, module)
    with pytest.raises(RuntimeError, match="whole panels"):
        module.gated_linear(torch.randn(3, 32), *_operands(lin), 2 * inter)


class _Counting:
    """The extension with its `gated_linear` calls counted; everything else passes through."""

    def __init__(self, fused) -> None:
        self._fused = fused
        self.calls = 0

    def gated_linear(self, *args):
        self.calls += 1
        return self._fused.gated_linear(*args)

    def __getattr__(self, name: str):
        return getattr(self._fused, name)


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "bias"])
def tiny_path(request, tmp_path_factory):
    root = make_tiny_llama(tmp_path_factory.mktemp("gated"), num_hidden_layers=3, **SIZES)
    return add_projection_biases(root) if request.param else root


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [("float32", None), ("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "fp8"), ("bfloat16", "int4")],
)
def test_a_gated_model_gives_the_same_tokens_logprobs_and_cache(tiny_path, dtype, quantization, driver_cls, seq_cls):
    gated = ModelRunner(str(tiny_path), num_blocks=64, dtype=dtype, quantization=quantization)
    if gated.model.gated_mlp is None:
        pytest.skip(f"no gated MLP for {dtype} {quantization} here (on {gated.model.linear_kernel})")
    plain = ModelRunner(str(tiny_path), num_blocks=64, dtype=dtype, quantization=quantization)
    plain.model.gated_mlp = None
    counting = _Counting(gated.model.fused)
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
    _module()
    sizes = {**SIZES, "intermediate_size": 176}  # 16k (the fused steps run), not 48k
    runner = ModelRunner(str(make_tiny_llama(tmp_path, num_hidden_layers=2, **sizes)), num_blocks=16)
    assert runner.model.gated_mlp is None
