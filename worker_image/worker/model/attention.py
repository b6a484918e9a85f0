"""Paged attention over one flattened, variable-length batch, in plain torch.

Why this shape: each engine step mixes decodes (one new token per request) with prefill chunks (many tokens,
possibly continuing after a cached prefix). All tokens of the step form one `[T, ...]` batch so every linear
layer runs once per step; only attention needs to know where one request ends and the next begins.

The per-step `AttentionMetadata` is built once (`build_metadata`) and shared by every layer:

* `slot_mapping[t]` is the cache slot (`block_id * block_size + offset`) that token `t`'s K/V are written to.
* Single-token sequences (decodes, and 1-token prefill/recompute chunks) come first in the batch. They attend
  in one batched call: their blocks are gathered through a padded block table into `[D, L, kv_heads, head_dim]`
  and masked past each context length. The query heads of one KV head are laid out as the "query length"
  axis (`[D, kv_heads, group, head_dim]`), so grouped-query attention needs no K/V repetition.
* Multi-token chunks follow, each attending causally. A chunk starting at position 0 attends to its own fresh
  K/V; a chunk with `start_pos > 0` (chunked prefill, prefix-cache hit, recompute) reads its whole context back
  through its block table with a lower-right causal mask (query `i` sees keys `0 .. start_pos + i`).

The cache of one layer is a pair of tensors `[num_blocks, block_size, kv_heads, head_dim]` (vLLM's layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    decode_block_idx: torch.Tensor | None  # [num_decode * decode_blocks] int64, padded block tables flattened
    decode_blocks: int
    decode_mask: torch.Tensor | None  # additive [num_decode, 1, 1, decode_blocks * block_size]
    prefills: tuple[PrefillChunk, ...]


def build_metadata(
    spans: Sequence[SeqSpan], block_size: int, device: torch.device, mask_dtype: torch.dtype
) -> AttentionMetadata:
    """Metadata for a batch whose single-token spans all come before the multi-token ones."""
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
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(start, end)
            )
            block_idx = mask = None
            if start > 0:
                block_idx = torch.tensor(table[:num_blocks], dtype=torch.int64, device=device)
                q_pos = torch.arange(start, end, device=device)[:, None]
                k_pos = torch.arange(end, device=device)[None, :]
                mask = torch.zeros(n, end, dtype=mask_dtype, device=device)
                mask.masked_fill_(k_pos > q_pos, float("-inf"))
                mask = mask[None, None]
            prefills.append(PrefillChunk(q_start, n, start, block_idx, mask))
        q_start += n
    decode_block_idx = decode_mask = None
    decode_blocks = 0
    if num_decode:
        decode_blocks = max(len(t) for t in decode_tables)
        padded = [list(t) + [0] * (decode_blocks - len(t)) for t in decode_tables]
        decode_block_idx = torch.tensor(padded, dtype=torch.int64, device=device).view(-1)
        lens = torch.tensor(decode_lens, device=device)
        k_pos = torch.arange(decode_blocks * block_size, device=device)
        decode_mask = torch.zeros(num_decode, 1, 1, k_pos.numel(), dtype=mask_dtype, device=device)
        decode_mask.masked_fill_((k_pos[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decode=num_decode,
        decode_block_idx=decode_block_idx,
        decode_blocks=decode_blocks,
        decode_mask=decode_mask,
        prefills=tuple(prefills),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H * D]."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    d = meta.num_decode
    if d:
        ctx = meta.decode_blocks * block_size
        kd = k_cache.index_select(0, meta.decode_block_idx).view(d, ctx, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache.index_select(0, meta.decode_block_idx).view(d, ctx, num_kv_heads, head_dim).transpose(1, 2)
        qd = q[:d].view(d, num_kv_heads, group, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:d] = od.reshape(d, num_heads * head_dim)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        qc = q[rows].transpose(0, 1)[None]
        if chunk.block_idx is None:
            kc = k[rows].transpose(0, 1)[None]
            vc = v[rows].transpose(0, 1)[None]
            oc = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kv_len = chunk.start_pos + chunk.q_len
            kc = k_cache.index_select(0, chunk.block_idx).view(-1, num_kv_heads, head_dim)[:kv_len]
            vc = v_cache.index_select(0, chunk.block_idx).view(-1, num_kv_heads, head_dim)[:kv_len]
            oc = F.scaled_dot_product_attention(
                qc, kc.transpose(0, 1)[None], vc.transpose(0, 1)[None], attn_mask=chunk.mask, scale=scale,
                enable_gqa=True,
            )
        out[rows] = oc[0].transpose(0, 1).reshape(chunk.q_len, num_heads * head_dim)
    return out
