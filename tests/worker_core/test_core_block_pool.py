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
    "calls",
    [
        # each call: (blocks asked for, the asker's last block or None, its room for later, the ids it gets)
        pytest.param([(3, None, 0, [0, 1, 2])], id="an empty pool starts at block 0"),
        pytest.param([(10, None, 0, list(range(10))), (10, None, 0, list(range(10, 20)))], id="no room: side by side"),
        pytest.param(
            [(10, None, 20, list(range(10))), (10, None, 0, list(range(30, 40))), (2, 9, 18, [10, 11])],
            id="room kept after a request's last block, then grown into",
        ),
        pytest.param(
            [
                (10, None, 5, list(range(10))),
                (10, None, 0, list(range(15, 25))),
                (5, 9, 0, [10, 11, 12, 13, 14]),
                (1, 14, 0, [25]),
            ],
            id="outgrowing its room: a new run after the next request",
        ),
        pytest.param(
            [(10, None, 10, list(range(10))), (5, None, 0, list(range(20, 25))), (3, 24, 0, [25, 26, 27])],
            id="a later request grows after its own last block",
        ),
    ],
)
def test_where_new_blocks_go(calls) -> None:
    pool = BlockPool(100)
    for ask, after, room, expected in calls:
        free = pool.num_free_blocks
        assert _ids(pool.get_new_blocks(ask, after=after, room=room)) == expected
        assert pool.num_free_blocks == free - ask


def test_a_room_is_given_up_when_nothing_else_is_free() -> None:
    pool = BlockPool(20)
    assert _ids(pool.get_new_blocks(10, room=10)) == list(range(10))  # 10..19 kept for it
    assert _ids(pool.get_new_blocks(4)) == [13, 14, 15, 16]  # nothing unkept: the middle of the run
    assert _ids(pool.get_new_blocks(3, after=9)) == [10, 11, 12]  # what is left of the room


def test_the_room_goes_with_the_request() -> None:
    """A freed request keeps no room; a grown one keeps it after its new last block."""
    pool = BlockPool(40)
    a = pool.get_new_blocks(5, room=10)  # 0..4, 5..14 kept
    assert _ids(pool.get_new_blocks(5)) == list(range(15, 20))
    pool.free_blocks(reversed(a))
    assert _ids(pool.get_new_blocks(3)) == [20, 21, 22]  # the longest stretch: 20..39 against 0..14
    b = pool.get_new_blocks(2, room=30)  # 23, 24, then 25..39 kept
    assert _ids(b) == [23, 24]
    assert _ids(pool.get_new_blocks(4)) == [0, 1, 2, 3]
    assert _ids(pool.get_new_blocks(1, after=24, room=5)) == [25]


def test_a_request_that_outgrows_its_room_continues_in_a_new_run() -> None:
    pool = BlockPool(20)
    a = pool.get_new_blocks(2, room=8)  # 0, 1; 2..9 kept
    b = pool.get_new_blocks(2, room=4)  # 10, 11; 12..15 kept
    assert _ids(b) == [10, 11]
    for left in range(7, -1, -1):
        a += pool.get_new_blocks(1, after=a[-1].block_id, room=left)
    assert _ids(a)[2:] == [2, 3, 4, 5, 6, 7, 8, 9]  # a fills its room, before b
    (nxt,) = pool.get_new_blocks(1, after=9)  # 10 is b's: a continues after b's room
    assert nxt.block_id == 16


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
    """Requests growing (with rooms), finishing and caching blocks at random: no block handed out twice, every free
    block counted once, the free runs maximal, rooms kept only after running requests, a freed pool one run again."""
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
            mine += pool.get_new_blocks(n, after=mine[-1].block_id if mine else None, room=rng.randint(0, 8))
        in_use = [b.block_id for blocks in held.values() for b in blocks]
        assert len(in_use) == len(set(in_use))
        assert all(pool.blocks[i].ref_cnt == 1 for i in in_use)
        assert pool.num_free_blocks == 64 - len(in_use)
        plain = [i for start, end in pool._run_end.items() for i in range(start, end)]
        assert len(plain) == len(set(plain)) and not set(plain) & set(in_use)
        assert all(end not in pool._run_end for end in pool._run_end.values())  # maximal: no two runs touch
        assert set(pool._room) <= {blocks[-1].block_id for blocks in held.values()}  # rooms: live requests' only
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


def test_cached_blocks_are_evicted_least_recently_used_first_and_only_as_many_as_needed() -> None:
    pool = BlockPool(4)
    b0, b1, b2, b3 = pool.get_new_blocks(4)
    pool.cache_block(b0, _h(0))
    pool.cache_block(b1, _h(1))
    # Free cached b1 first, then cached b0, then plain b2, b3: plain ones go first, then LRU among cached.
    pool.free_blocks([b1])
    pool.free_blocks([b0])
    pool.free_blocks([b2, b3])
    assert _ids(pool.get_new_blocks(3)) == [1, 2, 3]  # b1 evicted into the free run beside 2 and 3
    assert pool.get_cached_block(_h(1)) is None and b1.block_hash is None
    assert pool.get_cached_block(_h(0)) is b0 and pool.num_cached_blocks == 1  # b0 kept: not needed
    assert _ids(pool.get_new_blocks(1)) == [0]
    assert pool.num_cached_blocks == 0


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
