"""Paged attention over one flattened, variable-length batch.

Why this shape: each engine step mixes decodes (one new token per request) with prefill chunks (many tokens,
possibly continuing after a cached prefix). All tokens of the step form one `[T, ...]` batch so every linear
layer runs once per step; only attention needs to know where one request ends and the next begins.

The per-step `AttentionMetadata` is built once (`build_metadata`) and shared by every layer:

* `slot_mapping[t]` is the cache slot (`block_id * block_size + offset`) that token `t`'s K/V are written to.
* Single-token sequences (decodes, and 1-token prefill/recompute chunks) come first in the batch. They attend
  in one call: on CPU the native kernel (`kernels.py`) walks each block table and reads K/V in place; the
  eager path (other devices, `enforce_eager`, or no compiler) gathers the blocks through a padded block
  table into `[D, L, kv_heads, head_dim]`, masks past each context length and runs SDPA with the query
  heads of one KV head laid out as the "query length" axis (`[D, kv_heads, group, head_dim]`), so
  grouped-query attention needs no K/V repetition.
* Multi-token chunks follow, each attending causally. A chunk starting at position 0 attends to its own fresh
  K/V; a chunk with `start_pos > 0` (chunked prefill, prefix-cache hit, recompute) reads its whole context back
  through its block table with a lower-right causal mask (query `i` sees keys `0 .. start_pos + i`). On CPU the
  chunks go to a native kernel where one runs (bf16 on AMX: `kernels.amx_attention_`; fp32 on AVX-512 or AVX2 +
  FMA: `kernels.f32_attention_`, which also takes bf16 chunks widened where there is no AMX; each takes the causal
  offset itself and writes the chunk's rows of the output in place); elsewhere to torch's SDPA.

The native pieces travel together as a `NativeAttention` (the runner loads them once; each is None where it
does not run, and the torch path takes its place).

The cache of one layer is a pair of tensors `[num_blocks, block_size, kv_heads, head_dim]` (vLLM's layout). Where
the native decode kernel reads it (`kernels.head_major_cache`: bf16 or fp32 on AVX-512) they lie head-major in
memory (`[num_blocks, kv_heads, block_size, head_dim]`, handed over as views of the shape above; `cache_views`):
the same indexing for every reader, a (block, head) in one run of memory for the decode kernel (kernels.py says
what that gains). Torch's ops here take either layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.kernels import KvWrite, PagedDecode, PrefillAttention


@dataclass(frozen=True)
class NativeAttention:
    """The extension's attention pieces (`kernels.py`); each None where it does not run here, and torch's path
    runs instead."""

    decode: PagedDecode | None = None  # the decode rows over the paged cache (`kernels.load_paged_decode`)
    kv_write: KvWrite | None = None  # this step's K/V rows into their cache slots (`kernels.load_kv_write`)
    prefill: PrefillAttention | None = None  # causal attention of a prompt chunk (`kernels.load_prefill_attention`)


EAGER = NativeAttention()


@dataclass(frozen=True)
class SeqSpan:
    """Where one request's tokens of this step sit: `num_tokens` tokens from position `start_pos`."""

    start_pos: int
    num_tokens: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class PrefillChunk:
    q_start: int  # first row of the chunk in the flattened batch
    q_len: int
    start_pos: int
    block_idx: torch.Tensor | None  # blocks holding positions 0 .. start_pos + q_len (None when start_pos == 0)
    mask: torch.Tensor | None  # additive [1, 1, q_len, kv_len] lower-right causal mask (None when start_pos == 0)


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    num_decode: int  # rows 0 .. num_decode are single-token sequences
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor | None  # [num_decode] int64
    decode_mask: torch.Tensor | None  # additive [num_decode, 1, 1, max_blocks * block_size] (eager path only)
    prefills: tuple[PrefillChunk, ...]


def build_metadata(
    spans: Sequence[SeqSpan],
    block_size: int,
    device: torch.device,
    mask_dtype: torch.dtype,
    decode_kernel: bool = False,
) -> AttentionMetadata:
    """Metadata for a batch whose single-token spans all come before the multi-token ones.

    With `decode_kernel` the decode rows go to the native kernel (block tables + lengths); otherwise to the
    eager path, which also needs an additive mask over the padded block tables.
    """
    positions: list[int] = []
    slots: list[int] = []
    num_decode = 0
    decode_tables: list[Sequence[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    q_start = 0
    for span in spans:
        start, n, table = span.start_pos, span.num_tokens, span.block_ids
        end = start + n
        num_blocks = -(-end // block_size)
        if num_blocks > len(table):
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
        if n == 1:
            if prefills:
                raise ValueError("single-token spans must come before multi-token spans")
            num_decode += 1
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
            decode_tables.append(table[:num_blocks])
            decode_lens.append(end)
        else:
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            block_idx = mask = None
            if start > 0:
                block_idx = torch.tensor(table[:num_blocks], dtype=torch.int64, device=device)
                mask = causal_chunk_mask(start, n, mask_dtype, device)
            prefills.append(PrefillChunk(q_start, n, start, block_idx, mask))
        q_start += n
    tables = lens = decode_mask = None
    if num_decode:
        max_blocks = max(len(t) for t in decode_tables)
        tables = torch.tensor(
            [list(t) + [0] * (max_blocks - len(t)) for t in decode_tables], dtype=torch.int64, device=device
        )
        lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
        if not decode_kernel:
            k_pos = torch.arange(max_blocks * block_size, device=device)
            decode_mask = torch.zeros(num_decode, 1, 1, k_pos.numel(), dtype=mask_dtype, device=device)
            decode_mask.masked_fill_((k_pos[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decode=num_decode,
        decode_block_tables=tables,
        decode_context_lens=lens,
        decode_mask=decode_mask,
        prefills=tuple(prefills),
    )


def cache_shape(
    layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, head_major: bool
) -> tuple[int, ...]:
    """The shape to allocate a whole cache in ([layers, 2 (K, V), ...] in memory order) for `cache_views`."""
    if head_major:
        return (layers, 2, num_blocks, kv_heads, block_size, head_dim)
    return (layers, 2, num_blocks, block_size, kv_heads, head_dim)


def cache_views(cache: torch.Tensor, head_major: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) of a cache allocated in `cache_shape`, as [num_blocks, block_size, kv_heads, head_dim]
    views (head-major ones strided)."""
    if head_major:
        return [(cache[i, 0].transpose(1, 2), cache[i, 1].transpose(1, 2)) for i in range(cache.shape[0])]
    return [(cache[i, 0], cache[i, 1]) for i in range(cache.shape[0])]


def causal_chunk_mask(start: int, n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The additive [1, 1, n, start + n] mask of a chunk of n queries after `start` cached tokens: query i sees keys
    0 .. start + i (lower-right causal)."""
    q_pos = torch.arange(start, start + n, device=device)[:, None]
    k_pos = torch.arange(start + n, device=device)[None, :]
    mask = torch.zeros(n, start + n, dtype=dtype, device=device)
    mask.masked_fill_(k_pos > q_pos, float("-inf"))
    return mask[None, None]


def prefill_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Torch's path for one prompt chunk: q [n, H, D], k and v [kv_len, KVH, D] (its whole context), `mask` from
    `causal_chunk_mask` (None: the chunk starts at position 0, plain causal). Returns [n, H * D]."""
    n, num_heads, head_dim = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(n, num_heads * head_dim)


def decode_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_idx: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Eager decode attention: gather the padded block tables, then one batched SDPA call. Returns [D, H * hd]."""
    d, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    ctx = block_idx.numel() // d * block_size
    k = k_cache.index_select(0, block_idx).view(d, ctx, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, block_idx).view(d, ctx, num_kv_heads, head_dim).transpose(1, 2)
    qd = q.view(d, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
    return out.reshape(d, num_heads * head_dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    native: NativeAttention = EAGER,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H * D].

    `native`: the extension's pieces where they run (metadata built with `decode_kernel=True` when
    `native.decode` is set); torch's index_copy_, gather + SDPA and SDPA where they do not.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v, native.kv_write)
    d = meta.num_decode
    if d == num_tokens:  # a pure decode step: no copy into `out` needed
        return _decode(q, k_cache, v_cache, meta, scale, native.decode)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if d:
        out[:d] = _decode(q[:d], k_cache, v_cache, meta, scale, native.decode)
    prefill = native.prefill if all(_heads_contiguous(x) for x in (q, k, v)) else None
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        kc, vc = k[rows], v[rows]
        if chunk.block_idx is not None:  # the whole context, read back from the cache
            kv_len = chunk.start_pos + chunk.q_len
            kc = k_cache.index_select(0, chunk.block_idx).view(-1, num_kv_heads, head_dim)[:kv_len]
            vc = v_cache.index_select(0, chunk.block_idx).view(-1, num_kv_heads, head_dim)[:kv_len]
        if prefill is not None:
            prefill(out[rows], q[rows], kc, vc, chunk.start_pos, scale)
            continue
        out[rows] = prefill_attention_sdpa(q[rows], kc, vc, chunk.mask, scale)
    return out


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_write: KvWrite | None,
) -> None:
    """K and V rows [T, kv_heads, head_dim] into their cache slots, either layout: the native write where it runs
    and takes k and v as they are, torch's index ops otherwise."""
    if kv_write is not None and _heads_contiguous(k) and _heads_contiguous(v):
        kv_write(k_cache, v_cache, slots, k, v)
    elif k_cache.is_contiguous():
        num_kv_heads, head_dim = k_cache.shape[2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
    else:  # head-major (`cache_views`): the same indexing on strided views
        blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
        k_cache[blocks, offsets] = k
        v_cache[blocks, offsets] = v


def _heads_contiguous(x: torch.Tensor) -> bool:
    """Whether each row of x [T, heads, head_dim] holds its heads back to back (the rows themselves may be
    strided, as views into the fused QKV output are): what the native kernels take without a copy."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_kernel: PagedDecode | None,
) -> torch.Tensor:
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
    if decode_kernel is not None:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        q = q if _heads_contiguous(q) else q.contiguous()
        return decode_kernel(q, k_cache, v_cache, tables, lens, scale)
    assert meta.decode_mask is not None
    return decode_attention_sdpa(q, k_cache, v_cache, meta.decode_block_tables.view(-1), meta.decode_mask, scale)
