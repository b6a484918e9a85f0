"""Gate+up with SiLU in the linear's epilogue (`gated_linear`): the fused gate+up linear on panels and `silu_and_mul`
in one pass must give the two calls' output bit for bit (fp32 and bf16 panels, with and without bias, across blocks
and passes of rows), and refuse gate and up columns that do not fill whole panels. A model's use of it
(LlamaModel.gated_mlp, for every panel kind) is tested beside the decode stack (test_model_decode_stack.py). Skipped
on CPUs where the panels do not run."""

from __future__ import annotations

import pytest
import torch
from worker.model import kernels
from worker.model.linear import PanelLinear
from worker.model.llama import stack_operands


def _module():
    module, why = kernels._load_module()
    if module is None or not module.f32_panels_ready():
        pytest.skip(f"the panels do not run here ({why or 'no AVX2 + FMA'})")
    return module


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
    got = module.gated_linear(x, *stack_operands(lin), 2 * inter)
    assert got.shape == (rows, inter) and got.dtype == dtype
    assert torch.equal(got, module.silu_and_mul(lin(x)))


def test_gated_linear_refuses_gate_and_up_that_do_not_fill_whole_panels():
    module = _module()
    cols = module.f32_panel_cols()
    inter = cols + 16  # gate's last panel would hold up's first columns
    assert not module.gated_cols(2 * inter) and module.gated_cols(2 * cols)
    lin = PanelLinear(torch.randn(2 * inter, 32), None, module)
    with pytest.raises(RuntimeError, match="whole panels"):
        module.gated_linear(torch.randn(3, 32), *stack_operands(lin), 2 * inter)
