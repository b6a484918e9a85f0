"""The pool of fixed-size KV-cache blocks: allocation, reference counts, the prefix-cache index and LRU eviction.

Why a pool of its own: the model runner owns one big KV tensor carved into `num_blocks` blocks of `block_size`
token slots; everything above it speaks block ids. This module decides which ids are free, which are shared
(ref-counted) and which still hold a reusable prefix (hashed). Pure Python, no torch.

Free blocks are of two kinds:
- plain free blocks (never used, or released holding no cached prefix) are kept as runs of consecutive ids and
  handed out, placed so that a request's blocks lie next to each other in memory (below);
- freed blocks that are in the prefix-cache index wait in a queue, least recently used first, and are evicted in
  that order only when too few plain free blocks are left: into the plain runs, then placed like them. A
  prefix-cache hit takes one out of the queue again (`touch`).

Where a request's blocks lie: the decode attention reads each running request's K and V block by block, and it
reads them faster the longer the runs of consecutive blocks are (the hardware prefetchers and DRAM pages follow
ascending addresses; on consecutive tables the decode kernel reads as fast as a plain sum of the same bytes). On
W's own decode steps the tables of a pool handing out the front of one free queue (vLLM's and nano-vllm's way, ours
before stop 47) ran 3.6 consecutive ids (fresh), 1.7 (after a workload had shuffled the queue) and 1.1 (prefix
caching on, its cache full of evictable prefixes), and the consecutive tables of the same steps read 1.1-1.3x
faster (`bench/kv_layout.py --blocks`). So:
- a request that grows takes the block right after its last one when that is free (`get_new_blocks(after=...)`);
- a request also says how many more blocks it may ask for (its prompt and `max_tokens`: `room`), and the free
  blocks right after its last one are kept for it (a soft reservation: counted free, and taken by others only when
  no unreserved plain block is left);
- a new run starts at the first unreserved block of the longest unreserved stretch (where none is left, in the
  middle of the longest run). An empty pool starts at block 0.
W's tables now run 24.6 ids, every request's blocks consecutive (2.9 with prefix caching's full cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockHash:
    """Key of one full block in the prefix cache: the parent block's hash value plus this block's token ids.

    Chaining the parent makes equal keys mean equal whole prefixes, so a block is shared only when everything
    before it matches too. Equality compares the token ids themselves, so a collision of the 64-bit `value`
    alone can never alias two different blocks.

    `extra` keys a first block by what else its KV depends on besides the tokens (the LoRA adapter's id, None for
    the base model); the chain carries it to every later block.
    """

    __slots__ = ("extra", "parent", "token_ids", "value")

    def __init__(self, parent: BlockHash | None, token_ids: Sequence[int], extra: int | None = None) -> None:
        self.parent: int | None = None if parent is None else parent.value
        self.token_ids = tuple(token_ids)
        self.extra = extra
        self.value: int = hash((self.parent, self.token_ids) if extra is None else (self.parent, self.token_ids, extra))

    def __hash__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BlockHash)
            and self.value == other.value
            and self.parent == other.parent
            and self.token_ids == other.token_ids
            and self.extra == other.extra
        )

    def __repr__(self) -> str:
        return f"BlockHash({self.value:#x}, {len(self.token_ids)} tokens)"


class KVBlock:
    """One block of the KV cache as the pool tracks it (the tensor memory itself lives in the runner)."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class BlockPool:
    """All KV blocks of one engine. Every method is O(number of blocks it touches), but for starting a new run of
    blocks, which also scans the free runs (a handful per running request)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Plain free blocks as maximal runs [start, end) of consecutive ids, indexed both ways so that a block
        # joins its neighbours' runs in O(1) when freed.
        self._run_end: dict[int, int] = {0: num_blocks}
        self._run_start: dict[int, int] = {num_blocks: 0}
        self._num_plain = num_blocks
        # A running request's last block -> how many more blocks it may still ask for (`get_new_blocks`' room).
        self._room: dict[int, int] = {}
        # Unreferenced blocks still in the prefix-cache index, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never used, released, or cached but unreferenced (evictable)."""
        return self._num_plain + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (what `vllm:kv_cache_usage_perc` reports)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int, after: int | None = None, room: int = 0) -> list[KVBlock]:
        """`n` blocks, each with ref 1, consecutive where they can be: continuing after block `after` (the asking
        request's last one) where that is free, else in new runs (`_place`); where too few plain blocks are free,
        cached ones are evicted first (`_evict_for`). `room`: how many more blocks the request may ask for later
        (its prompt and `max_tokens` say): the free blocks right after its last one are kept for it while others
        have somewhere else to go."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks but only {self.num_free_blocks} are free")
        self._evict_for(n)
        ids: list[int] = []
        if after is not None:
            self._room.pop(after, None)  # its reservation moves to its new last block
            nxt = after + 1
            while len(ids) < n and nxt in self._run_end:
                ids.append(self._take_run_head(nxt))
                nxt += 1
        while len(ids) < n:
            want = n - len(ids)
            first, end = self._place(want)
            ids.extend(self._take_run_head(i) for i in range(first, min(end, first + want)))
        if room > 0 and ids:
            self._room[ids[-1]] = room
        out = [self.blocks[i] for i in ids]
        for block in out:
            block.ref_cnt = 1
        return out

    def _evict_for(self, n: int) -> None:
        """Cached free blocks, least recently used first, evicted into the plain runs until `n` plain blocks are
        free (or none is cached): evicted blocks are then placed like any plain one, joined with the free blocks
        beside them, instead of handed out one by one in the eviction queue's order (which, with a request's
        blocks queued tail first, put an engine's tables in runs of ~1.1 ids once its cache held nothing but
        finished requests' prefixes; W's through this, 2.9)."""
        while self._num_plain < n and self._lru:
            block_id, _ = self._lru.popitem(last=False)
            block = self.blocks[block_id]
            assert block.block_hash is not None
            del self._cached[block.block_hash]
            block.block_hash = None
            self._give_back_plain(block_id)

    def _place(self, want: int) -> tuple[int, int]:
        """Where a new run of up to `want` blocks starts, split off as the start of a plain run: (its first block,
        that run's end). The largest stretch of plain blocks that no running request has reserved, from its start;
        where every plain block is reserved, the middle of the largest run (a reservation shrinks)."""
        best, best_len = (0, 0), 0
        for start, end in self._run_end.items():
            kept = min(self._room.get(start - 1, 0), end - start)
            if end - start - kept > best_len:
                best, best_len = (start + kept, end), end - start - kept
        if best_len:
            first, end = best
        else:
            start, end = max(self._run_end.items(), key=lambda run: run[1] - run[0])
            first = start if start == 0 else start + max(0, end - start - want) // 2
        start = self._run_start[end]
        if first > start:  # the run's left part stays free: [start, first)
            self._run_end[start] = first
            self._run_start[first] = start
            self._run_end[first] = end
            self._run_start[end] = first
        return first, end

    def _take_run_head(self, block_id: int) -> int:
        """Take the first block of the plain run starting at `block_id`."""
        end = self._run_end.pop(block_id)
        if end > block_id + 1:
            self._run_end[block_id + 1] = end
            self._run_start[end] = block_id + 1
        else:
            del self._run_start[end]
        self._num_plain -= 1
        return block_id

    def _give_back_plain(self, block_id: int) -> None:
        """A plain block back among the free runs, joined with the runs on either side."""
        start, end = block_id, block_id + 1
        if block_id in self._run_start:  # a run ends right before it
            start = self._run_start.pop(block_id)
        if end in self._run_end:  # a run starts right after it
            end = self._run_end.pop(end)
            del self._run_start[end]
        self._run_end[start] = end
        self._run_start[end] = start
        self._num_plain += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on prefix-cache hits, pulling unreferenced ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._lru[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Enter a full, computed block into the prefix-cache index.

        If an equal prefix is already indexed (two requests computed it at the same time), the existing entry
        wins and this block stays a plain block, which joins the free runs once released.
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; blocks reaching zero become free again: plain ones join the free runs,
        cached ones the back of the eviction queue.

        Pass blocks in the order they should be evicted (callers pass a request's blocks tail first, since a
        prefix's last blocks are the least likely to be shared).
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._room.pop(block.block_id, None)
                if block.block_hash is None:
                    self._give_back_plain(block.block_id)
                else:
                    self._lru[block.block_id] = None
