"""Paged attention pieces: step metadata (positions, slots, block tables) and the native decode kernel against
the eager gather + SDPA path."""

from __future__ import annotations

import itertools
import platform
import shutil

import pytest
import torch
from worker.model.attention import (
    EAGER,
    NativeAttention,
    SeqSpan,
    build_metadata,
    cache_shape,
    cache_views,
    decode_attention_sdpa,
    paged_attention,
    write_kv,
)
from worker.model.kernels import (
    _load_module,
    head_major_cache,
    load_paged_decode,
    load_paged_decode_generic,
    paged_decode_path,
)


@pytest.mark.parametrize(
    "spans,positions,slots",
    [
        ([SeqSpan(0, 1, [7])], [0], [28]),
        ([SeqSpan(5, 1, [2, 9])], [5], [37]),
        ([SeqSpan(3, 3, [1, 4])], [3, 4, 5], [7, 16, 17]),
        ([SeqSpan(9, 1, [0, 1, 2]), SeqSpan(0, 2, [5])], [9, 0, 1], [9, 20, 21]),
    ],
)
def test_positions_and_slot_mapping(spans, positions, slots):
    meta = build_metadata(spans, 4, torch.device("cpu"), torch.float32)
    assert meta.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots


def test_decode_tables_and_masks():
    spans = [SeqSpan(4, 1, [3, 8, 9]), SeqSpan(0, 1, [6])]
    meta = build_metadata(spans, 4, torch.device("cpu"), torch.float32)
    assert meta.num_decode == 2
    assert meta.decode_block_tables.tolist() == [[3, 8], [6, 0]]  # only blocks holding the context, padded
    assert meta.decode_context_lens.tolist() == [5, 1]
    visible = (meta.decode_mask[:, 0, 0] == 0).tolist()
    assert visible == [[True] * 5 + [False] * 3, [True] + [False] * 7]
    assert build_metadata(spans, 4, torch.device("cpu"), torch.float32, decode_kernel=True).decode_mask is None


def test_prefix_chunk_mask_is_lower_right_causal():
    meta = build_metadata([SeqSpan(3, 2, [0, 1])], 4, torch.device("cpu"), torch.float32)
    (chunk,) = meta.prefills
    assert chunk.block_idx.tolist() == [0, 1]
    assert (chunk.mask[0, 0] == 0).tolist() == [[True] * 4 + [False], [True] * 5]
    assert build_metadata([SeqSpan(0, 2, [0])], 4, torch.device("cpu"), torch.float32).prefills[0].mask is None


@pytest.mark.parametrize(
    "spans,match",
    [
        ([SeqSpan(0, 5, [0])], "cannot hold"),
        ([SeqSpan(0, 2, [0]), SeqSpan(3, 1, [1])], "before multi-token"),
    ],
)
def test_metadata_rejects_bad_batches(spans, match):
    with pytest.raises(ValueError, match=match):
        build_metadata(spans, 4, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def kernel():
    fn, why = load_paged_decode()
    if fn is None:
        pytest.skip(f"native kernel cannot be built here: {why}")
    return fn


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1), (10, 2)])  # groups of 1, 3, 8, 5
@pytest.mark.parametrize("hd", [32, 64, 128])  # 64 and 128: the AVX-512 paths where the CPU has them
def test_native_decode_matches_sdpa(kernel, dtype, tol, heads, kv_heads, hd):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads + hd)
    bs, nb = 16, 40
    k_cache = torch.randn(nb, bs, kv_heads, hd, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, kv_heads, hd, generator=gen).to(dtype)
    lens = [1, 15, 16, 17, 100, 3]
    spans = []
    for n in lens:
        blocks = torch.randperm(nb, generator=gen)[: -(-n // bs)].tolist()
        spans.append(SeqSpan(n - 1, 1, blocks))
    q = torch.randn(len(lens), heads, hd, generator=gen).to(dtype)
    eager = build_metadata(spans, bs, torch.device("cpu"), dtype)
    native = build_metadata(spans, bs, torch.device("cpu"), dtype, decode_kernel=True)
    ref = decode_attention_sdpa(q, k_cache, v_cache, eager.decode_block_tables.view(-1), eager.decode_mask, 0.2)
    out = kernel(q, k_cache, v_cache, native.decode_block_tables, native.decode_context_lens, 0.2)
    assert out.dtype == dtype and out.shape == (len(lens), heads * hd)
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)


def test_native_decode_rejects_bad_input(kernel):
    q = torch.zeros(2, 4, 8)
    cache = torch.zeros(3, 4, 2, 8)
    tables = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, cache, cache, tables.int(), torch.ones(2, dtype=torch.int64), 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(q, cache, cache, tables + 3, torch.ones(2, dtype=torch.int64), 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        kernel(q, cache, cache, tables, torch.tensor([1, 5]), 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(q.transpose(0, 1), cache, cache, tables, torch.ones(2, dtype=torch.int64), 1.0)


V3 = "avx avx2 bmi1 bmi2 f16c fma abm movbe xsave sse4_2"


@pytest.mark.parametrize(
    "machine,flags,march,portable",
    [
        ("x86_64", V3, "-march=x86-64-v3", True),
        ("x86_64", V3 + " avx512f", "-march=x86-64-v3", True),
        ("x86_64", V3.replace("avx2 ", ""), "-march=native", False),
        ("aarch64", "fp asimd", "-march=native", False),
    ],
)
def test_kernel_target_choice(monkeypatch, machine, flags, march, portable):
    from worker.model import kernels

    monkeypatch.setattr(kernels, "_cpu_flags", lambda: (machine, frozenset(flags.split())))
    cflags, target = kernels.arch_flags()
    assert cflags == [march]
    assert (target == "x86-64-v3") == portable


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("g++") is None, reason="builds are checked where CI builds (x86)"
)
def test_the_extension_builds_where_a_compiler_is():
    """A compile error must fail the suite: every native test skips when the build fails, so without this one a
    broken kernel would leave CI green."""
    from worker.model import kernels

    module, why = kernels._load_module()
    assert module is not None, why


def test_loading_twice_reuses_the_build(kernel):
    from worker.model import kernels

    name = kernels.extension_name()
    _again, why = kernels.load_paged_decode()
    assert why is None and kernels.extension_name() == name  # torch's loader must not alter our flag lists


def _has(*needed: str) -> bool:
    from worker.model import kernels

    machine, flags = kernels._cpu_flags()
    return machine in ("x86_64", "AMD64") and set(needed) <= flags


BF16_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


@pytest.mark.parametrize(
    "dtype,hd,paths",
    [
        (torch.bfloat16, 64, [("avx512_bf16", BF16_FLAGS)]),
        (torch.bfloat16, 128, [("avx512_bf16", BF16_FLAGS)]),
        (torch.bfloat16, 32, []),
        (torch.float32, 64, [("avx512_fp32", ("avx512f",)), ("avx2_fp32", ("avx2", "fma"))]),
        (torch.float32, 128, [("avx512_fp32", ("avx512f",)), ("avx2_fp32", ("avx2", "fma"))]),
        (torch.float32, 32, []),
    ],
)
def test_the_path_named_for_the_log_is_the_one_this_cpu_takes(kernel, dtype, hd, paths):
    """`paths`: the fast paths for this dtype and head dim, widest first, with the CPU flags each needs."""
    named = paged_decode_path(dtype, hd)
    expected = next((path for path, flags in paths if _has(*flags)), "generic")
    assert named.startswith(expected), named


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, (4e-3, 1e-2)), (torch.float32, (1e-6, 1e-5))])
@pytest.mark.parametrize("hd", [64, 128])
def test_the_fast_paths_agree_with_the_portable_one(kernel, hd, dtype, tol):
    generic, why = load_paged_decode_generic()
    assert generic is not None, why
    gen = torch.Generator().manual_seed(hd)
    k = torch.randn(70, 16, 2, hd, generator=gen).to(dtype)
    v = torch.randn(70, 16, 2, hd, generator=gen).to(dtype)
    q = torch.randn(6, 8, hd, generator=gen).to(dtype)
    tables = torch.randperm(70, generator=gen)[:66].view(6, 11)
    lens = torch.tensor([1, 16, 17, 90, 160, 176])
    fast, portable = kernel(q, k, v, tables, lens, hd**-0.5), generic(q, k, v, tables, lens, hd**-0.5)
    assert torch.allclose(fast.float(), portable.float(), atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize(
    "lens,parts,bounds",
    [
        ([100] * 4, 2, [0, 2, 4]),  # equal lengths: equal counts
        ([700, 100, 100, 100, 100, 100, 100, 100], 2, [0, 1, 8]),  # one long context against seven short
        ([100, 100, 100, 100, 100, 100, 100, 700], 2, [0, 7, 8]),
        ([1, 1, 1, 1000], 2, [0, 3, 4]),
        ([600, 300, 500], 2, [0, 1, 3]),  # the half falls inside the 300: cut before it, the nearer side
        ([100] * 3, 4, [0, 1, 2, 3, 3]),  # more parts than sequences: the last ones empty
        ([5000, 1, 1], 3, [0, 1, 1, 3]),  # one sequence over two shares: the next part is empty, never reversed
        ([100] * 6, 1, [0, 6]),
        ([], 2, [0, 0, 0]),
    ],
)
def test_decode_split_balances_context_lengths(kernel, lens, parts, bounds):
    """Decode attention's threads take contiguous ranges of sequences cut where the summed lengths are even."""
    module, _ = _load_module()
    got = module.decode_split(torch.tensor(lens, dtype=torch.long), parts)
    assert got == bounds
    assert all(a <= b for a, b in itertools.pairwise(got)) and got[0] == 0 and got[-1] == len(lens)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_native_decode_covers_every_sequence_whatever_the_thread_count(kernel, threads):
    """Skewed lengths, more threads than cores: every sequence's output is its own (none skipped or left empty)."""
    gen = torch.Generator().manual_seed(threads)
    lens = torch.tensor([300, 1, 2, 250, 3, 1, 1, 17])
    tables = torch.randperm(160, generator=gen)[:152].view(8, 19)
    k = torch.randn(160, 16, 1, 64, generator=gen)
    v = torch.randn(160, 16, 1, 64, generator=gen)
    q = torch.randn(8, 2, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(q, k, v, tables, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    for s, n in enumerate(lens.tolist()):
        blocks = tables[s, : -(-n // 16)]
        ks = k[blocks].reshape(-1, 64)[:n]
        vs = v[blocks].reshape(-1, 64)[:n]
        want = torch.softmax(q[s] @ ks.T * 0.125, dim=-1) @ vs
        assert torch.allclose(out[s].view(2, 64), want, atol=1e-5), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 128])
def test_slots_past_a_context_never_reach_the_output(kernel, dtype, hd):
    """A sequence's last block holds, past its context, whatever was written there before (a freed request's rows,
    anything): NaN there must change no bit of any output. The bf16 P.V pass takes rows two at a time, so an odd
    context's last row must pair with zeros, not with the slot after it."""
    gen = torch.Generator().manual_seed(hd)
    bs, lens = 16, [1, 3, 16, 17, 31, 45]
    per_seq = [-(-n // bs) for n in lens]
    k = torch.randn(sum(per_seq), bs, 3, hd, generator=gen).to(dtype)
    v = torch.randn(sum(per_seq), bs, 3, hd, generator=gen).to(dtype)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int64)
    k_bad, v_bad = k.clone(), v.clone()
    first = 0
    for s, (n, blocks) in enumerate(zip(lens, per_seq, strict=True)):
        tables[s, :blocks] = torch.arange(first, first + blocks)
        last = first + blocks - 1
        k_bad[last, n - (blocks - 1) * bs :] = float("nan")
        v_bad[last, n - (blocks - 1) * bs :] = float("nan")
        first += blocks
    q = torch.randn(len(lens), 9, hd, generator=gen).to(dtype)
    n_t = torch.tensor(lens)
    clean, dirty = kernel(q, k, v, tables, n_t, hd**-0.5), kernel(q, k_bad, v_bad, tables, n_t, hd**-0.5)
    assert clean.isfinite().all() and torch.equal(clean, dirty)


def _kv_write():
    from worker.model.kernels import load_kv_write

    fn, why = load_kv_write()
    if fn is None:
        pytest.skip(f"native extension cannot be built here: {why}")
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_native_kv_write_matches_index_copy_from_qkv_views(dtype, tokens):
    """K and V as the model has them (strided views into the fused QKV rows) land in their slots, as index_copy_
    puts them; no other slot changes."""
    kv_write = _kv_write()
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 4 * 16 + 2 * 2 * 16, generator=gen).to(dtype)
    k = qkv[:, 64:96].view(tokens, 2, 16)
    v = qkv[:, 96:].view(tokens, 2, 16)
    slots = torch.randperm(20 * 8, generator=gen)[:tokens]
    k_cache, v_cache = torch.randn(20, 8, 2, 16, generator=gen).to(dtype), torch.randn(20, 8, 2, 16).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, 2, 16).index_copy_(0, slots, k)
    want_v.view(-1, 2, 16).index_copy_(0, slots, v)
    kv_write(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize(
    "slots,k_shape,match",
    [
        ([0, 160], (2, 2, 16), "slot out of range"),
        ([-1], (1, 2, 16), "slot out of range"),
        ([0, 1], (2, 3, 16), "k and v must be"),
        ([0], (2, 2, 16), "k and v must be"),
    ],
)
def test_native_kv_write_rejects_bad_input_and_writes_nothing(slots, k_shape, match):
    kv_write = _kv_write()
    k_cache, v_cache = torch.zeros(20, 8, 2, 16), torch.zeros(20, 8, 2, 16)
    k = torch.ones(k_shape)
    with pytest.raises(RuntimeError, match=match):
        kv_write(k_cache, v_cache, torch.tensor(slots), k, k.clone())
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [32, 64])  # the portable path and an AVX-512 one
def test_native_decode_takes_q_rows_from_the_fused_qkv_output(kernel, dtype, hd):
    """q as the model slices it out of the QKV rows (strided rows, each row's heads contiguous) gives exactly the
    output of a contiguous copy."""
    gen = torch.Generator().manual_seed(hd)
    k = torch.randn(30, 16, 2, hd, generator=gen).to(dtype)
    v = torch.randn(30, 16, 2, hd, generator=gen).to(dtype)
    qkv = torch.randn(5, 6 * hd + 4 * hd, generator=gen).to(dtype)
    q = qkv[:, : 6 * hd].view(5, 6, hd)
    assert not q.is_contiguous()
    tables = torch.randperm(30, generator=gen)[:25].view(5, 5)
    lens = torch.tensor([1, 17, 40, 80, 3])
    assert torch.equal(kernel(q, k, v, tables, lens, 0.1), kernel(q.contiguous(), k, v, tables, lens, 0.1))


# ---- the head-major cache (attention.cache_views; kernels.py: head_major_cache) ----


def _head_major_pair(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of token-major caches k, v [NB, BS, KVH, D] laid out head-major, as the runner allocates them."""
    nb, bs, kvh, hd = k.shape
    cache = torch.zeros(cache_shape(1, nb, bs, kvh, hd, head_major=True), dtype=k.dtype)
    ((kh, vh),) = cache_views(cache, head_major=True)
    kh.copy_(k)
    vh.copy_(v)
    return kh, vh


def test_cache_views_lay_a_block_out_head_by_head():
    cache = torch.arange(2 * 2 * 3 * 4 * 2 * 5, dtype=torch.float32).view(cache_shape(2, 3, 4, 2, 5, True))
    views = cache_views(cache, head_major=True)
    assert len(views) == 2
    k, v = views[1]
    assert k.shape == v.shape == (3, 4, 2, 5)  # indexed as [block, slot, head, dim] whatever the layout
    assert k[1, 2, 1, 3].item() == cache[1, 0, 1, 1, 2, 3].item() and v[0, 3, 0, 4].item() == cache[1, 1, 0, 0, 3, 4]
    assert k.stride() == (2 * 4 * 5, 5, 4 * 5, 1)  # one (block, head): block_size rows of head_dim, back to back
    token = cache_views(torch.zeros(cache_shape(2, 3, 4, 2, 5, False)), head_major=False)
    assert all(t.is_contiguous() and t.shape == (3, 4, 2, 5) for pair in token for t in pair)


@pytest.mark.parametrize(
    "dtype,hd,bs,flags",
    [
        (torch.bfloat16, 64, 16, BF16_FLAGS),
        (torch.bfloat16, 128, 32, BF16_FLAGS),
        (torch.float32, 64, 16, ("avx512f",)),
        (torch.float32, 128, 64, ("avx512f",)),
        (torch.float32, 32, 16, None),  # the AVX-512 passes take head dims of 64 and 128
        (torch.bfloat16, 64, 8, None),  # and blocks of 16k tokens
        (torch.float16, 64, 16, None),
    ],
)
def test_head_major_cache_where_the_avx512_passes_run(kernel, dtype, hd, bs, flags):
    assert head_major_cache(dtype, hd, bs) == (flags is not None and _has(*flags))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 64, 16), (2, 1, 64, 16)])
def test_head_major_cache_decodes_to_the_same_bits(kernel, dtype, heads, kv_heads, hd, bs):
    """The same values laid out head-major: the same passes over them, so the same output, bit for bit."""
    if not head_major_cache(dtype, hd, bs):
        pytest.skip("the AVX-512 decode passes do not run here")
    gen = torch.Generator().manual_seed(heads + hd + bs)
    k = torch.randn(50, bs, kv_heads, hd, generator=gen).to(dtype)
    v = torch.randn(50, bs, kv_heads, hd, generator=gen).to(dtype)
    kh, vh = _head_major_pair(k, v)
    assert kv_heads == 1 or not kh.is_contiguous()
    lens = torch.tensor([1, bs - 1, bs, bs + 1, 7 * bs + 5, 3])
    tables = torch.randperm(50, generator=gen)[:48].view(6, 8)
    q = torch.randn(6, heads, hd, generator=gen).to(dtype)
    assert torch.equal(kernel(q, kh, vh, tables, lens, 0.3), kernel(q, k, v, tables, lens, 0.3))


def test_a_cache_in_neither_layout_is_refused(kernel):
    q, tables, lens = torch.zeros(1, 4, 64), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    cache = torch.zeros(2, 16, 2, 64)
    odd = torch.zeros(2, 2, 64, 16).permute(0, 3, 1, 2)  # [NB, BS, KVH, D] with D strided
    with pytest.raises(RuntimeError, match="both token-major, or both head-major"):
        kernel(q, odd, odd, tables, lens, 1.0)
    kh, vh = _head_major_pair(cache, cache)
    with pytest.raises(RuntimeError, match="both token-major, or both head-major"):
        kernel(q, kh, cache, tables, lens, 1.0)
    generic, _ = load_paged_decode_generic()
    with pytest.raises(RuntimeError, match="AVX-512 passes only"):
        generic(q, kh, vh, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="AVX-512 passes only"):  # head dim 32: no AVX-512 pass takes it
        small = torch.zeros(2, 16, 2, 32)
        kernel(torch.zeros(1, 4, 32), *_head_major_pair(small, small), tables, lens, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native_write", [True, False])
def test_cache_writes_land_in_the_same_slots_head_major(dtype, native_write):
    """The native write and torch's (its fallback) put each token's K and V rows (strided views into QKV rows, as
    the model has them) where a token-major cache has them: the same tensors, indexed alike; no other slot moves."""
    kv_write = _kv_write() if native_write else None
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(40, 4 * 64 + 2 * 2 * 64, generator=gen).to(dtype)
    k, v = qkv[:, 256:384].view(40, 2, 64), qkv[:, 384:].view(40, 2, 64)
    slots = torch.randperm(20 * 16, generator=gen)[:40]
    k_cache = torch.randn(20, 16, 2, 64, generator=gen).to(dtype)
    v_cache = torch.randn(20, 16, 2, 64, generator=gen).to(dtype)
    kh, vh = _head_major_pair(k_cache, v_cache)
    k_cache.view(-1, 2, 64).index_copy_(0, slots, k)
    v_cache.view(-1, 2, 64).index_copy_(0, slots, v)
    write_kv(kh, vh, slots, k, v, kv_write)
    assert torch.equal(kh, k_cache) and torch.equal(vh, v_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_native", [True, False])
def test_paged_attention_reads_either_layout_alike(kernel, dtype, use_native):
    """A mixed step (two decodes, a prompt chunk after cached tokens, a fresh chunk) over a head-major cache and a
    token-major one: the same outputs and the same caches afterwards, through the native pieces or torch's."""
    if use_native and not head_major_cache(dtype, 64, 16):
        pytest.skip("the AVX-512 decode passes do not run here")
    from worker.model.kernels import load_kv_write, load_prefill_attention

    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(30, 16, 2, 64, generator=gen).to(dtype)
    v_cache = torch.randn(30, 16, 2, 64, generator=gen).to(dtype)
    kh, vh = _head_major_pair(k_cache, v_cache)
    spans = [SeqSpan(40, 1, [3, 7, 9]), SeqSpan(5, 1, [11]), SeqSpan(20, 12, [1, 2]), SeqSpan(0, 9, [20])]
    t = sum(s.num_tokens for s in spans)
    q = torch.randn(t, 4, 64, generator=gen).to(dtype)
    k = torch.randn(t, 2, 64, generator=gen).to(dtype)
    v = torch.randn(t, 2, 64, generator=gen).to(dtype)
    native = EAGER
    if use_native:
        native = NativeAttention(kernel, load_kv_write()[0], load_prefill_attention(dtype, 64)[0])
    meta = build_metadata(spans, 16, torch.device("cpu"), dtype, decode_kernel=use_native)
    want = paged_attention(q, k, v, k_cache, v_cache, meta, 0.125, native)
    got = paged_attention(q, k, v, kh, vh, meta, 0.125, native)
    assert torch.equal(got, want)
    assert torch.equal(kh, k_cache) and torch.equal(vh, v_cache)
