"""KVCacheManager: block tables, prefix hits only on whole matching prefixes, all-or-nothing allocation, release."""

from __future__ import annotations

import pytest
from worker.core import kv_cache_manager as kvm
from worker.core.kv_cache_manager import KVCacheManager, token_slice
from worker.core.request import Request, SamplingParams

BS = 4


def _req(rid: str, prompt: list[int], outputs: list[int] = ()) -> Request:
    req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams())
    req.output_token_ids = list(outputs)
    return req


def _compute(mgr: KVCacheManager, req: Request, n: int, hits=None) -> list[int]:
    """Allocate and pretend the step ran: advance num_computed_tokens and index full blocks."""
    ids = mgr.allocate_slots(req, n, hits)
    assert ids is not None
    req.num_computed_tokens += n + (len(hits) * BS if hits else 0)
    mgr.cache_computed_blocks(req)
    return list(ids)


@pytest.mark.parametrize(
    ("prompt", "outputs", "start", "end", "expected"),
    [
        ([1, 2, 3], [4, 5], 0, 5, [1, 2, 3, 4, 5]),
        ([1, 2, 3], [4, 5], 1, 3, [2, 3]),
        ([1, 2, 3], [4, 5], 2, 4, [3, 4]),
        ([1, 2, 3], [4, 5], 3, 5, [4, 5]),
        ([1, 2, 3], [4, 5], 4, 5, [5]),
    ],
)
def test_token_slice(prompt, outputs, start, end, expected) -> None:
    assert token_slice(_req("r", prompt, outputs), start, end) == expected


def test_allocation_covers_the_tokens_and_grows_block_by_block() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    req = _req("a", list(range(10)))
    assert _compute(mgr, req, 10) == [0, 1, 2]  # 10 tokens -> 3 blocks
    req.output_token_ids.append(99)
    assert _compute(mgr, req, 1) == [0, 1, 2]  # token 11 fits in block 2
    req.output_token_ids.append(98)
    req.output_token_ids.append(97)
    assert _compute(mgr, req, 1) == [0, 1, 2]  # token 12 fills block 2
    assert len(mgr.allocate_slots(req, 1)) == 4  # token 13 needs a 4th block


def test_allocation_is_all_or_nothing() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    a = _req("a", list(range(8)))
    _compute(mgr, a, 8)
    b = _req("b", list(range(100, 109)))
    assert mgr.allocate_slots(b, 9) is None  # needs 3 blocks, 1 free
    assert mgr.pool.num_free_blocks == 1
    assert mgr.get_block_ids("b") == []


def test_prefix_hit_needs_the_whole_prefix_to_match() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    a_blocks = _compute(mgr, a, 13)
    mgr.free("a", finished=True)

    same_prefix = _req("b", [1, 2, 3, 4, 5, 6, 7, 8, 50, 51])
    hits, n = mgr.get_computed_blocks(same_prefix)
    assert n == 8 and [b.block_id for b in hits] == a_blocks[:2]

    # The second block's tokens match, but the first does not: no hit at all.
    other_first = _req("c", [0, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert mgr.get_computed_blocks(other_first) == ([], 0)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(8)))
    _compute(mgr, a, 8)
    b = _req("b", list(range(8)))
    hits, n = mgr.get_computed_blocks(b)
    assert n == 4 and len(hits) == 1  # 7 reusable tokens round down to one block


def test_blocks_are_indexed_only_once_computed() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(12)))
    assert mgr.allocate_slots(a, 12) is not None  # allocated, step not run yet
    assert mgr.get_computed_blocks(_req("b", list(range(12)))) == ([], 0)
    a.num_computed_tokens = 12
    mgr.cache_computed_blocks(a)
    _, n = mgr.get_computed_blocks(_req("b", list(range(12))))
    assert n == 8


def test_shared_hit_blocks_are_ref_counted_and_all_return() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(9)))
    _compute(mgr, a, 9)
    b = _req("b", list(range(9)))
    hits, n = mgr.get_computed_blocks(b)
    ids = _compute(mgr, b, b.num_tokens - n, hits)
    assert ids[:2] == mgr.get_block_ids("a")[:2]
    assert [mgr.pool.blocks[i].ref_cnt for i in ids] == [2, 2, 1]
    mgr.free("a", finished=True)
    mgr.free("b", finished=True)
    assert mgr.pool.num_free_blocks == 8
    assert all(blk.ref_cnt == 0 for blk in mgr.pool.blocks)


def test_evictable_hit_blocks_count_against_free_space() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    a = _req("a", list(range(8)))
    _compute(mgr, a, 8)
    mgr.free("a", finished=True)  # 2 cached blocks, free but evictable; 3 free in all
    b = _req("b", list(range(8)) + list(range(50, 58)))  # 16 tokens = 4 blocks, 2 of them hits
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    # 2 hits (leave the free queue) + 2 new blocks > 3 blocks: refused without side effects.
    assert mgr.allocate_slots(b, 8, hits) is None
    assert mgr.pool.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in mgr.pool.blocks)


def test_preempted_request_refinds_its_prefix_and_hashes_are_not_recomputed(monkeypatch) -> None:
    made = []
    real = kvm.BlockHash

    def counting(parent, tokens):
        made.append(tuple(tokens))
        return real(parent, tokens)

    monkeypatch.setattr(kvm, "BlockHash", counting)
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(10)))
    _compute(mgr, a, 10)
    assert len(made) == 2
    for _ in range(2):  # decode 2 tokens: one more full block (12 known tokens)
        a.output_token_ids.append(7)
        _compute(mgr, a, 1)
    assert len(made) == 3
    mgr.free("a", finished=False)  # preempted
    a.num_computed_tokens = 0
    _hits, n = mgr.get_computed_blocks(a)
    assert n == 8  # 12 known tokens, the last must be recomputed: 2 whole blocks reused
    assert len(made) == 3  # no re-hashing


def test_caching_disabled_never_hits_and_counts_nothing() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = _req("a", list(range(8)))
    _compute(mgr, a, 8)
    assert mgr.get_computed_blocks(_req("b", list(range(8)))) == ([], 0)
    mgr.record_lookup(8, 0)
    assert mgr.prefix_cache_queries == 0


def test_requests_growing_side_by_side_keep_their_blocks_consecutive() -> None:
    """Two requests admitted together, then decoding in turns: each one's table stays one run of ids (the pool
    keeps room for the first request's max_tokens behind it, and places the second after that)."""
    mgr = KVCacheManager(num_blocks=40, block_size=BS)
    a, b = _req("a", list(range(8))), _req("b", list(range(100, 108)))
    a.sampling_params = b.sampling_params = SamplingParams(max_tokens=24)
    _compute(mgr, a, 8)
    _compute(mgr, b, 8)
    for t in range(24):
        for req in (a, b):
            req.output_token_ids.append(t)
            _compute(mgr, req, 1)
    for rid in ("a", "b"):
        ids = mgr.get_block_ids(rid)
        assert len(ids) == 8 and ids == list(range(ids[0], ids[0] + 8)), ids
