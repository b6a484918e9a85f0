"""BlockPool: where blocks are placed (a request's blocks consecutive), ref counts, the prefix-cache index and LRU
eviction of unreferenced cached blocks."""

from __future__ import annotations

import random

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


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


@pytest.mark.parametrize(
    ("taken", "ask", "after", "expected"),
    [
        # (blocks held before, in id ranges; blocks asked for; the asking request's last block; ids handed out)
        ([], 3, None, [0, 1, 2]),  # an empty pool starts at block 0
        ([(0, 10)], 10, None, [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]),  # centred in the free run 10..99
        ([(0, 10)], 1, 9, [10]),  # a growing request takes the block after its last
        ([(0, 10)], 3, 9, [10, 11, 12]),
        ([(0, 10), (50, 60)], 2, 59, [60, 61]),
        ([(0, 10), (50, 60)], 1, 5, [29]),  # its next block is taken: a new run, centred in the largest free run
        ([(0, 10), (50, 60)], 4, None, [28, 29, 30, 31]),  # runs 10..49 (40) and 60..99 (40): the first largest
        ([(0, 98)], 4, 97, None),  # 2 free: refused, nothing taken
        ([(0, 95)], 4, 93, [95, 96, 97, 98]),  # block 94 is taken: a new run, centred in 95..99
        ([(0, 90)], 20, None, [90, 91, 92, 93, 94, 95, 96, 97, 98, 99]),  # the last run is too small: all of it
    ],
)
def test_where_new_blocks_go(taken, ask, after, expected) -> None:
    pool = BlockPool(100)
    for start, end in taken:
        held = pool.get_new_blocks(end - start, after=None if start == 0 else start - 1)
        assert _ids(held) == list(range(start, end))
    free = pool.num_free_blocks
    if ask > free:
        with pytest.raises(ValueError, match="free"):
            pool.get_new_blocks(ask, after=after)
        assert pool.num_free_blocks == free
        return
    assert _ids(pool.get_new_blocks(ask, after=after)) == expected
    assert pool.num_free_blocks == free - ask


def test_a_request_that_outgrows_its_room_continues_in_a_new_run() -> None:
    pool = BlockPool(20)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(2)  # centred in 2..19: 10, 11
    assert _ids(b) == [10, 11]
    for _ in range(8):
        a += pool.get_new_blocks(1, after=a[-1].block_id)
    grown = _ids(a)[2:]
    assert grown == [2, 3, 4, 5, 6, 7, 8, 9]  # a fills the room before b
    (nxt,) = pool.get_new_blocks(1, after=9)  # 10 is b's: a continues in the middle of 12..19
    assert nxt.block_id == 15


def test_freed_blocks_join_their_neighbours_runs() -> None:
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(10)
    pool.free_blocks([blocks[i] for i in (3, 5, 4)])  # 3 and 5, then 4 joins them into one run
    assert _ids(pool.get_new_blocks(3)) == [3, 4, 5]
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 10
    assert _ids(pool.get_new_blocks(10)) == list(range(10))  # one run again


def test_cached_free_blocks_are_not_taken_to_grow_while_plain_ones_are_free() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)  # 0, 1
    pool.cache_block(a[1], _h(1))
    pool.free_blocks([a[1]])  # 1: free, but holds a prefix
    (b,) = pool.get_new_blocks(1, after=0)
    assert b.block_id != 1 and pool.get_cached_block(_h(1)) is a[1]


def test_random_traffic_keeps_the_pool_consistent() -> None:
    """Requests growing, finishing and caching blocks at random: no block handed out twice, every free block
    counted once, the free runs maximal, and a freed pool one run again."""
    rng = random.Random(7)
    pool = BlockPool(64)
    held: dict[int, list] = {}
    for step in range(3000):
        rid = rng.randrange(12)
        if rid in held and rng.random() < 0.15:
            for block in held[rid]:
                if rng.random() < 0.3 and block.block_hash is None:
                    pool.cache_block(block, _h(step, block.block_id))
            pool.free_blocks(reversed(held.pop(rid)))
        elif pool.num_free_blocks:
            n = min(pool.num_free_blocks, rng.randint(1, 4))
            mine = held.setdefault(rid, [])
            mine += pool.get_new_blocks(n, after=mine[-1].block_id if mine else None)
        in_use = [b.block_id for blocks in held.values() for b in blocks]
        assert len(in_use) == len(set(in_use))
        assert all(pool.blocks[i].ref_cnt == 1 for i in in_use)
        assert pool.num_free_blocks == 64 - len(in_use)
        plain = [i for start, end in pool._run_end.items() for i in range(start, end)]
        assert len(plain) == len(set(plain)) and not set(plain) & set(in_use)
        assert all(end not in pool._run_end for end in pool._run_end.values())  # maximal: no two runs touch
    for blocks in held.values():
        pool.free_blocks(blocks)
    cached = pool.num_cached_blocks
    assert pool.num_free_blocks == 64
    assert len(pool._run_end) <= cached + 1  # only cached free blocks split the plain runs


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
