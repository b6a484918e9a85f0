"""The fused elementwise steps (`kernels.load_fused_ops`: residual add + RMSNorm, SiLU-and-mul, RoPE in place)
compute what the model's torch ops compute, in fp32 to a few ulps and in bf16 to one bf16 rounding, on every size
they take; the fp8 and int8 -> bf16 dequantizers are torch's conversions bit for bit; they refuse what they do not take; an fp32
model on them gives the tokens and the logprobs of the same model on torch's ops, and a bf16 model scores like one
on torch's ops. Skipped on CPUs without AVX512F (bf16: AVX512-BF16), where the model runs torch's ops and nothing
here is used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from worker.model.kernels import load_fused_ops
from worker.model.llama import rms_norm
from worker.model.quality import compare, reference
from worker.model.quant import fp8_to_fp16, make_linear, pack_int4_rows, quantize_fp8, quantize_int4, quantize_int8
from worker.model.runner import ModelRunner
from worker.model.testing import make_tiny_llama

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ops():
    fused, why = load_fused_ops(BF16, 64, 64, 64)
    if fused is None:
        pytest.skip(why)
    return fused


@pytest.fixture(scope="module", params=[torch.float32, BF16], ids=["fp32", "bf16"])
def step_ops(request):
    """(the extension, the dtype its elementwise steps are tested in)."""
    fused, why = load_fused_ops(request.param, 64, 64, 64)
    if fused is None:
        pytest.skip(why)
    return fused, request.param


def close_to_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: within two bf16 steps of the value (torch rounds between its ops, the kernels once at the end). fp32:
    within a few ulps (an FMA where torch multiplies and adds, exp by a polynomial, another summation order)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * 2**-8, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("n", [16, 576, 2048])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(step_ops, rows: int, n: int, with_delta: bool) -> None:
    ops, dtype = step_ops
    gen = torch.Generator().manual_seed(rows * n)
    h = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    d = torch.randn(rows, n, generator=gen).to(dtype) if with_delta else None
    w = (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype)
    want_h = h + d if d is not None else h
    want = rms_norm(want_h, w, 1e-5)
    got_h, got = ops.add_rms_norm(h.clone(), d, w, 1e-5)
    assert torch.equal(got_h, want_h)  # the residual is rounded exactly as torch's add rounds it
    assert got.dtype == dtype
    close_to_one_rounding(got, want)


@pytest.mark.parametrize("rows", [1, 5, 64, 129])
@pytest.mark.parametrize("inter", [16, 1536])
def test_silu_and_mul(step_ops, rows: int, inter: int) -> None:
    ops, dtype = step_ops
    gu = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps: silu(-100) = -0, silu(100) = 100
    close_to_one_rounding(ops.silu_and_mul(gu), F.silu(gu[:, :inter]) * gu[:, inter:])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("rows", [1, 33])
def test_rope_in_place_on_q_and_k_only(step_ops, heads: int, kv_heads: int, head_dim: int, rows: int) -> None:
    ops, dtype = step_ops
    gen = torch.Generator().manual_seed(head_dim + rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 100
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)[:, None]
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)[:, None]
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    want = qk * cos + qk.roll(head_dim // 2, dims=-1) * sin
    got = qkv.clone()
    ops.rope_(got, heads + kv_heads, head_dim, cos, sin)
    close_to_one_rounding(got[:, : want[0].numel()].view_as(want), want)
    assert torch.equal(got[:, want[0].numel() :], qkv[:, want[0].numel() :])  # v is untouched


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda ops: ops.silu_and_mul(torch.randn(2, 64, dtype=torch.float16)), "fp32 .* or bf16"),
        (
            lambda ops: ops.rope_(torch.randn(2, 64, dtype=torch.float64), 1, 64, torch.ones(2, 64), torch.ones(2, 64)),
            "or bf16",
        ),
        (lambda ops: ops.silu_and_mul(torch.randn(2, 40).to(BF16)), "16k"),  # 20 columns a half
        (lambda ops: ops.add_rms_norm(torch.randn(2, 24).to(BF16), None, torch.ones(24).to(BF16), 1e-5), "16k"),
        (lambda ops: ops.add_rms_norm(torch.randn(2, 32).to(BF16), None, torch.ones(16).to(BF16), 1e-5), "weight"),
        (lambda ops: ops.add_rms_norm(torch.randn(2, 32).to(BF16).t(), None, torch.ones(2).to(BF16), 1e-5), "contig"),
    ],
)
def test_refuses_what_it_does_not_take(ops, call, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        call(ops)
    with pytest.raises(RuntimeError, match="e4m3"):
        ops.fp8_to_bf16(torch.zeros(4, 32, dtype=torch.float8_e4m3fn).t(), None)
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8_to_bf16(torch.zeros(4, 32, dtype=torch.uint8), None)  # the codes' dtype says which format they are


def test_fp8_to_bf16_is_torchs_conversion_bit_for_bit(ops) -> None:
    codes = torch.arange(256, dtype=torch.uint8).repeat(4).view(torch.float8_e4m3fn).view(32, 32)
    got, want = ops.fp8_to_bf16(codes, None), fp8_to_fp16(codes).to(BF16)
    assert got.shape == want.shape and got.dtype == BF16
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])  # subnormals and -0 included


def test_int8_to_bf16_is_torchs_conversion_bit_for_bit(ops) -> None:
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(8, 32)  # every code
    got = ops.int8_to_bf16(codes, None)
    assert got.dtype == BF16 and got.shape == codes.shape
    assert torch.equal(got.view(torch.int16), codes.to(BF16).view(torch.int16))  # all exact in bf16
    tail = torch.arange(-8, 40, dtype=torch.int8).view(1, 48)  # 32 at a time, then the 16-at-a-time tail
    assert torch.equal(ops.int8_to_bf16(tail, None), tail.to(BF16))


@pytest.mark.parametrize("quant", ["fp8", "int8"])
@pytest.mark.parametrize(("out_features", "rows"), [(96, 1), (3072, 64)])  # 3072 x 576 dequantizes in tiles
def test_row_scaled_linear_on_the_native_ops_computes_its_weights(
    ops, quant: str, out_features: int, rows: int
) -> None:
    """Rows the GEMV takes: its sums, then the scales, bit for bit as torch's ops compute them. More rows: each weight
    row's values times its scale, rounded once to bf16 by the dequantizer, then one F.linear whose output needs no
    pass of its own to scale."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, 576, generator=gen) * 0.05
    x = torch.randn(rows, 576, generator=gen).to(BF16)
    native, plain = make_linear(w, None, quant, BF16, native=ops), make_linear(w, None, quant, BF16)
    if rows <= ops.gemv_max_rows():
        assert torch.equal(native(x), plain(x))
        return
    scale = native._unit_scale
    scaled = (native.FORMAT.to_dtype(native.weight, torch.float32) * scale[:, None]).to(BF16)
    assert torch.equal(getattr(ops, f"{quant}_to_bf16")(native.weight, scale), scaled)
    assert torch.equal(native(x), F.linear(x, scaled))
    torch.testing.assert_close(native(x), plain(x), rtol=2e-2, atol=2e-2)  # one bf16 rounding apart


def test_pack_int4_rows_layout() -> None:
    q = torch.randint(0, 16, (3, 64), generator=torch.Generator().manual_seed(1))
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 32)
    chunks = packed.view(3, 2, 16)  # byte i of a 32-weight chunk: weight i (low nibble), weight i + 16 (high)
    assert torch.equal(torch.cat([chunks & 0xF, chunks >> 4], -1).view(3, 64).long(), q)


@pytest.mark.parametrize(("shape", "rows"), [((96, 64), 3), ((3072, 576), 64), ((576, 1536), 1)])
def test_int4_on_the_native_dequantizer_computes_torchs_int4_weights(ops, shape: tuple[int, int], rows: int) -> None:
    gen = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=gen) * 0.05
    native, kernel = make_linear(w, None, "int4", BF16, native=ops), make_linear(w, None, "int4", BF16)
    assert native.nbytes == kernel.nbytes  # the same 0.5 byte a weight, in our layout
    close_to_one_rounding(native.dequantize(BF16), kernel.dequantize(BF16))
    x = torch.randn(rows, shape[1], generator=gen).to(BF16)
    want = kernel(x).float()
    assert ((native(x).float() - want).norm() / want.norm()).item() < 1e-2


def _needs_amx(ops) -> None:
    if not ops.amx_linear_ready():
        pytest.skip("this CPU has no AMX-BF16")


@pytest.mark.parametrize("kernel", ["aten", "amx_bf16"])
@pytest.mark.parametrize("quant", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 300])  # GEMV to 8 rows or AMX to 256, then dequantized tiles
def test_quantized_layers_give_the_product_with_their_weights_at_every_batch_size(
    ops, quant: str, rows: int, kernel: str
) -> None:
    if kernel == "amx_bf16":
        _needs_amx(ops)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(2048, 576, generator=gen) * 0.05
    layer = make_linear(w, None, quant, BF16, kernel=kernel, native=ops)
    x = torch.randn(rows, 576, generator=gen).to(BF16)
    want = x.float() @ layer.dequantize(torch.float32).t()
    got = layer(x)
    assert got.dtype == BF16 and got.shape == (rows, 2048)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64, 256])
# odd n-block and k-tile counts; (112, 64): 4 strips of 32 rows, the last 16, two a thread on two threads, so a
# thread dequantizes its part-filled last strip while it multiplies the one before
@pytest.mark.parametrize("out_in", [(96, 64), (3072, 576), (576, 1536), (48, 96), (112, 64)])
def test_amx_on_quantized_weights_is_amx_on_their_dequantized_weights(ops, rows: int, out_in: tuple[int, int]) -> None:
    """Bit for bit: the kernel dequantizes each strip of 32 weight rows to the values fp8_to_bf16 / int8_to_bf16 /
    int4_to_bf16 give (the next strip while it multiplies one), and multiplies them as amx_linear does."""
    _needs_amx(ops)
    gen = torch.Generator().manual_seed(rows + out_in[0])
    w = torch.randn(*out_in, generator=gen) * 0.05
    x = torch.randn(rows, out_in[1], generator=gen).to(BF16)
    w8, _ = quantize_fp8(w)
    assert torch.equal(ops.amx_linear_fp8(x, w8, None), ops.amx_linear(x, ops.fp8_to_bf16(w8, None), None, False))
    i8, _ = quantize_int8(w)
    assert torch.equal(ops.amx_linear_int8(x, i8, None), ops.amx_linear(x, ops.int8_to_bf16(i8, None), None, False))
    scale = torch.rand(out_in[0], generator=gen) + 0.5  # the layer's scales: applied to the sums, rounded once
    sums = ops.amx_linear(x, ops.int8_to_bf16(i8, None), None, True)
    assert torch.equal(ops.amx_linear_int8(x, i8, scale), (sums * scale).to(BF16))
    q, scale, zero = quantize_int4(w, 32)
    packed, sz = pack_int4_rows(q), torch.stack([scale, zero], -1).contiguous().to(BF16)
    want = ops.amx_linear(x, ops.int4_to_bf16(packed, sz, 32), None, False)
    assert torch.equal(ops.amx_linear_int4(x, packed, sz, 32), want)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda o: o.amx_linear_fp8(
                torch.zeros(2, 64, dtype=BF16), torch.zeros(24, 64, dtype=torch.float8_e4m3fn), None
            ),
            "multiple of 16",
        ),
        (lambda o: o.amx_linear_fp8(torch.zeros(2, 64), torch.zeros(32, 64, dtype=torch.float8_e4m3fn), None), "bf16"),
        (lambda o: o.amx_linear_fp8(torch.zeros(2, 64, dtype=BF16), torch.zeros(32, 64), None), "e4m3"),
        (
            lambda o: o.amx_linear_int8(torch.zeros(2, 64, dtype=BF16), torch.zeros(32, 64, dtype=torch.uint8), None),
            "int8",
        ),
        (
            lambda o: o.amx_linear_int8(torch.zeros(2, 96, dtype=BF16), torch.zeros(32, 64, dtype=torch.int8), None),
            "x must",
        ),
        (
            lambda o: o.amx_linear_int8(
                torch.zeros(2, 64, dtype=BF16), torch.zeros(32, 64, dtype=torch.int8), torch.ones(16)
            ),
            "scale must be",
        ),
        (
            lambda o: o.amx_linear_int4(
                torch.zeros(2, 64, dtype=BF16),
                torch.zeros(32, 32, dtype=torch.uint8),
                torch.zeros(32, 1, 2, dtype=BF16),
                32,
            ),
            "sz must be",
        ),
        (
            lambda o: o.amx_linear_int4(
                torch.zeros(2, 96, dtype=BF16),
                torch.zeros(32, 32, dtype=torch.uint8),
                torch.zeros(32, 2, 2, dtype=BF16),
                32,
            ),
            "x must be",
        ),
    ],
)
def test_amx_on_quantized_weights_refuses_what_it_cannot_take(ops, call, match: str) -> None:
    _needs_amx(ops)
    with pytest.raises(RuntimeError, match=match):
        call(ops)


def test_gemv_refuses_more_rows_than_it_takes(ops) -> None:
    assert ops.gemv_max_rows() == 8
    w8 = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"\[1\.\.8, in\]"):
        ops.fp8_gemv_bf16(torch.zeros(9, 32, dtype=BF16), w8)
    with pytest.raises(RuntimeError, match=r"\[1\.\.8, in\]"):
        ops.int8_gemv_bf16(torch.zeros(9, 32, dtype=BF16), torch.zeros(16, 32, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="same in"):
        ops.int8_gemv_bf16(torch.zeros(2, 64, dtype=BF16), torch.zeros(16, 32, dtype=torch.int8))


def test_loader_says_why_not(ops) -> None:
    assert load_fused_ops(torch.float16, 64, 64, 64)[0] is None
    none, why = load_fused_ops(BF16, 72, 100, 12)  # the tiny test model's sizes
    assert none is None and "16k" in why
    assert load_fused_ops(torch.float32, 72, 100, 12)[0] is None


def test_an_fp32_model_on_fused_ops_gives_the_tokens_and_logprobs_of_torch_ops(ops, tmp_path) -> None:
    """fp32 promises transformers' greedy tokens: the fused steps change only the last bits of the logprobs."""
    if load_fused_ops(torch.float32, 64, 96, 32)[0] is None:
        pytest.skip("fp32 fused steps need AVX512F")
    path = make_tiny_llama(
        tmp_path, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, init_std=0.1
    )
    fused = ModelRunner(str(path), num_blocks=32)
    plain = ModelRunner(str(path), num_blocks=32, enforce_eager=True)
    assert fused.model.fused is not None and plain.model.fused is None
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, fused.config.vocab_size, (n,), generator=gen).tolist() for n in (4, 19, 40)]
    assert [fused.greedy(p, 12) for p in prompts] == [plain.greedy(p, 12) for p in prompts]
    result = compare(reference(plain, prompts, max_tokens=12), fused)
    assert result.agreement == 1.0
    assert result.mean_kl < 1e-6


@pytest.mark.parametrize("quantization", [None, "int8", "fp8", "int4"])
def test_a_bf16_model_on_fused_ops_scores_like_one_on_torch_ops(ops, tmp_path, quantization: str | None) -> None:
    """Same weights, same prompts: the model on the native ops (fused steps, fp8/int4 dequantized natively) and
    the one on torch's ops agree with the fp32 reference alike."""
    path = make_tiny_llama(
        tmp_path,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        init_std=0.1,
    )
    ref = ModelRunner(str(path), num_blocks=32)
    fused = ModelRunner(str(path), num_blocks=32, dtype="bfloat16", quantization=quantization)
    plain = ModelRunner(str(path), num_blocks=32, dtype="bfloat16", quantization=quantization, enforce_eager=True)
    assert fused.model.fused is not None and plain.model.fused is None
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, ref.config.vocab_size, (n,), generator=gen).tolist() for n in (4, 19, 40)]
    base = reference(ref, prompts, max_tokens=12)
    with_fused, with_torch = compare(base, fused), compare(base, plain)
    assert with_fused.agreement >= with_torch.agreement - 0.1 and with_torch.agreement >= 0.6
    assert with_fused.mean_kl <= 2 * with_torch.mean_kl + 1e-3


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_to_bf16_is_the_dequantization_formula_rounded_once(ops, group: int) -> None:
    """w = q * scale + (zero - 8 * scale), one fp32 FMA rounded to bf16, for every nibble in every group."""
    gen = torch.Generator().manual_seed(group)
    q = torch.randint(0, 16, (48, 256), generator=gen)
    q[0, :16] = torch.arange(16)  # every code at least once
    scale = (torch.rand(48, 256 // group, generator=gen) * 0.02 + 1e-3).to(BF16)
    zero = (torch.randn(48, 256 // group, generator=gen) * 0.05).to(BF16)
    sz = torch.stack([scale, zero], dim=-1).contiguous()
    s, z = (t.float().repeat_interleave(group, dim=1) for t in (scale, zero))
    fma = q.double() * s.double() + (z - 8 * s).double()  # exact in float64: rounded once, to fp32, as an FMA is
    want = fma.float().to(BF16)
    got = ops.int4_to_bf16(pack_int4_rows(q), sz, group)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
