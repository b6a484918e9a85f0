"""int8, fp8 and int4 weight-only linears: exact dequantization conventions, bounded error, memory saving, and
greedy-token agreement with the unquantized model above a floor."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from worker.model.linear import DenseLinear
from worker.model.quality import compare, reference
from worker.model.quant import (
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    fp8_to_fp16,
    int4_group_size,
    make_linear,
    quantize_int4,
    quantize_int8,
)
from worker.model.runner import ModelRunner
from worker.model.testing import (
    Fp32PanelsOnly,
    fp8_grid,
    int4_grid,
    int16_activations,
    int16_rounding,
    make_tiny_llama,
)

GEN = torch.Generator().manual_seed(0)


def test_fp8_bit_trick_is_exact_for_every_finite_value():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w8 = codes.view(torch.float8_e4m3fn)
    ref = w8.to(torch.float32)
    finite = ~ref.isnan()
    got = fp8_to_fp16(w8).to(torch.float32) * 2.0**8
    assert torch.equal(got[finite], ref[finite])


def _computes_with_its_dequantized_weights(cls, w: torch.Tensor, dtype: torch.dtype):
    """A `cls` layer over w with a bias: its output is F.linear with its own dequantized weights (to dtype's
    precision); returns the layer."""
    b = torch.randn(w.shape[0], generator=GEN)
    lin = cls(w, b.to(dtype), dtype)
    x = torch.randn(5, w.shape[1], generator=GEN).to(dtype)
    ref = F.linear(x.float(), lin.dequantize(), b)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(lin(x).float(), ref, atol=tol, rtol=tol)
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_its_dequantized_weights(dtype):
    w = torch.randn(40, 64, generator=GEN) * 0.1
    lin = _computes_with_its_dequantized_weights(Fp8Linear, w, dtype)
    # and fp8 itself is close to the original weights: e4m3 has a 3-bit mantissa (relative step 1/8)
    assert (lin.dequantize() - w).abs().max() <= w.abs().max() / 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_its_dequantized_weights(dtype):
    w = torch.randn(40, 64, generator=GEN) * 0.1
    w[3] = 0.0  # an all-zero row gets codes 0, not NaN
    lin = _computes_with_its_dequantized_weights(Int8Linear, w, dtype)
    # symmetric per row: each weight within half a step (the row's max |w| / 127) of its original, each row's
    # largest weight exactly +-127 steps
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((lin.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().amax(1)[[0, 1, 2, 4]].eq(127).all() and not q[3].any()
    assert torch.equal(lin.weight, q) and torch.equal(lin.scale, scale)


@pytest.mark.parametrize("k,expected", [(576, 32), (1536, 32), (96, 32), (64, 32), (192, 32)])
def test_int4_group_size(k, expected):
    assert int4_group_size(k) == expected


@pytest.mark.parametrize("k", [72, 80, 100])
def test_int4_group_size_rejects_odd_widths(k):
    with pytest.raises(ValueError, match="divisible"):
        int4_group_size(k)


def test_int4_kernel_convention_matches_reference_dequantization():
    w = torch.randn(48, 128, generator=GEN)
    lin = Int4Linear(w, None, torch.float32)
    q, scale, zero = quantize_int4(w, lin.group_size)
    g = lin.group_size
    ref_w = (q.float() - 8) * scale.repeat_interleave(g, 1) + zero.repeat_interleave(g, 1)
    # scales are stored in bf16 for the kernel; the reference uses fp32 ones
    assert torch.allclose(lin.dequantize(), ref_w, atol=0.05 * w.abs().max().item())
    # group-wise int4: error within about half a quantization step (plus bf16 scale rounding)
    step = scale.repeat_interleave(g, 1)
    assert ((lin.dequantize() - w).abs() <= 0.6 * step + 0.02).all()
    x = torch.randn(7, 128, generator=GEN)
    ref = F.linear(x.bfloat16().float(), lin.dequantize())  # the kernel reads activations in bf16
    assert torch.allclose(lin(x), ref, atol=0.02 * ref.abs().max().item())


@pytest.mark.parametrize("quant,max_ratio", [("int8", 0.27), ("fp8", 0.27), ("int4", 0.17)])
def test_quantized_linears_save_memory(quant, max_ratio):
    w = torch.randn(256, 512, generator=GEN)
    dense = DenseLinear(w)
    q = make_linear(w, None, quant, torch.float32)
    assert q.nbytes <= max_ratio * dense.nbytes


def test_unknown_quantization_is_rejected():
    with pytest.raises(ValueError, match="unknown quantization"):
        make_linear(torch.zeros(2, 2), None, "int3", torch.float32)


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory):
    # Widths divisible by 32 so int4 groups fit; realistic init spread so quantization error is representative.
    return make_tiny_llama(
        tmp_path_factory.mktemp("q"),
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        init_std=0.08,
        seed=3,
    )


# A random model has flat next-token distributions (near-ties everywhere), so floors here are loose; broken
# quantization scores ~1/vocab agreement and KL of nats. SmolLM2 gets tighter floors in test_model_smollm2.py.
@pytest.mark.parametrize("quant,floor,max_kl", [("int8", 0.9, 0.002), ("fp8", 0.75, 0.02), ("int4", 0.5, 0.2)])
def test_quantized_model_agrees_with_unquantized(quant_dir, quant, floor, max_kl):
    ref = ModelRunner(str(quant_dir), num_blocks=8)
    cand = ModelRunner(str(quant_dir), num_blocks=8, quantization=quant)
    assert cand.weight_bytes < ref.weight_bytes
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, ref.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    base = reference(ref, prompts, max_tokens=10)
    report = compare(base, cand)
    assert report.positions == 30
    assert report.agreement >= floor
    assert report.mean_kl <= max_kl
    same = compare(base, ref)
    assert same.agreement == 1.0 and same.mean_kl == pytest.approx(0.0, abs=1e-6)


class _GemvOnly:
    """The extension's answer to how many rows its GEMV takes (all `direct_rows` asks of it)."""

    def gemv_max_rows(self) -> int:
        return 8


@pytest.mark.parametrize(
    ("native", "kernel", "shape", "want"),
    [
        (None, "amx_bf16", (32, 64), (0, False)),  # no extension: dequantized tiles at every size
        (_GemvOnly(), "amx_bf16", (32, 64), (256, True)),  # the dense linears on AMX: so are these, to 256 rows
        (_GemvOnly(), "amx_bf16", (24, 64), (8, False)),  # a shape the AMX kernel does not take: the GEMV
        (_GemvOnly(), "amx_bf16", (32, 48), (8, False)),
        (_GemvOnly(), "onednn_bf16", (32, 64), (8, False)),  # no AMX: the GEMV to 8 rows
        (_GemvOnly(), "aten", (32, 64), (8, False)),
    ],
)
def test_which_batches_multiply_the_quantized_weight_directly(native, kernel, shape, want):
    from worker.model.quant import direct_rows

    assert direct_rows(native, kernel, torch.zeros(shape)) == want


@pytest.mark.parametrize("quant", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_an_fp32_models_quantized_layer_runs_its_products_in_bf16_on_amx(amx, quant, rows):
    """Activations rounded to bf16 on the way in, the output widened on the way out: the bf16 layer's result, and
    the product with the layer's weights to bf16's precision."""
    from worker.model.quant import Bf16Inside

    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(3072, 576, generator=gen) * 0.05
    layer = make_linear(w, None, quant, torch.float32, amx=amx)
    assert isinstance(layer, Bf16Inside)
    x = torch.randn(rows, 576, generator=gen)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 3072)
    assert torch.equal(y, layer.inner(x.bfloat16()).float())
    want = x @ layer.dequantize(torch.float32).t()
    assert ((y - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize(
    ("dtype", "quant", "sizes", "why"),
    [
        (torch.bfloat16, "fp8", (576, 1536, 64), "not an fp32 model"),
        (torch.float32, None, (576, 1536, 64), "not an fp32 model"),
        (torch.float32, "int4", (72, 100, 12), "sizes of 32k"),  # the tiny test model's
    ],
)
def test_quantized_fp32_models_say_why_their_products_stay_fp32(amx, dtype, quant, sizes, why):
    from worker.model.kernels import load_quant_amx_ops

    ops, reason = load_quant_amx_ops(dtype, quant, *sizes)
    assert ops is None and why in reason
    assert load_quant_amx_ops(torch.float32, "fp8", 576, 1536, 64)[0] is amx


@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize(
    ("rows", "out_features", "bias"),
    [
        (1, 50, True),  # one row, a part-filled panel
        (2, 96, False),  # the int16 path's lone blocks take all 48 columns at once
        (3, 96, False),  # an AVX2 block's tail
        (8, 144, True),  # an AVX-512 block; the int16 path's first pass widened into its pair scratch
        (31, 50, False),  # the last pass widened in registers
        (32, 96, True),  # the first widened into the fp32 scratch
        (300, 112, True),  # a pass and a half, streaming stores
    ],
)
def test_an_fp32_models_one_byte_layers_multiply_their_codes_on_the_panels(
    fp32_code_panels, quant, rows, out_features, bias
):
    """int8 and fp8 codes packed in panels, widened in the kernel, the scales and the bias applied to its sums: the
    product with the layer's own dequantized weights, to fp32's rounding; int8 on AVX2 hosts, which multiply int16
    activations, also within half an int16 step of each input times its weights; fp8 there, whose weights go on an
    int16 grid too, the product of x's int16 values with the grid (`fp8_grid`)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 200, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if bias else None
    panels = fp32_code_panels
    layer = make_linear(w, b, quant, torch.float32, "panels_fp32", panels)
    plain = make_linear(w, b, quant, torch.float32)  # torch's ops over the same codes
    assert layer.weight.dim() == 3 and layer.weight.shape[1:] == (200, panels.f32_panel_cols())
    assert torch.equal(layer.dequantize(), plain.dequantize())
    x = torch.randn(rows, 200, generator=gen)
    exact = x.double() @ layer.dequantize().double().t() + (0 if b is None else b.double())
    rounding = 0.0 if quant == "fp8" else int16_rounding(x, layer.dequantize())
    if quant == "fp8" and panels.panel_codes_int16(200):
        exact = int16_activations(x) @ fp8_grid(layer.weight, layer.scale)[0].t() + (0 if b is None else b.double())
    y = layer(x)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() - rounding).max().item() < 1e-5
    assert torch.equal(layer(x.view(1, rows, 200)), y.view(1, rows, out_features))  # batched rows: the same


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 40, 300])
def test_avx2_hosts_int8_panels_multiply_the_activations_int16_codes(fp32_code_panels, rows):
    """On AVX2 hosts the int8 panels quantize x per row and 64-input chunk to int16 and sum the products exactly
    in int32: the product of those int16 values with the dequantized weights, to fp32's rounding. (x's inputs
    span 1e-3 to 1e2 so that the chunks' scales differ; 1000 inputs end in a part chunk.)"""
    if fp32_code_panels.vector_isa() != "avx2":
        pytest.skip("the int16 activations are the AVX2 path's (AVX-512 hosts widen the codes to fp32)")
    gen = torch.Generator().manual_seed(rows)
    layer = make_linear(
        torch.randn(96, 1000, generator=gen), None, "int8", torch.float32, "panels_fp32", fp32_code_panels
    )
    x = torch.randn(rows, 1000, generator=gen) * torch.logspace(-3, 2, 1000)[torch.randperm(1000, generator=gen)]
    w = layer.dequantize().double()
    y = layer(x).double()
    want = int16_activations(x) @ w.t()
    fp32_rounding = 4e-6 * (x.double().abs() @ w.abs().t())  # (~2**-24 each: 16 chunks' two, weights, scales)
    assert ((y - want).abs() <= fp32_rounding).all()
    assert ((y - x.double() @ w.t()).abs() > fp32_rounding).any()  # (it is not fp32 x's product)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 40, 300])
def test_avx2_hosts_fp8_panels_multiply_int16_activations_by_the_weights_grid(fp32_code_panels, rows):
    """On AVX2 hosts the fp8 panels quantize x as the int8 ones do (int16 per row and 64-input chunk), put each
    panel's e4m3 values on an int16 grid per column and 64-input chunk (`fp8_grid`: within half a step of each, the
    step the chunk's largest |value| / 1023), and sum the products exactly in int32 per chunk: the product of those
    two, to fp32's rounding, not the exact weights'. A row's batch does not matter. (x's inputs span 1e-3 to 1e2 so
    that the chunks' scales differ; 1000 inputs end in a part chunk.)"""
    if fp32_code_panels.vector_isa() != "avx2":
        pytest.skip("the int16 activations are the AVX2 path's (AVX-512 hosts widen the codes to fp32)")
    gen = torch.Generator().manual_seed(rows)
    layer = make_linear(
        torch.randn(96, 1000, generator=gen) * 0.05, None, "fp8", torch.float32, "panels_fp32", fp32_code_panels
    )
    assert fp32_code_panels.panel_codes_int16(1000)
    grid, steps = fp8_grid(layer.weight, layer.scale)
    exact = layer.dequantize().double()
    assert ((grid - exact).abs() <= 0.5001 * steps).all()  # (half a step, and the step's own rounding)
    x = torch.randn(rows, 1000, generator=gen) * torch.logspace(-3, 2, 1000)[torch.randperm(1000, generator=gen)]
    y = layer(x).double()
    fp32_rounding = 4e-6 * (x.double().abs() @ grid.abs().t())
    assert ((y - int16_activations(x) @ grid.t()).abs() <= fp32_rounding).all()
    assert ((y - int16_activations(x) @ exact.t()).abs() > fp32_rounding).any()  # (not the exact weights')
    cuts = [*range(0, rows, 3), rows]  # batches of 3 rows (blocks of 3, then 4 rows up): a row's batch, no matter
    assert torch.equal(torch.cat([layer(x[a:b]) for a, b in pairwise(cuts)]).double(), y)


def test_the_fp8_grid_reads_back_every_finite_code_of_a_chunk(fp32_code_panels):
    """Every finite e4m3 code in one 64-input chunk's column, one at a time beside 448 (the chunk's top: 1023
    steps): one-hot rows of x read back the grid's values, each the code's value rounded to the nearest step (half
    to even), subnormals and both zeros included."""
    from worker.model.linear import pack_panels

    if fp32_code_panels.vector_isa() != "avx2":
        pytest.skip("the grid is the AVX2 path's")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~codes.float().isnan()]
    w8 = torch.full((finite.numel(), 64), 448.0).to(torch.float8_e4m3fn)  # a column for each code: 448 beside it
    w8[:, 5] = finite
    packed = pack_panels(w8, fp32_code_panels.f32_panel_cols())
    n = finite.numel()
    y = fp32_code_panels.panel_linear_fp8(torch.eye(64), packed, n, torch.full((n,), 2.0**8), None)[5].double()
    want = fp8_grid(packed, torch.ones(n))[0][:, 5]
    step = 448 / 1023
    assert ((want - finite.double()).abs() <= 0.5001 * step).all()
    assert ((y - want).abs() <= 1e-6 * 448).all()
    assert (y[finite.float().abs() < step / 2] == 0).all() and y.abs().max() == pytest.approx(448, rel=1e-6)


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_widening_the_panels_first_gives_the_bits_of_widening_them_in_registers(fp32_code_panels, quant):
    """Batches of 32 rows or more (fp8: 8; AVX2 hosts' int8: 8, into an int16 pair scratch; their fp8: every batch,
    onto its grid) widen each panel once into a scratch; smaller ones at every step: the same values summed in the
    same order (int8 and fp8 on AVX2: exactly, in int32), so a row's output does not depend on its batch: 40 rows
    against batches of 4, 3 and 1."""
    gen = torch.Generator().manual_seed(3)
    layer = make_linear(
        torch.randn(100, 576, generator=gen), None, quant, torch.float32, "panels_fp32", fp32_code_panels
    )
    x = torch.randn(40, 576, generator=gen)
    cuts = [0, 4, 8, 12, 16, 20, 24, 28, 31, 34, 37, 38, 39, 40]
    assert torch.equal(layer(x), torch.cat([layer(x[a:b]) for a, b in pairwise(cuts)]))


def test_the_fp8_panels_widen_every_finite_code_exactly(panels):
    """An odd number of inputs (vpmaddwd's pairs cannot take them) keeps fp32 x and the exact F16C widening on every
    host: every finite e4m3 code reads back its own value."""
    from worker.model.linear import pack_panels

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~codes.float().isnan()]  # 254 codes: both zeros, the subnormals, +-448
    finite = torch.cat([finite, finite[:1]])  # (255 inputs: odd)
    assert not panels.panel_codes_int16(finite.numel())
    w8 = finite.view(1, -1).expand(48, -1).contiguous()
    eye = torch.eye(finite.numel())
    y = panels.panel_linear_fp8(eye, pack_panels(w8, 48), 48, torch.full((48,), 2.0**8), None)
    assert torch.equal(y[:, 7], finite.float())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda ops, p, s: ops.panel_linear_i8(torch.zeros(2, 32), p.float(), 50, s, None), "weight type"),
        (lambda ops, p, s: ops.panel_linear_fp8(torch.zeros(2, 32), p, 50, s, None), "weight type"),
        (lambda ops, p, s: ops.panel_linear_i8(torch.zeros(2, 32), p, 50, s[:49], None), "scale"),
        (lambda ops, p, s: ops.panel_linear_i8(torch.zeros(2, 32), p, 50, s, torch.zeros(50).double()), "bias"),
    ],
)
def test_the_quantized_panels_refuse_what_they_cannot_take(panels, call, match):
    from worker.model.linear import pack_panels

    codes, scale = quantize_int8(torch.randn(50, 32, generator=GEN))
    with pytest.raises(RuntimeError, match=match):
        call(panels, pack_panels(codes, panels.f32_panel_cols()), scale)


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "bias"),
    [(1, 50, 64, True), (5, 96, 576, False), (40, 144, 96, True), (300, 112, 64, False)],
)
def test_an_fp32_models_int4_layers_widen_their_panels_in_the_kernel(
    fp32_code_panels, rows, out_features, in_features, bias
):
    """int4 codes and fp32 group scales/offsets in panels, each panel widened once per pass: the product with the
    layer's own weights, which are `(q - 8) * scale + zero` of the quantizer's groups (on AVX2 hosts: with those
    weights on their int16 grid and int16 activations, `int4_product`), within fp32's rounding."""
    from worker.model.quant import quantize_int4

    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if bias else None
    panels = fp32_code_panels
    layer = make_linear(w, b, "int4", torch.float32, "panels_fp32", panels)
    cols = panels.f32_panel_cols()
    assert layer.packed.dtype == torch.uint8 and layer.packed.shape == (
        -(-out_features // cols),
        in_features,
        cols // 2,
    )
    q, scale, zero = quantize_int4(w, layer.group_size)
    g = layer.group_size
    convention = (q.float() - 8) * scale.repeat_interleave(g, 1) + zero.repeat_interleave(g, 1)
    torch.testing.assert_close(layer.dequantize(), convention, rtol=0, atol=1e-6)
    x = torch.randn(rows, in_features, generator=gen)
    y = layer(x)
    want, rounding = int4_product(panels, x, layer.packed, layer.scales_zeros, out_features, g)
    want += 0 if b is None else b.double()
    assert y.shape == (rows, out_features) and ((y.double() - want).abs() <= rounding).all()
    assert torch.equal(torch.cat([layer(x[i : i + 8]) for i in range(0, rows, 8)]), y)  # a row's batch: no matter


def int4_product(
    panels: object, x: torch.Tensor, codes: torch.Tensor, groups: torch.Tensor, out_features: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the int4 panels compute for x (fp64), and fp32's rounding around it: on AVX2 hosts (an even group size)
    x's int16 values times the weights on their grid (`int4_grid`), elsewhere x times the panels' own weights."""
    from worker.model.quant import unpack_int4_panels

    if panels.panel_int4_int16(x.shape[1], group_size):
        xs, w = int16_activations(x), int4_grid(codes, groups, out_features)[0]
    else:
        xs, w = x.double(), unpack_int4_panels(codes, groups, out_features).double()
    return xs @ w.t(), 70 * 2.0**-24 * (x.double().abs() @ w.abs().t())


@pytest.mark.parametrize(
    ("in_features", "group_size", "int16"),
    [
        (256, 128, True),  # a group spans two of x's 64-input chunks
        (192, 96, True),  # groups and chunks end at different inputs: stretches of 32
        (96, 8, True),  # eight groups a chunk, the last chunk short
        (90, 45, False),  # an odd group: its inputs do not pair, so x stays fp32
    ],
)
def test_the_int4_panels_take_groups_of_any_size_dividing_the_inputs(panels, in_features, group_size, int16):
    """Any group size dividing the inputs: the product with the panels' own weights, within fp32's rounding (on AVX2
    hosts, where the group size is even: of x's int16 values and the weights' grid)."""
    from worker.model.quant import pack_int4_panels, quantize_int4

    gen = torch.Generator().manual_seed(group_size)  # its own: GEN's draws depend on which tests ran before
    w = torch.randn(60, in_features, generator=gen)
    codes, groups = pack_int4_panels(*quantize_int4(w, group_size), panels.f32_panel_cols())
    x = torch.randn(5, in_features, generator=gen)
    assert panels.panel_int4_int16(in_features, group_size) == (int16 and panels.vector_isa() == "avx2")
    want, rounding = int4_product(panels, x, codes, groups, 60, group_size)
    y = panels.panel_linear_int4(x, codes, groups, 60, group_size, None).double()
    assert ((y - want).abs() <= rounding).all()


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 40, 300])
@pytest.mark.parametrize(("in_features", "group_size"), [(1024, 32), (1024, 128), (960, 96)])
def test_avx2_hosts_int4_panels_multiply_int16_activations_by_the_weights_grid(
    fp32_code_panels, rows, in_features, group_size
):
    """On AVX2 hosts the int4 panels quantize x as the int8 ones do (int16 per row and 64-input chunk), put each
    panel's weights on an int16 grid per column and 64-input chunk (`int4_grid`: within 0.75 of a step of the
    weights), and sum the products exactly in int32 per chunk: the product of those two, to fp32's rounding, not the
    exact weights'. A row's batch does not matter. (x's inputs span 1e-3 to 1e2 so that the chunks' scales differ.)"""
    from worker.model.quant import pack_int4_panels, quantize_int4, unpack_int4_panels

    if fp32_code_panels.vector_isa() != "avx2":
        pytest.skip("the int16 activations are the AVX2 path's (AVX-512 hosts widen the codes to fp32)")
    gen = torch.Generator().manual_seed(rows + group_size)
    w = torch.randn(96, in_features, generator=gen) * 0.05
    codes, groups = pack_int4_panels(*quantize_int4(w, group_size), fp32_code_panels.f32_panel_cols())
    grid, steps = int4_grid(codes, groups, 96)
    exact = unpack_int4_panels(codes, groups, 96).double()
    assert ((grid - exact).abs() <= 0.75 * steps).all()
    x = torch.randn(rows, in_features, generator=gen)
    x *= torch.logspace(-3, 2, in_features)[torch.randperm(in_features, generator=gen)]
    y = fp32_code_panels.panel_linear_int4(x, codes, groups, 96, group_size, None).double()
    fp32_rounding = 4e-6 * (x.double().abs() @ grid.abs().t())
    assert ((y - int16_activations(x) @ grid.t()).abs() <= fp32_rounding).all()
    assert ((y - int16_activations(x) @ exact.t()).abs() > fp32_rounding).any()  # (not the exact weights')
    cuts = [*range(0, rows, 3), rows]  # batches of 3 rows (blocks of 3, then 4 rows up): a row's batch, no matter
    parts = [fp32_code_panels.panel_linear_int4(x[a:b], codes, groups, 96, group_size, None) for a, b in pairwise(cuts)]
    assert torch.equal(torch.cat(parts).double(), y)


def test_the_int4_grid_takes_groups_that_span_both_signs_whole(fp32_code_panels):
    """A group whose offset and top weight are -1 and +1 puts its scale at 136 steps of the grid (the most there
    is): code 15's product with it wraps int16 (15 x 4365), its sum with the offset (32755) does not, and the
    panels give the grid's values, not wrapped ones. (One-hot rows of x read the weights back.)"""
    from worker.model.quant import pack_int4_panels, quantize_int4

    if fp32_code_panels.vector_isa() != "avx2":
        pytest.skip("the grid is the AVX2 path's")
    gen = torch.Generator().manual_seed(11)
    w = torch.rand(48, 64, generator=gen) * 2 - 1
    w[:, ::32] = -1.0  # every group of 32: its smallest weight -1, its largest +1
    w[:, 1::32] = 1.0
    codes, groups = pack_int4_panels(*quantize_int4(w, 32), fp32_code_panels.f32_panel_cols())
    grid, steps = int4_grid(codes, groups, 48)
    assert torch.allclose(steps, torch.full_like(steps, 1 / 1023))
    y = fp32_code_panels.panel_linear_int4(torch.eye(64), codes, groups, 48, 32, None).double().t()
    assert ((y - grid).abs() <= 1e-6 * grid.abs().max()).all()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda ops, c, g: ops.panel_linear_int4(torch.zeros(2, 64), c, g, 50, 48, None), "multiple of group_size"),
        (lambda ops, c, g: ops.panel_linear_int4(torch.zeros(2, 64), c.to(torch.int8), g, 50, 32, None), "uint8"),
        (lambda ops, c, g: ops.panel_linear_int4(torch.zeros(2, 64), c, g, 50, 16, None), "sz must be"),
        (lambda ops, c, g: ops.panel_linear_int4(torch.zeros(2, 64), c, g.double(), 50, 32, None), "sz must be"),
        (lambda ops, c, g: ops.panel_linear_int4(torch.zeros(2, 64), c, g, 97, 32, None), "does not fill"),
        (lambda ops, c, g: ops.panel_linear_int4(torch.zeros(2, 64), c, g, 50, 32, torch.zeros(49)), "bias"),
    ],
)
def test_the_int4_panels_refuse_what_they_cannot_take(panels, call, match):
    from worker.model.quant import pack_int4_panels, quantize_int4

    codes, groups = pack_int4_panels(*quantize_int4(torch.randn(50, 64, generator=GEN), 32), panels.f32_panel_cols())
    with pytest.raises(RuntimeError, match=match):
        call(panels, codes, groups)


@pytest.mark.parametrize("quant", ["int8", "fp8", "int4"])
def test_quantized_layers_say_which_kernel_multiplies_them(fp32_code_panels, quant):
    w = torch.randn(96, 64, generator=GEN)
    path = make_linear(w, None, quant, torch.float32, "panels_fp32", fp32_code_panels).path
    # (AVX2 hosts' int8, fp8 and int4: int16 activations)
    int16 = fp32_code_panels.vector_isa() == "avx2"
    assert ("int16 activations" in path) == int16 and ("fp32 panels" in path) != int16, path
    assert ("int16 grid" in path) == (int16 and quant != "int8"), path  # (fp8 and int4: their weights on a grid)
    assert "torch's ops" in make_linear(w, None, quant, torch.float32).path  # no extension: torch's


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_one_byte_layers_of_an_odd_number_of_inputs_keep_fp32_activations(fp32_code_panels, quant):
    """vpmaddwd multiplies inputs in pairs: an int8 or fp8 layer of an odd number of inputs widens its codes to fp32
    on every host, so its product is the dequantized weights' to fp32's rounding, with no int16 rounding of x."""
    gen = torch.Generator().manual_seed(5)
    layer = make_linear(
        torch.randn(96, 201, generator=gen), None, quant, torch.float32, "panels_fp32", fp32_code_panels
    )
    assert not fp32_code_panels.panel_codes_int16(201) and "fp32 panels" in layer.path
    assert fp32_code_panels.panel_codes_int16(200) == (fp32_code_panels.vector_isa() == "avx2")
    w = layer.dequantize().double()
    for rows in (3, 40):
        x = torch.randn(rows, 201, generator=gen)
        exact = x.double() @ w.t()
        fp32_rounding = 4e-6 * (x.double().abs() @ w.abs().t())
        assert ((layer(x).double() - exact).abs() <= fp32_rounding).all()
        assert ((int16_activations(x) @ w.t() - exact).abs() > fp32_rounding).any()  # (int16 x would not pass)


@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("rows", "out_features", "bias"),
    [(1, 50, True), (7, 96, False), (8, 144, True), (9, 50, False), (64, 96, True), (300, 112, True)],
)
def test_one_byte_layers_multiply_their_codes_on_the_bf16_pair_panels(
    bf16_panels, quant, dtype, rows, out_features, bias
):
    """On CPUs with AVX512-BF16 (no AMX) int8 and fp8 codes go into bf16 pair panels, widened exactly in the kernel,
    the scales and the bias applied to the fp32 sums: a bf16 model's output is the exact product rounded once to
    bf16; an fp32 model's activations are rounded to bf16 first (as on AMX) and its output is the fp32 sums."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 200, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if bias else None
    layer = make_linear(w, b, quant, dtype, "panels_bf16" if dtype == torch.bfloat16 else "panels_fp32", bf16_panels)
    assert layer.weight.dim() == 4 and "bf16 pair panels" in layer.path
    assert torch.equal(layer.dequantize(), make_linear(w, b, quant, torch.float32).dequantize())
    x = torch.randn(rows, 200, generator=gen).to(dtype)
    exact = x.bfloat16().double() @ layer.dequantize().double().t() + (0 if b is None else b.to(dtype).double())
    y = layer(x)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    err = (y.double() - exact).abs()
    assert (err <= exact.abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-20) + 1e-5).all(), err.max()
    assert torch.equal(layer(x.view(1, rows, 200)), y.view(1, rows, out_features))  # batched rows: the same


def test_the_bf16_pair_panels_widen_every_finite_fp8_code_exactly(bf16_panels):
    from worker.model.linear import pack_pair_panels

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~codes.float().isnan()]  # 254 codes: both zeros, the subnormals, +-448
    w8 = finite.view(1, -1).expand(48, -1).contiguous()
    eye = torch.eye(finite.numel(), dtype=torch.bfloat16)
    y = bf16_panels.panel_linear_bf16_codes(eye, pack_pair_panels(w8, 48), 48, torch.full((48,), 2.0**8), None, True)
    assert torch.equal(y[:, 7], finite.float())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda ops, p, s: ops.panel_linear_bf16_codes(
                torch.zeros(2, 32).bfloat16(), p.bfloat16(), 50, s, None, False
            ),
            "weight type",
        ),
        (
            lambda ops, p, s: ops.panel_linear_bf16_codes(torch.zeros(2, 32).bfloat16(), p, 50, s[:49], None, False),
            "scale",
        ),
        (lambda ops, p, s: ops.panel_linear_bf16_codes(torch.zeros(2, 32), p, 50, s, None, False), "bf16"),
    ],
)
def test_the_bf16_pair_code_panels_refuse_what_they_cannot_take(bf16_panels, call, match):
    from worker.model.linear import pack_pair_panels

    packed = pack_pair_panels(torch.zeros(50, 32, dtype=torch.int8), 48)
    with pytest.raises(RuntimeError, match=match):
        call(bf16_panels, packed, torch.ones(50))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "bias"),
    [(1, 50, 64, True), (5, 96, 576, False), (9, 144, 96, True), (300, 112, 64, False)],
)
def test_int4_layers_round_their_panels_to_bf16_pairs_in_the_kernel(
    bf16_panels, dtype, rows, out_features, in_features, bias
):
    """On CPUs with AVX512-BF16 (no AMX) the int4 panels are widened and rounded to bf16 pairs a panel at a time:
    the layer's weights are the fp32 panels' weights rounded to bf16, and its output their exact product with
    the bf16 activations, rounded once to bf16 (a bf16 model) or the fp32 sums (an fp32 model)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if bias else None
    kernel = "panels_bf16" if dtype == torch.bfloat16 else "panels_fp32"
    layer = make_linear(w, b, "int4", dtype, kernel, bf16_panels)
    assert "bf16 pair panels" in layer.path
    wide = make_linear(w, b, "int4", torch.float32, "panels_fp32", Fp32PanelsOnly(bf16_panels)).dequantize()
    assert torch.equal(layer.dequantize(), wide.bfloat16().float())
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    exact = x.bfloat16().double() @ layer.dequantize().double().t() + (0 if b is None else b.to(dtype).double())
    y = layer(x)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    err = (y.double() - exact).abs()
    assert (err <= exact.abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-20) + 1e-5).all(), err.max()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda ops, p, sz: ops.panel_linear_bf16_int4(torch.zeros(2, 64), p, sz, 50, 32, None, False), "bf16"),
        (
            lambda ops, p, sz: ops.panel_linear_bf16_int4(torch.zeros(2, 64).bfloat16(), p, sz, 50, 48, None, False),
            "group_size",
        ),
        (
            lambda ops, p, sz: ops.panel_linear_bf16_int4(
                torch.zeros(2, 64).bfloat16(), p, sz[:, :1].contiguous(), 50, 32, None, False
            ),
            "sz",
        ),
        (
            lambda ops, p, sz: ops.panel_linear_bf16_int4(torch.zeros(2, 64).bfloat16(), p, sz, 97, 32, None, False),
            "does not fill",
        ),
    ],
)
def test_the_int4_pair_panels_refuse_what_they_cannot_take(bf16_panels, call, match):
    from worker.model.quant import pack_int4_panels, quantize_int4

    codes, groups = pack_int4_panels(*quantize_int4(torch.randn(50, 64, generator=GEN), 32), 48)
    with pytest.raises(RuntimeError, match=match):
        call(bf16_panels, codes, groups)
