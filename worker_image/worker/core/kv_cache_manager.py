"""Per-request view of the paged KV cache: block tables, prefix-cache lookups and block release.

The scheduler asks three questions of it: which leading blocks of a new request are already cached
(`get_computed_blocks`), can this request get room for N more tokens (`allocate_slots`, which answers None
rather than over-committing), and give back everything a request held (`free`). Full blocks enter the prefix
cache only after the step that computed their KV (`cache_computed_blocks`), so a hit never reads KV that is
still being written. Block hashes are computed once per full block and kept for the request's lifetime, so a
preempted request re-finds its own prefix without re-hashing, and no step re-hashes a whole prompt. A request
with a LoRA adapter keys its first block (hence its whole chain) by the adapter's id: KV computed under one
adapter is never reused for another one or for the base model.
"""

from __future__ import annotations

from worker.core.block_pool import BlockHash, BlockPool, KVBlock
from worker.core.request import Request


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """request.all_token_ids[start:end] without concatenating the whole sequence."""
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output_token_ids[start - n : end - n]
    return prompt[start:] + request.output_token_ids[: end - n]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_indexed: dict[str, int] = {}  # leading blocks of the request that are in the prefix index
        self._hashes: dict[str, list[BlockHash]] = {}
        self.prefix_cache_queries = 0  # tokens looked up (cumulative)
        self.prefix_cache_hits = 0  # tokens found (cumulative)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: a live list, extended as the request grows (`ScheduledSeq.block_ids` is it)."""
        return self._block_ids.get(request_id, [])

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of all full blocks of the request's known tokens, extending the kept list incrementally."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        num_full = request.num_tokens // bs
        parent = hashes[-1] if hashes else None
        extra = None if request.lora is None else request.lora.lora_id
        for i in range(len(hashes), num_full):
            tokens = token_slice(request, i * bs, (i + 1) * bs)
            parent = BlockHash(parent, tokens) if i or extra is None else BlockHash(parent, tokens, extra)
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached leading blocks for a request that holds no blocks; (blocks, tokens they cover).

        At most `num_tokens - 1` tokens are reused: the last known token must be computed to get logits.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup for the prefix-cache hit-rate metrics."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` after the computed ones (prefix hits included); None if it cannot.

        `new_computed_blocks` (from `get_computed_blocks`) is only passed for a request that holds no blocks
        yet; on success they become the head of its block table. On failure nothing changes.
        """
        req_id = request.request_id
        if not new_computed_blocks:  # a running request whose table has room (a decode, 15 steps in 16): as is
            block_ids = self._block_ids.get(req_id)
            if block_ids and request.num_computed_tokens + num_new_tokens <= len(block_ids) * self.block_size:
                return block_ids
        blocks = self._blocks.get(req_id)
        hits = new_computed_blocks or []
        num_held = (len(blocks) if blocks else 0) + len(hits)
        total_tokens = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_needed = -(-total_tokens // self.block_size) - num_held
        if num_needed > 0:
            evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)  # they leave the free queue when touched
            if num_needed > self.pool.num_free_blocks - evictable_hits:
                return None
        if blocks is None:
            blocks = self._blocks[req_id] = []
            self._block_ids[req_id] = []
            self._num_indexed[req_id] = 0
        block_ids = self._block_ids[req_id]
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            block_ids.extend(b.block_id for b in hits)
            self._num_indexed[req_id] = len(hits)
        if num_needed > 0:
            # the blocks it may hold at most, so that the pool keeps room for the rest after its last block
            most = -(-(request.num_prompt_tokens + request.sampling_params.max_tokens) // self.block_size)
            new_blocks = self.pool.get_new_blocks(
                num_needed, after=block_ids[-1] if block_ids else None, room=most - num_held - num_needed
            )
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        return block_ids

    def cache_computed_blocks(self, request: Request) -> None:
        """After a step: enter the request's newly completed full blocks into the prefix-cache index."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_indexed.get(req_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        blocks = self._blocks[req_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_indexed[req_id] = num_full

    def free(self, request_id: str, *, finished: bool) -> None:
        """Release the request's blocks (tail first, for eviction order). `finished` also drops its hashes;
        a preempted request keeps them to find its own prefix again cheaply."""
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        self._block_ids.pop(request_id, None)
        self._num_indexed.pop(request_id, None)
        if finished:
            self._hashes.pop(request_id, None)
