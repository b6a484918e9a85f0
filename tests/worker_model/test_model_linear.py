"""Dense linear kernels: the pure kernel choice, CPU flag parsing, the oneDNN packed layer and the fp32 and bf16
panel layers against `F.linear` (bf16: a float64 product), and the model building its linears (fused projections and the head) with the chosen
kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from worker.model.config import ModelConfig
from worker.model.linear import (
    AMX_LINEAR,
    AMX_MAX_ROWS,
    BF16_PANELS,
    F32_PANELS,
    F32_PANELS_AVX512,
    ONEDNN_LINEAR,
    AmxLinear,
    DenseLinear,
    PackedLinear,
    PanelLinear,
    available_kernels,
    choose_linear_kernel,
    make_dense_linear,
    read_cpu_flags,
    resolve_auto_dtype,
)
from worker.model.llama import LlamaModel, stack_operands
from worker.model.loader import load_weights
from worker.model.quant import make_linear
from worker.model.testing import make_tiny_llama

BF16_CPU = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
AMX_CPU = frozenset({"avx512f", "amx_bf16", "amx_tile"})
OLD_CPU = frozenset({"avx2", "fma"})
ONEDNN = frozenset({ONEDNN_LINEAR})
AMX = frozenset({AMX_LINEAR})
PANELS = frozenset({F32_PANELS})  # the panels on their AVX2 path (no AVX-512, or ATEN_CPU_CAPABILITY=avx2)
PANELS_512 = PANELS | {F32_PANELS_AVX512}
BF16_PANELS_ = frozenset({BF16_PANELS})
needs_onednn = pytest.mark.skipif(ONEDNN_LINEAR not in available_kernels(), reason="torch without oneDNN bf16")
GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    "device,dtype,flags,kernels,expected,why",
    [
        ("cpu", torch.bfloat16, BF16_CPU, ONEDNN, "onednn_bf16", "avx512_bf16"),
        ("cpu", torch.bfloat16, AMX_CPU, ONEDNN, "onednn_bf16", "amx_bf16"),  # no AMX kernel built: oneDNN
        ("cpu", torch.bfloat16, AMX_CPU, ONEDNN | AMX, "amx_bf16", "AMX kernel"),
        ("cpu", torch.bfloat16, AMX_CPU, AMX, "amx_bf16", "AMX kernel"),  # needs no oneDNN
        ("cpu", torch.bfloat16, BF16_CPU, ONEDNN | AMX, "onednn_bf16", "avx512_bf16"),  # the CPU lacks AMX
        ("cpu", torch.bfloat16, AMX_CPU - {"amx_tile"}, ONEDNN | AMX, "onednn_bf16", "amx_bf16"),
        ("cpu", torch.float32, AMX_CPU, ONEDNN | AMX, "aten", "MKL"),  # no panel kernel built: MKL
        ("cpu", torch.float32, AMX_CPU, ONEDNN | AMX | PANELS_512, "panels_fp32", "AVX512F"),
        ("cpu", torch.float32, BF16_CPU, PANELS_512, "panels_fp32", "AVX512F"),
        # The path the extension says it takes, whatever the CPU has (ATEN_CPU_CAPABILITY=avx2 caps it)
        ("cpu", torch.float32, BF16_CPU, PANELS, "panels_fp32", "AVX2 + FMA"),
        ("cpu", torch.float32, OLD_CPU, PANELS, "panels_fp32", "AVX2 + FMA"),  # no AVX-512: the AVX2 path
        ("cpu", torch.float32, OLD_CPU, frozenset(), "aten", "MKL"),  # no panel kernel built (or capped off): MKL
        ("cpu", torch.bfloat16, BF16_CPU, PANELS_512, "aten", "lacks oneDNN"),  # the fp32 panels do not take bf16
        ("cpu", torch.bfloat16, BF16_CPU, ONEDNN | PANELS_512 | BF16_PANELS_, "panels_bf16", "no AMX"),
        ("cpu", torch.bfloat16, BF16_CPU, BF16_PANELS_, "panels_bf16", "avx512_bf16"),  # needs no oneDNN
        ("cpu", torch.bfloat16, AMX_CPU, ONEDNN | AMX | BF16_PANELS_, "amx_bf16", "AMX kernel"),  # AMX first
        ("cpu", torch.float32, BF16_CPU, PANELS_512 | BF16_PANELS_, "panels_fp32", "AVX512F"),
        ("cuda", torch.bfloat16, BF16_CPU, BF16_PANELS_, "aten", "device cuda"),
        ("cuda", torch.float32, AMX_CPU, PANELS, "aten", "device cuda"),
        ("cuda", torch.bfloat16, AMX_CPU, AMX, "aten", "device cuda"),
        ("cpu", torch.bfloat16, OLD_CPU, ONEDNN, "aten", "without avx512_bf16"),
        ("cpu", torch.bfloat16, BF16_CPU, frozenset(), "aten", "lacks oneDNN"),
        ("cpu", torch.float32, BF16_CPU, ONEDNN, "aten", "MKL"),
        ("cpu", torch.float16, BF16_CPU, ONEDNN, "aten", "float16"),
        ("cuda", torch.bfloat16, BF16_CPU, ONEDNN, "aten", "device cuda"),
        ("cuda:0", torch.float32, frozenset(), frozenset(), "aten", "device cuda"),
    ],
)
def test_choose_linear_kernel(device, dtype, flags, kernels, expected, why):
    kind, reason = choose_linear_kernel(device, dtype, flags, kernels)
    assert kind == expected
    assert why in reason


@pytest.mark.parametrize(
    "device,flags,kernels,expected,why",
    [
        ("cpu", BF16_CPU, ONEDNN, "bfloat16", "avx512_bf16"),
        ("cpu", AMX_CPU, ONEDNN, "bfloat16", "amx_bf16"),
        ("cpu", AMX_CPU, AMX, "bfloat16", "AMX kernel"),
        ("cpu", OLD_CPU, ONEDNN, "float32", "without avx512_bf16"),
        ("cpu", BF16_CPU, frozenset(), "float32", "lacks oneDNN"),
        ("cuda", frozenset(), frozenset(), "bfloat16", "device cuda"),
    ],
)
def test_resolve_auto_dtype(device, flags, kernels, expected, why):
    dtype, reason = resolve_auto_dtype(device, flags, kernels)
    assert dtype == expected
    assert why in reason


@pytest.mark.parametrize(
    "text,expected",
    [
        ("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\nbogomips\t: 1\n", {"fpu", "avx512f", "avx512_bf16"}),
        ("processor\t: 0\nFeatures\t: fp asimd bf16\n", {"fp", "asimd", "bf16"}),
        ("processor\t: 0\n", set()),
    ],
)
def test_read_cpu_flags(tmp_path, text, expected):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert read_cpu_flags(path) == expected


def test_read_cpu_flags_without_cpuinfo(tmp_path):
    assert read_cpu_flags(tmp_path / "absent") == frozenset()


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_in_bf16(rows, bias):
    w = torch.randn(96, 64, generator=GEN).bfloat16()
    b = torch.randn(96, generator=GEN).bfloat16() if bias else None
    layer = PackedLinear(w, b)
    x = torch.randn(rows, 64, generator=GEN).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x, w, b))
    assert torch.equal(layer.dequantize(torch.bfloat16), w)
    assert layer.out_features == 96 and layer.nbytes == w.numel() * 2 + (96 * 2 if bias else 0)


@needs_onednn
def test_packed_linear_takes_strided_and_batched_inputs():
    w = torch.randn(32, 48, generator=GEN).bfloat16()
    layer = PackedLinear(w)
    wide = torch.randn(5, 96, generator=GEN).bfloat16()[:, :48]
    torch.testing.assert_close(layer(wide), F.linear(wide, w))
    batched = torch.randn(2, 3, 48, generator=GEN).bfloat16()
    torch.testing.assert_close(layer(batched), F.linear(batched, w))


@pytest.mark.parametrize(
    "kernel,cls", [("aten", DenseLinear), pytest.param("onednn_bf16", PackedLinear, marks=needs_onednn)]
)
def test_make_dense_linear_builds_the_kind_asked(kernel, cls):
    layer = make_dense_linear(torch.randn(8, 16, generator=GEN), None, torch.bfloat16, kernel)
    assert isinstance(layer, cls)


def test_make_dense_linear_builds_fp32_panels_with_the_extension(panels):
    assert isinstance(make_dense_linear(torch.randn(8, 16), None, torch.float32, "panels_fp32", panels), PanelLinear)
    with pytest.raises(ValueError, match="native extension"):
        make_dense_linear(torch.randn(8, 16), None, torch.float32, "panels_fp32")


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    root = make_tiny_llama(tmp_path_factory.mktemp("lin"))
    return ModelConfig.from_dir(root), load_weights(root, torch.float32)


@pytest.fixture(scope="module")
def tied_weights(tmp_path_factory):
    root = make_tiny_llama(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)
    return ModelConfig.from_dir(root), load_weights(root, torch.bfloat16)


def test_fp32_model_keeps_plain_torch_linears(tiny_weights):
    cfg, weights = tiny_weights
    model = LlamaModel(cfg, weights, dtype=torch.float32)
    assert model.linear_kernel == "aten"
    assert "MKL" in model.linear_kernel_reason
    assert all(isinstance(lin, DenseLinear) for lin in _linears(model))


@needs_onednn
def test_bf16_model_packs_every_linear_and_matches_plain_torch(tiny_weights):
    cfg, weights = tiny_weights
    plain = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="aten")
    packed = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="onednn_bf16")
    assert all(isinstance(lin, PackedLinear) for lin in _linears(packed))
    assert all(isinstance(lin, DenseLinear) for lin in _linears(plain))
    hidden = torch.randn(9, cfg.hidden_size, generator=GEN).bfloat16()
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden))
    assert packed.compute_logits(hidden).dtype == torch.float32


@needs_onednn
def test_tied_head_shares_the_embedding_under_every_kernel(tied_weights):
    cfg, weights = tied_weights
    plain = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="aten")
    packed = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="onednn_bf16")
    assert isinstance(packed.lm_head, DenseLinear)
    assert packed.lm_head.weight.data_ptr() == packed.embed.data_ptr()
    assert packed.nbytes == plain.nbytes
    hidden = torch.randn(4, cfg.hidden_size, generator=GEN).bfloat16()
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden))


@needs_onednn
def test_bf16_model_chooses_onednn_on_a_bf16_cpu(tiny_weights):
    if not read_cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("this CPU has no native bf16 dot products")
    cfg, weights = tiny_weights
    model = LlamaModel(cfg, weights, dtype=torch.bfloat16)
    assert model.linear_kernel == "onednn_bf16"
    assert "reordered once" in model.linear_kernel_reason


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64, 100, 300])
@pytest.mark.parametrize("out_in", [(48, 64), (96, 576), (16, 32)])  # odd and even counts of 16-row blocks
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_an_fp32_matmul_rounded_once(amx, rows, out_in, bias):
    n, k = out_in
    gen = torch.Generator().manual_seed(rows * 7 + n)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = amx.amx_linear(x, w, b, False)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # both sum in fp32 and round once; only the order of the sums differs
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    sums = amx.amx_linear(x, w, b, True)  # the sums themselves, unrounded
    assert sums.dtype == torch.float32
    torch.testing.assert_close(sums, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(sums.bfloat16(), got)


@pytest.mark.parametrize(
    "x_shape,w_shape,bias_shape,dtype,match",
    [
        ((4, 64), (40, 64), None, torch.bfloat16, "multiple of 16"),
        ((4, 48), (32, 48), None, torch.bfloat16, "multiple of 16 and in of 32"),
        ((4, 64), (32, 96), None, torch.bfloat16, "must be \\[out, in\\]"),
        ((4, 64), (32, 64), (16,), torch.bfloat16, "bias must be"),
        ((4, 64), (32, 64), None, torch.float32, "x must be"),
        ((0, 64), (32, 64), None, torch.bfloat16, "x must be"),
    ],
)
def test_amx_linear_rejects_what_it_cannot_take(amx, x_shape, w_shape, bias_shape, dtype, match):
    x = torch.zeros(x_shape, dtype=dtype)
    w = torch.zeros(w_shape, dtype=torch.bfloat16)
    b = None if bias_shape is None else torch.zeros(bias_shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        amx.amx_linear(x, w, b, False)


class _RecordingAmx:
    """Stands in for the native op: answers with F.linear and records the rows it was given."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def amx_linear(self, x, w, bias, fp32_out):
        assert x.is_contiguous() and x.dim() == 2
        self.rows.append(x.shape[0])
        y = F.linear(x, w, bias)
        return y.float() if fp32_out else y


@pytest.mark.parametrize(
    "shape,native_rows",
    [
        ((1, 64), [1]),
        ((AMX_MAX_ROWS, 64), [AMX_MAX_ROWS]),
        ((AMX_MAX_ROWS + 1, 64), []),  # prefill-sized: torch's matmul
        ((0, 64), []),
        ((2, 3, 64), [6]),  # leading dims flattened into rows, and restored
    ],
)
def test_amx_linear_layer_sends_decode_sized_batches_to_the_kernel(shape, native_rows):
    native = _RecordingAmx()
    w = torch.randn(32, 64, generator=GEN).bfloat16()
    layer = AmxLinear(w, None, native)
    x = torch.randn(shape, generator=GEN).bfloat16()
    y = layer(x)
    assert native.rows == native_rows
    assert y.shape == (*shape[:-1], 32)
    torch.testing.assert_close(y, F.linear(x, w))


def test_amx_linear_layer_refuses_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="16n, 32k"):
        AmxLinear(torch.zeros(24, 64, dtype=torch.bfloat16), None, _RecordingAmx())
    with pytest.raises(ValueError, match="bf16"):
        AmxLinear(torch.zeros(32, 64), None, _RecordingAmx())
    # make_dense_linear gives such a weight torch's matmul instead
    layer = make_dense_linear(torch.zeros(24, 64), None, torch.bfloat16, "amx_bf16", _RecordingAmx())
    assert type(layer) is DenseLinear


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_model_on_amx_matches_plain_torch_and_ties_the_head_without_a_copy(amx, tmp_path, tied):
    # every linear in the kernel's shapes: [16n, 32k]
    root = make_tiny_llama(
        tmp_path / "m", hidden_size=64, intermediate_size=96, num_attention_heads=4, tie_word_embeddings=tied
    )
    cfg, weights = ModelConfig.from_dir(root), load_weights(root, torch.bfloat16)
    plain = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="aten")
    amx = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="amx_bf16", fused=amx)
    assert all(isinstance(lin, AmxLinear) for lin in _linears(amx))
    assert amx.nbytes == plain.nbytes
    assert amx.lm_head(torch.zeros(2, cfg.hidden_size, dtype=torch.bfloat16)).dtype == torch.float32
    if cfg.tie_word_embeddings:
        assert amx.lm_head.weight.data_ptr() == amx.embed.data_ptr()
    hidden = torch.randn(9, cfg.hidden_size, generator=GEN).bfloat16()
    torch.testing.assert_close(amx.compute_logits(hidden), plain.compute_logits(hidden), atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 64, 300])  # 8-row blocks and their tails; 300: two passes of 256
# whole and part-filled panels
@pytest.mark.parametrize("out_in", [(96, 64), (112, 64), (100, 37), (48, 576), (577, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_f_linear_in_fp32(panels, rows, out_in, bias):
    w = torch.randn(*out_in, generator=GEN)
    b = torch.randn(out_in[0], generator=GEN) if bias else None
    layer = PanelLinear(w, b, panels)
    x = torch.randn(rows, out_in[1], generator=GEN)
    got = layer(x)
    assert got.shape == (rows, out_in[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)  # sums of up to 576 terms ~1
    assert torch.equal(layer.dequantize(), w)
    ids = torch.tensor([0, out_in[0] - 1, out_in[0] // 2, 0])
    assert torch.equal(layer.rows(ids), w[ids])  # the embedding lookups a tied head serves


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_lookups_take_many_ids_and_refuse_ids_past_the_weight(panels, dtype):
    """A prompt chunk's embedding lookups (thousands of ids, split between threads) read the weight's rows; an id
    past the weight's rows (the padding columns of the last panel included) is refused, not read."""
    if dtype == torch.bfloat16 and not panels.bf16_panels_ready():
        pytest.skip("bf16 panels need AVX512-BF16")
    w = torch.randn(100, 64, generator=GEN).to(dtype)  # 3 panels of 48: the last holds 4 rows and 44 of padding
    layer = PanelLinear(w, None, panels)
    ids = torch.randint(0, 100, (3000,), generator=GEN)
    assert torch.equal(layer.rows(ids), w[ids])
    assert layer.rows(torch.tensor([], dtype=torch.long)).shape == (0, 64)
    for bad in (100, 143, 144, -1):
        with pytest.raises(RuntimeError, match="out of range"):
            layer.rows(torch.tensor([3, bad]))


@pytest.mark.parametrize("out_features", [96, 112, 100])  # streamed (whole panels; a part-filled one), plain stores
def test_panel_linear_writes_a_prompt_chunk_as_it_writes_its_parts(panels, out_features):
    """Past one 256-row pass the kernel writes y with streaming stores (N a multiple of 16): the same values, bit
    for bit, as the plain stores of the same rows taken in calls of at most 256."""
    w, b = torch.randn(out_features, 64, generator=GEN), torch.randn(out_features, generator=GEN)
    layer = PanelLinear(w, b, panels)
    x = torch.randn(600, 64, generator=GEN)
    whole = layer(x)
    assert torch.equal(whole, torch.cat([layer(x[:256]), layer(x[256:512]), layer(x[512:])]))


@pytest.mark.parametrize("out_features", [48000, 48008])  # streamed (whole panels; a part-filled one), plain stores
def test_panel_linear_writes_an_output_heads_logits_as_it_writes_their_parts(panels, out_features):
    """A decode batch's y bigger than the kernel's STREAM_OUT_BYTES (an output head's logits, 4 MB) also goes out
    with streaming stores: the same values, bit for bit, as smaller calls' plain stores."""
    layer = PanelLinear(torch.randn(out_features, 64, generator=GEN), None, panels)
    x = torch.randn(24, 64, generator=GEN)  # 24 x 48000 fp32: 4.6 MB; 8 rows: 1.5 MB
    assert torch.equal(layer(x), torch.cat([layer(x[:8]), layer(x[8:16]), layer(x[16:])]))


def test_panel_linear_sums_in_blocks_no_less_exactly_than_mkl(panels):
    """One running fp32 sum over 1536 inputs had ~3x MKL's rounding error; sums over 64-input chunks, added up,
    stay within it."""
    w, x = torch.randn(576, 1536, generator=GEN), torch.randn(300, 1536, generator=GEN)
    exact = x.double() @ w.double().t()
    ours = (PanelLinear(w, None, panels)(x).double() - exact).abs().max()
    mkl = (F.linear(x, w).double() - exact).abs().max()
    assert ours <= 1.5 * mkl


def test_panel_linear_takes_strided_and_batched_inputs(panels):
    w = torch.randn(50, 48, generator=GEN)
    layer = PanelLinear(w, None, panels)
    wide = torch.randn(5, 96, generator=GEN)[:, :48]
    torch.testing.assert_close(layer(wide), F.linear(wide, w))
    batched = torch.randn(2, 3, 48, generator=GEN)
    torch.testing.assert_close(layer(batched), F.linear(batched, w))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda ops, p: ops.panel_linear_f32(torch.zeros(2, 32, dtype=torch.bfloat16), p, 50, None), "fp32"),
        (lambda ops, p: ops.panel_linear_f32(torch.zeros(2, 31), p, 50, None), "x's in"),
        (lambda ops, p: ops.panel_linear_f32(torch.zeros(2, 32), p, 97, None), "does not fill"),
        (lambda ops, p: ops.panel_linear_f32(torch.zeros(2, 32), p, 48, None), "does not fill"),
        (lambda ops, p: ops.panel_linear_f32(torch.zeros(2, 32), p, 50, torch.zeros(49)), "bias"),
        (lambda ops, p: ops.panel_linear_f32(torch.zeros(2, 32), p[:, :, :16].contiguous(), 50, None), "panels"),
    ],
)
def test_panel_linear_refuses_what_it_cannot_take(panels, call, match):
    packed = PanelLinear(torch.randn(50, 32, generator=GEN), None, panels).packed  # 2 panels, 50 columns
    with pytest.raises(RuntimeError, match=match):
        call(panels, packed)
    with pytest.raises(ValueError, match="fp32 or bf16 CPU weight"):
        PanelLinear(torch.randn(50, 32, generator=GEN).half(), None, panels)


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 8, 9, 17, 64, 300])  # 8-row blocks and tails; 300: two passes
@pytest.mark.parametrize("out_in", [(96, 64), (112, 64), (100, 38), (48, 576), (577, 40), (50, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panel_linear_rounds_the_exact_product_once(bf16_panels, rows, out_in, bias):
    """Each output is the float64 product of the bf16 operands (plus an fp32 bias) rounded once to bf16: within
    half a bf16 step, plus what fp32 sums of up to 1536 terms may lose. The layer's packing round-trips."""
    w = torch.randn(*out_in, generator=GEN).bfloat16()
    b = torch.randn(out_in[0], generator=GEN).bfloat16() if bias else None
    layer = PanelLinear(w, b, bf16_panels)
    x = torch.randn(rows, out_in[1], generator=GEN).bfloat16()
    got = layer(x)
    assert got.shape == (rows, out_in[0]) and got.dtype == torch.bfloat16
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    err = (got.double() - exact).abs()
    assert (err <= exact.abs() * 2.0**-8 + 1e-4).all(), err.max()
    assert torch.equal(layer.dequantize(torch.bfloat16), w)
    ids = torch.tensor([0, out_in[0] - 1, out_in[0] // 2, 0])
    assert torch.equal(layer.rows(ids), w[ids])  # the embedding lookups a tied head serves
    sums = PanelLinear(w, b, bf16_panels, fp32_out=True)(x)  # the same sums, unrounded: an output head's logits
    assert sums.dtype == torch.float32 and torch.equal(sums.bfloat16(), got)
    assert ((sums.double() - exact).abs() <= exact.abs() * 2.0**-20 + 1e-4).all()


@pytest.mark.parametrize("out_features", [96, 112, 100])  # streamed (whole panels; a part-filled one), plain stores
def test_bf16_panel_linear_writes_a_prompt_chunk_as_it_writes_its_parts(bf16_panels, out_features):
    w = torch.randn(out_features, 64, generator=GEN).bfloat16()
    layer = PanelLinear(w, torch.randn(out_features, generator=GEN), bf16_panels)
    x = torch.randn(600, 64, generator=GEN).bfloat16()
    assert torch.equal(layer(x), torch.cat([layer(x[:256]), layer(x[256:512]), layer(x[512:])]))
    logits = PanelLinear(w, None, bf16_panels, fp32_out=True)
    assert torch.equal(logits(x), torch.cat([logits(x[:256]), logits(x[256:512]), logits(x[512:])]))
    wide = torch.randn(5, 128, generator=GEN).bfloat16()[:, :64]  # strided rows, and a batch
    assert torch.equal(layer(wide), layer(wide.contiguous()))
    assert torch.equal(layer(x[:6].view(2, 3, 64)), layer(x[:6]).view(2, 3, out_features))


@pytest.mark.parametrize("out_features", [48000, 48008])  # streamed (whole panels; a part-filled one), plain stores
def test_bf16_panel_linear_writes_an_output_heads_logits_as_it_writes_their_parts(bf16_panels, out_features):
    w = torch.randn(out_features, 64, generator=GEN).bfloat16()
    x = torch.randn(48, 64, generator=GEN).bfloat16()  # 48 x 48000: 4.6 MB of bf16, 9.2 of fp32 logits
    for layer in (PanelLinear(w, None, bf16_panels), PanelLinear(w, None, bf16_panels, fp32_out=True)):
        assert torch.equal(layer(x), torch.cat([layer(x[:16]), layer(x[16:32]), layer(x[32:])]))


@pytest.mark.parametrize("kind", ["fp32", "int8", "fp8", "int4", "gated"])
def test_a_prompt_chunks_panel_linears_are_the_same_whatever_the_thread_count(fp32_code_panels, kind):
    """Past one 256-row pass the threads claim (pass, stretch of panels) items as they finish their last
    (kernels.py: parallel_claims), so which thread multiplies what differs from call to call: each item's sums are
    the same whoever takes them, so the output is the same bits at any thread count, and those of the passes taken
    one call at a time. (fp32, the int8 / fp8 / int4 code panels, and gate+up with SiLU in the epilogue.)"""
    panels = fp32_code_panels
    gen = torch.Generator().manual_seed(7)
    inter = 4 * panels.f32_panel_cols()  # gate's 4 panels and up's 4: items of one pair at 4 threads
    w = torch.randn(2 * inter, 128, generator=gen) * 0.1
    b = torch.randn(2 * inter, generator=gen)
    if kind == "gated":
        layer = PanelLinear(w, None, panels)
        run = lambda x: panels.gated_linear(x, *stack_operands(layer), 2 * inter)  # noqa: E731
    else:
        run = make_linear(w, b, None if kind == "fp32" else kind, torch.float32, "panels_fp32", panels)
    x = torch.randn(600, 128, generator=gen)  # two whole passes and a short one
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = run(x)
        assert torch.equal(want, torch.cat([run(x[:256]), run(x[256:512]), run(x[512:])]))
        for threads in (2, 3, 4):
            torch.set_num_threads(threads)
            assert torch.equal(run(x), want), f"{threads} threads"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 3])
def test_bf16_panel_linear_is_the_same_whatever_the_thread_count(bf16_panels, threads):
    layer = PanelLinear(torch.randn(300, 96, generator=GEN).bfloat16(), None, bf16_panels)
    x = torch.randn(40, 96, generator=GEN).bfloat16()
    want = layer(x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(layer(x), want)
    finally:
        torch.set_num_threads(before)


def _bf(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda ops, p: ops.panel_linear_bf16(torch.zeros(2, 32), p, 50, None, False), "bf16"),
        (lambda ops, p: ops.panel_linear_bf16(_bf(2, 31), p, 50, None, False), "in even"),
        (lambda ops, p: ops.panel_linear_bf16(_bf(2, 30), p, 50, None, False), "x's in"),
        (lambda ops, p: ops.panel_linear_bf16(_bf(2, 32), p, 97, None, False), "does not fill"),
        (lambda ops, p: ops.panel_linear_bf16(_bf(2, 32), p, 50, _bf(50), False), "bias"),
        (lambda ops, p: ops.panel_linear_bf16(_bf(2, 32), p.float(), 50, None, False), "packed"),
        (lambda ops, p: ops.panel_linear_bf16(_bf(2, 32), p[:, :, :16].contiguous(), 50, None, False), "packed"),
    ],
)
def test_bf16_panel_linear_refuses_what_it_cannot_take(bf16_panels, call, match):
    packed = PanelLinear(_bf(50, 32), None, bf16_panels).packed  # 2 panels, 50 columns
    with pytest.raises(RuntimeError, match=match):
        call(bf16_panels, packed)
    with pytest.raises(ValueError, match="even number of inputs"):
        PanelLinear(_bf(50, 33), None, bf16_panels)
    assert isinstance(make_dense_linear(_bf(50, 33), None, torch.bfloat16, "panels_bf16", bf16_panels), DenseLinear)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_model_on_panels_matches_plain_torch_and_looks_tokens_up_in_a_tied_heads_panels(
    bf16_panels, tmp_path, tied
):
    cfg, embedding, plain, model = _tiny_on_panels(tmp_path, tied, torch.bfloat16, bf16_panels)
    assert model.linear_kernel == "panels_bf16" and "no AMX" in model.linear_kernel_reason
    assert all(isinstance(lin, PanelLinear) for lin in _linears(model))
    ids = torch.tensor([3, 0, cfg.vocab_size - 1, 3])
    assert torch.equal(model.embed_tokens(ids), embedding[ids])
    assert (model.embed is None) == tied  # a tied head's panels are the embedding: no second copy
    hidden = torch.randn(9, cfg.hidden_size, generator=GEN).bfloat16()
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_model_on_panels_matches_plain_torch_and_looks_tokens_up_in_a_tied_heads_panels(panels, tmp_path, tied):
    cfg, embedding, plain, model = _tiny_on_panels(tmp_path, tied, torch.float32, panels)
    assert model.linear_kernel == "panels_fp32"
    assert {"avx512": "AVX512F", "avx2": "AVX2 + FMA"}[panels.vector_isa()] in model.linear_kernel_reason
    assert all(isinstance(lin, PanelLinear) for lin in _linears(model))
    ids = torch.tensor([3, 0, cfg.vocab_size - 1, 3])
    assert torch.equal(model.embed_tokens(ids), embedding[ids])
    # a tied head's panels are the embedding: no second copy (the panels pad the vocabulary to 48k rows)
    assert (model.embed is None) == tied
    padding = sum(lin.nbytes for lin in _linears(model)) - sum(lin.nbytes for lin in _linears(plain))
    assert model.nbytes == plain.nbytes + padding
    hidden = torch.randn(9, cfg.hidden_size, generator=GEN)
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-5, atol=1e-5)


def _tiny_on_panels(tmp_path, tied: bool, dtype: torch.dtype, native) -> tuple:
    """A tiny model (its head tied or not) in `dtype`: (config, embedding, on torch's matmul, on the native panels)."""
    root = make_tiny_llama(
        tmp_path / "m", hidden_size=64, intermediate_size=96, num_attention_heads=4, tie_word_embeddings=tied
    )
    cfg, weights = ModelConfig.from_dir(root), load_weights(root, dtype)
    embedding = weights["model.embed_tokens.weight"].clone()
    plain = LlamaModel(cfg, weights, dtype=dtype, linear_kernel="aten")
    return cfg, embedding, plain, LlamaModel(cfg, weights, dtype=dtype, fused=native)


def _linears(model: LlamaModel) -> list:
    layers = [lin for layer in model.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    return [*layers, model.lm_head]


def test_runner_resolves_auto_dtype_as_the_pure_rule_says(tmp_path):
    from worker.model.runner import ModelRunner

    root = make_tiny_llama(tmp_path / "m")
    runner = ModelRunner(str(root), dtype="auto", num_blocks=8)
    from worker.model.kernels import load_extension

    expected, reason = resolve_auto_dtype("cpu", read_cpu_flags(), available_kernels(load_extension()))
    assert runner.dtype == getattr(torch, expected)
    assert runner.dtype_reason == reason
    assert runner.kv_cache.dtype == runner.dtype
    assert runner.model.compute_logits(torch.zeros(1, runner.config.hidden_size, dtype=runner.dtype)).dtype == (
        torch.float32
    )


def test_engine_config_accepts_auto_dtype():
    from worker.core.config import EngineConfig

    assert EngineConfig(dtype="auto").dtype == "auto"
