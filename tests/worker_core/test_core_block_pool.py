"""BlockPool: allocation order, ref counts, prefix-cache index and LRU eviction of unreferenced cached blocks."""

from __future__ import annotations

import pytest
from worker.core.block_pool import BlockHash, BlockPool


def _h(*tokens: int, parent: BlockHash | None = None) -> BlockHash:
    return BlockHash(parent, tokens)


def test_block_hash_chains_the_whole_prefix() -> None:
    a = _h(1, 2)
    assert _h(3, 4, parent=a) == _h(3, 4, parent=_h(1, 2))
    assert _h(3, 4, parent=a) != _h(3, 4, parent=_h(1, 9))  # same tokens, different prefix
    assert _h(3, 4, parent=a) != _h(3, 4)  # same tokens, no prefix
    assert _h(3, 4, parent=a) != _h(3, 5, parent=a)
    assert len({_h(3, 4, parent=a), _h(3, 4, parent=_h(1, 2))}) == 1


def test_new_blocks_come_in_id_order_with_one_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_asking_for_more_blocks_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_plain_blocks_are_reused_before_cached_ones_and_cached_ones_lru() -> None:
    pool = BlockPool(4)
    b0, b1, b2, b3 = pool.get_new_blocks(4)
    pool.cache_block(b0, _h(0))
    pool.cache_block(b1, _h(1))
    # Free cached b1 first, then cached b0, then plain b2, b3: plain ones go first, then LRU among cached.
    pool.free_blocks([b1])
    pool.free_blocks([b0])
    pool.free_blocks([b2, b3])
    order = [b.block_id for b in pool.get_new_blocks(4)]
    assert order[:2] in ([2, 3], [3, 2])
    assert order[2:] == [1, 0]
    assert pool.num_cached_blocks == 0  # evicted when handed out again
    assert pool.get_cached_block(_h(1)) is None


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(2)
    b0, _ = pool.get_new_blocks(2)
    pool.cache_block(b0, _h(7))
    pool.free_blocks([b0])
    assert pool.num_free_blocks == 1
    hit = pool.get_cached_block(_h(7))
    assert hit is b0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.touch([hit])  # shared by a second request
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free_blocks([hit])
    assert pool.num_free_blocks == 1 and pool.get_cached_block(_h(7)) is hit  # still cached while free


def test_an_equal_prefix_already_indexed_keeps_its_block() -> None:
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, _h(5))
    pool.cache_block(b1, _h(5))
    assert pool.get_cached_block(_h(5)) is b0
    assert b1.block_hash is None


def test_caching_disabled_indexes_nothing() -> None:
    pool = BlockPool(1, enable_caching=False)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_block(b0, _h(1))
    assert pool.get_cached_block(_h(1)) is None


def test_freeing_an_unreferenced_block_raises() -> None:
    pool = BlockPool(1)
    (b0,) = pool.get_new_blocks(1)
    pool.free_blocks([b0])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([b0])


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BlockPool(0)
