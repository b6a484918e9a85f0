"""Prompt attention: the native kernels (`kernels.amx_attention_`, bf16 on AMX; `kernels.bf16_attention_`, the same
in bf16 on AVX512-BF16; `kernels.f32_attention_`, fp32 on AVX-512 or AVX2 + FMA, and bf16 widened onto it where
neither bf16 kernel runs) against a reference, and how `attention.paged_attention` hands prompt chunks to them (the
routing tests run on any CPU, with a recording fake)."""

from __future__ import annotations

import pytest
import torch
from worker.model.attention import EAGER, NativeAttention, SeqSpan, build_metadata, paged_attention
from worker.model.kernels import load_prefill_attention, widened_attention
from worker.model.testing import causal_attention, qkv_views

BF16_KERNELS = [("amx", "amx_attention_"), ("bf16_attention", "bf16_attention_")]


@pytest.mark.parametrize("fixture,kernel", BF16_KERNELS)
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 4, 128), (8, 1, 64), (6, 2, 128)])
@pytest.mark.parametrize(
    "n,start",
    [
        (1, 0), (2, 0), (7, 0), (8, 0), (9, 0), (15, 0), (16, 0), (17, 0), (33, 0), (64, 0), (100, 0), (300, 0),
        (5, 3), (40, 100), (31, 33), (20, 27),
    ],
)  # fmt: skip
def test_bf16_attention_matches_an_fp32_reference(request, fixture, kernel, heads, kv_heads, hd, n, start):
    """Tails of 8 and 16 queries, of 6-row P V blocks, of 16 and 32 keys, an odd number of keys, a causal offset,
    grouped heads; only the chunk's output rows change."""
    attend = getattr(request.getfixturevalue(fixture), kernel)
    q, k, v = qkv_views(n, start, heads, kv_heads, hd, seed=n * 1000 + start + hd)
    scale = hd**-0.5
    out = torch.full((n + 2, heads * hd), 7.0, dtype=torch.bfloat16)
    attend(out[1 : n + 1], q, k, v, start, scale)
    torch.testing.assert_close(
        out[1 : n + 1].float(), causal_attention(q, k, v, start, scale), atol=1.6e-2, rtol=1.6e-2
    )
    assert (out[0] == 7).all() and (out[n + 1] == 7).all()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    "fixture,kernel,dtype",
    [*((f, k, torch.bfloat16) for f, k in BF16_KERNELS), ("f32_attention", "f32_attention_", torch.float32)],
)
def test_prompt_attention_is_the_same_whatever_the_thread_count(request, fixture, kernel, dtype, threads):
    attend = getattr(request.getfixturevalue(fixture), kernel)
    q, k, v = qkv_views(150, 20, 9, 3, 64, seed=5, dtype=dtype)
    want = torch.empty(150, 9 * 64, dtype=dtype)
    attend(want, q, k, v, 20, 0.125)
    got = torch.empty_like(want)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        attend(got, q, k, v, 20, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "out,q,k,start,match",
    [
        (_bf16(4, 4 * 96), _bf16(4, 4, 96), _bf16(4, 2, 96), 0, "head_dim 64 or 128"),
        (_bf16(4, 3 * 64), _bf16(4, 3, 64), _bf16(4, 2, 64), 0, "multiple of kv_heads"),
        (_bf16(4, 4 * 64), _bf16(4, 4, 64), _bf16(5, 2, 64), 0, "start \\+ n"),
        (_bf16(4, 4 * 64), _bf16(4, 4, 64), _bf16(6, 2, 64), 1, "start \\+ n"),
        (_bf16(3, 4 * 64), _bf16(4, 4, 64), _bf16(4, 2, 64), 0, "out \\[n"),
        (torch.zeros(4, 4 * 64), _bf16(4, 4, 64), _bf16(4, 2, 64), 0, "bf16"),
        (_bf16(4, 4 * 64), _bf16(4, 64, 4).transpose(1, 2), _bf16(4, 2, 64), 0, "bf16 tensors whose rows|back to back"),
        (_bf16(4, 4 * 64), _bf16(0, 4, 64), _bf16(0, 2, 64), 0, "n >= 1"),
    ],
)
@pytest.mark.parametrize("fixture,kernel", BF16_KERNELS)
def test_bf16_attention_rejects_what_it_cannot_take(request, fixture, kernel, out, q, k, start, match):
    attend = getattr(request.getfixturevalue(fixture), kernel)
    with pytest.raises(RuntimeError, match=f"{kernel}: .*({match})"):
        attend(out, q, k, k.clone(), start, 1.0)


@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 4, 128), (8, 1, 64), (6, 2, 128)])
@pytest.mark.parametrize(
    "n,start",
    [(1, 0), (2, 0), (7, 0), (8, 0), (9, 0), (47, 0), (49, 0), (100, 0), (300, 0), (5, 3), (40, 100), (31, 33)],
)
def test_f32_attention_matches_a_float64_reference(f32_attention, heads, kv_heads, hd, n, start):
    """Tails of 8 queries and of 48 keys, a causal offset, grouped heads; only the chunk's output rows change."""
    q, k, v = qkv_views(n, start, heads, kv_heads, hd, seed=n * 1000 + start + hd, dtype=torch.float32)
    scale = hd**-0.5
    out = torch.full((n + 2, heads * hd), 7.0)
    f32_attention.f32_attention_(out[1 : n + 1], q, k, v, start, scale)
    want = causal_attention(q.double(), k.double(), v.double(), start, scale)
    torch.testing.assert_close(out[1 : n + 1].double(), want, atol=1e-5, rtol=1e-5)
    assert (out[0] == 7).all() and (out[n + 1] == 7).all()


@pytest.mark.parametrize(
    "out,q,k,start,match",
    [
        (torch.zeros(4, 4 * 96), torch.zeros(4, 4, 96), torch.zeros(4, 2, 96), 0, "head_dim 64 or 128"),
        (torch.zeros(4, 3 * 64), torch.zeros(4, 3, 64), torch.zeros(4, 2, 64), 0, "multiple of kv_heads"),
        (torch.zeros(4, 4 * 64), torch.zeros(4, 4, 64), torch.zeros(6, 2, 64), 1, "start \\+ n"),
        (_bf16(4, 4 * 64), _bf16(4, 4, 64), _bf16(4, 2, 64), 0, "fp32 tensors"),
        (torch.zeros(4, 4 * 64), torch.zeros(4, 64, 4).transpose(1, 2), torch.zeros(4, 2, 64), 0, "rows contiguous"),
        (torch.zeros(4, 4 * 64), torch.zeros(0, 4, 64), torch.zeros(0, 2, 64), 0, "n >= 1"),
    ],
)
def test_f32_attention_rejects_what_it_cannot_take(f32_attention, out, q, k, start, match):
    with pytest.raises(RuntimeError, match=match):
        f32_attention.f32_attention_(out, q, k, k.clone(), start, 1.0)


@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (6, 2, 128)])
@pytest.mark.parametrize("n,start", [(1, 0), (9, 0), (100, 0), (40, 100), (31, 33)])
def test_a_widened_bf16_chunk_is_the_fp32_result_rounded_once(f32_attention, heads, kv_heads, hd, n, start):
    """bf16 q, k, v through the fp32 kernel (CPUs without AMX): each output is the float64 result rounded to bf16
    (within half a bf16 step, plus the fp32 kernel's own error), and only the chunk's rows change."""
    q, k, v = qkv_views(n, start, heads, kv_heads, hd, seed=n * 1000 + start + hd, dtype=torch.bfloat16)
    scale = hd**-0.5
    out = torch.full((n + 2, heads * hd), 7.0, dtype=torch.bfloat16)
    widened_attention(f32_attention.f32_attention_)(out[1 : n + 1], q, k, v, start, scale)
    want = causal_attention(q.double(), k.double(), v.double(), start, scale)
    err = (out[1 : n + 1].double() - want).abs()
    assert (err <= want.abs() * 2.0**-8 + 1e-5).all(), err.max()
    assert (out[0] == 7).all() and (out[n + 1] == 7).all()


def test_the_loader_picks_the_kernel_of_the_models_dtype(f32_attention):
    fp32, why = load_prefill_attention(torch.float32, 64)
    assert fp32 is f32_attention.f32_attention_ and "fp32" in why
    assert load_prefill_attention(torch.float32, 96) == (None, "SDPA: the native kernels take head dims of 64 or 128")
    assert load_prefill_attention(torch.float16, 64)[0] is None
    bf16, why = load_prefill_attention(torch.bfloat16, 128)
    if f32_attention.amx_linear_ready():
        assert bf16 is f32_attention.amx_attention_ and why == "AMX kernel (bf16)"
    elif f32_attention.bf16_attention_ready():
        assert bf16 is f32_attention.bf16_attention_ and "AVX512-BF16" in why
    else:  # the fp32 kernel on the widened chunk
        assert bf16 is not None and "widened to fp32" in why
        q, k, v = qkv_views(20, 5, 4, 2, 128, seed=3, dtype=torch.bfloat16)
        out, want = torch.empty(20, 4 * 128, dtype=torch.bfloat16), torch.empty(20, 4 * 128)
        bf16(out, q, k, v, 5, 0.1)
        f32_attention.f32_attention_(want, q.float(), k.float(), v.float(), 5, 0.1)
        assert torch.equal(out, want.bfloat16())


class _Recorder:
    """A stand-in for the native kernel: records what it is given and writes start + 1 into the rows it owns."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []

    def __call__(self, out, q, k, v, start, scale) -> None:
        self.calls.append((q.shape[0], k.clone(), v.clone(), start))
        out.fill_(start + 1)


def test_prompt_chunks_go_to_the_native_kernel_with_their_whole_context():
    """A decode row, a fresh prompt chunk and a chunk continuing at position 6: the chunks go to the kernel, the
    continuing one with its context read back from the cache; the decode row still attends as before."""
    heads, kv_heads, hd, bs = 4, 2, 8, 4
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(8, bs, kv_heads, hd, generator=gen)
    v_cache = torch.randn(8, bs, kv_heads, hd, generator=gen)
    spans = [SeqSpan(4, 1, [0, 1]), SeqSpan(0, 5, [2, 3]), SeqSpan(6, 3, [4, 5, 6])]
    meta = build_metadata(spans, bs, torch.device("cpu"), torch.float32)
    q = torch.randn(9, heads, hd, generator=gen)
    k = torch.randn(9, kv_heads, hd, generator=gen)
    v = torch.randn(9, kv_heads, hd, generator=gen)
    eager = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.3)
    fake = _Recorder()
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3, NativeAttention(prefill=fake))
    assert [(n, kc.shape[0], start) for n, kc, _, start in fake.calls] == [(5, 5, 0), (3, 9, 6)]
    _, k1, v1, _ = fake.calls[0]
    assert torch.equal(k1, k[1:6]) and torch.equal(v1, v[1:6])
    _, k2, v2, _ = fake.calls[1]
    assert torch.equal(k2, k_cache[[4, 5, 6]].reshape(-1, kv_heads, hd)[:9]) and torch.equal(k2[6:], k[6:])
    assert torch.equal(v2, v_cache[[4, 5, 6]].reshape(-1, kv_heads, hd)[:9])
    assert torch.equal(out[0], eager[0])
    assert (out[1:6] == 1).all() and (out[6:] == 7).all()


def test_q_rows_with_heads_apart_stay_on_sdpa():
    """The kernel takes rows whose heads lie back to back; q in any other layout keeps torch's path."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
    meta = build_metadata([SeqSpan(0, 3, [0])], 4, torch.device("cpu"), torch.float32)
    q = torch.randn(3, 8, 2, generator=gen).transpose(1, 2)  # [3, 2 heads, 8], heads not back to back
    k, v = torch.randn(3, 1, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    fake = _Recorder()
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3, NativeAttention(prefill=fake))
    assert fake.calls == []
    assert torch.equal(out, paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.3, EAGER))


def test_a_mixed_batch_on_the_f32_kernel_matches_sdpa(f32_attention):
    """The real fp32 kernel inside paged_attention: decode rows, a fresh chunk and a continuing one."""
    heads, kv_heads, hd, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(12, bs, kv_heads, hd, generator=gen)
    v_cache = torch.randn(12, bs, kv_heads, hd, generator=gen)
    spans = [SeqSpan(20, 1, [0, 1]), SeqSpan(0, 37, [2, 3, 4]), SeqSpan(30, 19, [5, 6, 7, 8])]
    meta = build_metadata(spans, bs, torch.device("cpu"), torch.float32)
    t = 1 + 37 + 19
    q, k, v = (torch.randn(t, h, hd, generator=gen) for h in (heads, kv_heads, kv_heads))
    eager = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.125, NativeAttention(prefill=f32_attention.f32_attention_))
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fixture,kernel", BF16_KERNELS)
def test_a_mixed_batch_on_a_bf16_kernel_matches_sdpa(request, fixture, kernel):
    """The real kernel inside paged_attention (bf16): decode rows, a fresh chunk and a continuing one."""
    attend = getattr(request.getfixturevalue(fixture), kernel)
    heads, kv_heads, hd, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(12, bs, kv_heads, hd, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(12, bs, kv_heads, hd, generator=gen).to(torch.bfloat16)
    spans = [SeqSpan(20, 1, [0, 1]), SeqSpan(0, 37, [2, 3, 4]), SeqSpan(30, 19, [5, 6, 7, 8])]
    meta = build_metadata(spans, bs, torch.device("cpu"), torch.bfloat16)
    t = 1 + 37 + 19
    q, k, v = (torch.randn(t, h, hd, generator=gen).to(torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    eager = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.125, NativeAttention(prefill=attend))
    torch.testing.assert_close(out.float(), eager.float(), atol=3e-2, rtol=3e-2)
