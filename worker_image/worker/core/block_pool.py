"""The pool of fixed-size KV-cache blocks: allocation, reference counts, the prefix-cache index and LRU eviction.

Why a pool of its own: the model runner owns one big KV tensor carved into `num_blocks` blocks of `block_size`
token slots; everything above it speaks block ids. This module decides which ids are free, which are shared
(ref-counted) and which still hold a reusable prefix (hashed). Pure Python, no torch.

Free blocks wait in one ordered queue, allocated from the front:
- a freed block that holds no cached prefix goes to the FRONT (nothing is lost by reusing it first);
- a freed block that is in the prefix-cache index goes to the BACK, so cached blocks are evicted least recently
  used first, and only when no plain free block is left.
A prefix-cache hit on a free cached block takes it out of the queue again (`touch`).
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
    """All KV blocks of one engine. Every method is O(number of blocks it touches)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block id -> None, in allocation order (front first); a dict gives O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never used, released, or cached but unreferenced (evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (what `vllm:kv_cache_usage_perc` reports)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the front of the free queue, evicting their cached prefixes, each with ref 1."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks but only {len(self._free)} are free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on prefix-cache hits, pulling unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Enter a full, computed block into the prefix-cache index.

        If an equal prefix is already indexed (two requests computed it at the same time), the existing entry
        wins and this block stays a plain block that is recycled first once freed.
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; blocks reaching zero return to the free queue.

        Pass blocks in the order they should be evicted (callers pass a request's blocks tail first, since a
        prefix's last blocks are the least likely to be shared).
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)
