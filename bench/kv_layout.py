"""Decode attention over W's own block tables, in one run: the two KV-cache layouts, or (`--blocks`) the block
tables two pool policies give.

Why it exists: the runner lays its cache out head-major where the AVX-512 decode passes read it
(`worker.model.kernels.head_major_cache`; `attention.cache_views`), because a (block, KV head) is then one run of
memory where token-major rows scatter a head's lines over the block. What that gains depends on how scattered a
sequence's blocks are, so this replays the block tables and context lengths of the decode steps our engine runs on
workload W (`bench/engine.py`'s workload and engine settings; `--every` keeps one step in so many) over 30 layers'
caches of random values (as many layers as SmolLM2 has, so that they stream from DRAM as the engine's do), both
layouts holding the same values, with the same queries. Rounds alternate the layouts; it prints each layout's
seconds and GB/s (the K and V bytes attended over), the median of the rounds' speed ratios (head-major over
token-major; min and max), and whether both gave the same outputs, bit for bit.

`--blocks` asks the other question: how much the placement of a request's blocks matters. It records W's decode
steps four times: with the front-of-one-queue policy (`QueuePool`: vLLM's and nano-vllm's, ours before stop 47)
and with our pool (`worker.core.block_pool`: a request's blocks consecutive where it can), each on a fresh pool and
on an aged one (a workload of W's shape but another seed ran through it first), then replays the four over the
same head-major cache, rounds alternated, and prints each one's seconds, the mean run of consecutive block ids in
a table, and its speed over the fresh queue's. `--prefix-caching` runs the engines with
prefix caching on (a worker's default): then the aged pools hold the first workload's blocks as evictable
prefixes, and every block W gets is an evicted one. `--base REV` asks a third: is this tree's decode kernel faster
than commit REV's? Both builds load in one process (`panel_ab.base_module_file`: REV built in a temporary worktree)
and replay the same steps over one cache (laid out as the runner lays it out here), rounds alternated; it prints
each build's seconds and GB/s, the median of the rounds' speed ratios (this tree over REV; min and max) and the
largest difference between their outputs. The last line is one JSON object in every mode.

    .venv/bin/python bench/kv_layout.py                     # bf16, every 5th of W's decode steps
    .venv/bin/python bench/kv_layout.py --dtype float32 --every 10 --rounds 9
    .venv/bin/python bench/kv_layout.py --blocks --rounds 9
    .venv/bin/python bench/kv_layout.py --blocks --prefix-caching
    .venv/bin/python bench/kv_layout.py --base HEAD~1 --rounds 9   # this tree's decode kernel against HEAD~1's
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from itertools import pairwise
from typing import Any

from engine import add_shape_args, shape_args
from worker.core.block_pool import BlockPool, KVBlock

LAYERS = 30


class QueuePool(BlockPool):
    """The baseline policy of `--blocks`: free blocks in one queue, handed out from the front (their cached
    prefixes evicted), freed plain blocks back to the front and cached ones to the back, so cached blocks go least
    recently used first (what `BlockPool` did before stop 47; vLLM's and nano-vllm's pools hand out the front of
    one free queue too). Where a request's blocks land is wherever the queue's front is."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, enable_caching)
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._queue)

    def get_new_blocks(self, n: int, after: int | None = None, room: int = 0) -> list[KVBlock]:
        if n > len(self._queue):
            raise ValueError(f"asked for {n} blocks but only {len(self._queue)} are free")
        out = [self.blocks[self._queue.popitem(last=False)[0]] for _ in range(n)]
        for block in out:
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        return out

    def touch(self, blocks) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self._queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks) -> None:
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._queue[block.block_id] = None
                if block.block_hash is None:
                    self._queue.move_to_end(block.block_id, last=False)


def decode_steps(
    dtype: str,
    requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    pool: type[BlockPool] | None = None,
    aged: bool = False,
    prefix_caching: bool = False,
) -> dict:
    """W run through our engine: each decode step's (block tables, context lengths), the cache's block count and
    the model's attention shape. `pool`: the block pool the engine runs on (None: ours); `aged`: a workload of
    another seed runs through first, so that W starts from the pool it left; `prefix_caching`: the engine keeps
    computed blocks for reuse (as a worker does by default), so that freed blocks wait to be evicted."""
    import torch
    import worker.core.kv_cache_manager as kv_cache_manager
    import worker.model.llama as llama
    from engine import make_workload, smollm2_on_w
    from worker.core.request import SamplingParams

    kv_cache_manager.BlockPool = pool or BlockPool  # type: ignore[misc]
    try:
        llm, work = smollm2_on_w(dtype, requests, prompt_len, output_len, prefix_caching=prefix_caching)
    finally:
        kv_cache_manager.BlockPool = BlockPool  # type: ignore[misc]
    runner = llm.engine.runner
    runner.model.decode_stack = None  # decode steps through `paged_attention` (the spy), not `decode_layers`
    cfg = runner.config
    first_layer = runner.kv_caches[0][0].data_ptr()
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    attend = llama.paged_attention
    recording = [not aged]

    def spy(q, k, v, k_cache, v_cache, meta, scale, native):
        if recording[0] and meta.num_decode == q.shape[0] and k_cache.data_ptr() == first_layer:
            steps.append((meta.decode_block_tables.clone(), meta.decode_context_lens.clone()))
        return attend(q, k, v, k_cache, v_cache, meta, scale, native)

    llama.paged_attention = spy  # type: ignore[assignment]
    try:
        core = llm.engine
        before = make_workload(requests, prompt_len, output_len, cfg.vocab_size, seed=1)
        for run, load in enumerate([before, work] if aged else [work]):
            recording[0] = load is work
            for i, (prompt, n) in enumerate(load):
                params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                core.add_request(f"w{run}.{i}", prompt, params)
            while core.has_unfinished_requests():
                core.step()
    finally:
        llama.paged_attention = attend  # type: ignore[assignment]
    shape = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    return {"steps": steps, "num_blocks": runner.num_blocks, "block_size": runner.block_size, "shape": shape}


def replay_kernel(recorded: dict, dtype: str, head_major: bool = True) -> tuple[Any, Any]:
    """(the native decode kernel, the torch dtype) to replay `recorded`'s steps (over a head-major cache unless
    `head_major` is False); exits with the reason where the kernel cannot be built or (head_major) reads no
    head-major cache of that dtype on this CPU."""
    import torch
    from worker.model.kernels import head_major_cache, load_paged_decode

    kernel, why = load_paged_decode()
    if kernel is None:
        raise SystemExit(f"the native decode kernel cannot be built here: {why}")
    dt = getattr(torch, dtype)
    if head_major and not head_major_cache(dt, recorded["shape"][2], recorded["block_size"]):
        raise SystemExit(f"the decode kernel reads no head-major {dtype} cache on this CPU (needs AVX-512)")
    return kernel, dt


def spread(ratios: list[float]) -> dict[str, float]:
    """The rounds' speed ratios as their median, min and max."""
    return {
        "median": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
    }


def timed_rounds(sides: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each side's seconds in each round, every other round in the reverse order (the host's drift falls on both)."""
    names = list(sides)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            sides[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def replay_sides(
    steps: list, queries: list, scale: float, sides: dict[str, tuple[Any, list]], rounds: int
) -> tuple[dict[str, list], dict[str, list[float]]]:
    """Each side (a decode kernel, the layers' caches it reads) over every recorded step and layer: its outputs
    once, then its seconds in each of `rounds` alternated rounds (`timed_rounds`)."""

    def run(kernel: Any, caches: list) -> list:
        return [kernel(q, k, v, tables, lens, scale) for q, (tables, lens) in zip(queries, steps) for k, v in caches]

    outputs = {name: run(*side) for name, side in sides.items()}
    seconds = timed_rounds({name: (lambda side=side: run(*side)) for name, side in sides.items()}, rounds)
    return outputs, seconds


def side_rates(steps: list, seconds: dict[str, list[float]], kv_heads: int, head_dim: int, itemsize: int) -> dict:
    """The tokens the steps attend over, and each side's median seconds and the GB/s of K and V it read."""
    tokens = sum(int(lens.sum()) for _, lens in steps)
    moved = tokens * LAYERS * 2 * kv_heads * head_dim * itemsize
    found: dict[str, Any] = {"steps": len(steps), "tokens_attended": tokens}
    for name, secs in seconds.items():
        found[name] = {"s": round(statistics.median(secs), 4), "gb_s": round(moved / statistics.median(secs) / 1e9, 1)}
    return found


def compare(recorded: dict, dtype: str, every: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """Both layouts over the recorded steps (one in `every`), rounds alternated: seconds, GB/s, ratios, equality."""
    import torch
    from worker.model.attention import cache_shape, cache_views

    kernel, dt = replay_kernel(recorded, dtype)
    heads, kv_heads, head_dim = recorded["shape"]
    nb, bs = recorded["num_blocks"], recorded["block_size"]
    steps = recorded["steps"][::every]
    gen = torch.Generator().manual_seed(seed)
    token = cache_views(
        torch.randn(cache_shape(LAYERS, nb, bs, kv_heads, head_dim, False), generator=gen).to(dt), False
    )
    head = cache_views(torch.zeros(cache_shape(LAYERS, nb, bs, kv_heads, head_dim, True), dtype=dt), True)
    for (k, v), (kh, vh) in zip(token, head, strict=True):
        kh.copy_(k)
        vh.copy_(v)
    queries = [torch.randn(len(lens), heads, head_dim, generator=gen).to(dt) for _, lens in steps]
    sides = {"token_major": (kernel, token), "head_major": (kernel, head)}
    outputs, seconds = replay_sides(steps, queries, head_dim**-0.5, sides, rounds)
    same = all(torch.equal(a, b) for a, b in zip(outputs["token_major"], outputs["head_major"], strict=True))
    ratios = [t / h for t, h in zip(seconds["token_major"], seconds["head_major"], strict=True)]
    result: dict[str, Any] = {"dtype": dtype, **side_rates(steps, seconds, kv_heads, head_dim, dt.itemsize)}
    result["same_outputs"] = same
    result["x_head_major"] = spread(ratios)
    return result


def compare_builds(recorded: dict, dtype: str, every: int, rounds: int, base: Any, seed: int = 0) -> dict[str, Any]:
    """`base` (another build of the extension, loaded) against this tree's decode kernel over the recorded steps
    (one in `every`) on one cache laid out as the runner lays it out on this CPU (head-major where the AVX-512 passes
    read it, token-major for the AVX2 ones), rounds alternated: seconds, GB/s, ratios, the outputs' largest gap."""
    import torch
    from worker.model.attention import cache_shape, cache_views
    from worker.model.kernels import head_major_cache

    kernel, dt = replay_kernel(recorded, dtype, head_major=False)
    heads, kv_heads, head_dim = recorded["shape"]
    nb, bs = recorded["num_blocks"], recorded["block_size"]
    steps = recorded["steps"][::every]
    gen = torch.Generator().manual_seed(seed)
    major = head_major_cache(dt, head_dim, bs)
    caches = cache_views(
        torch.randn(cache_shape(LAYERS, nb, bs, kv_heads, head_dim, major), generator=gen).to(dt), major
    )
    queries = [torch.randn(len(lens), heads, head_dim, generator=gen).to(dt) for _, lens in steps]
    sides = {"base": (base.paged_decode, caches), "new": (kernel, caches)}
    outputs, seconds = replay_sides(steps, queries, head_dim**-0.5, sides, rounds)
    gap = max(float((a.float() - b.float()).abs().max()) for a, b in zip(*outputs.values(), strict=True))
    result: dict[str, Any] = {"dtype": dtype, **side_rates(steps, seconds, kv_heads, head_dim, dt.itemsize)}
    result["max_abs_diff"] = gap
    result["x_new"] = spread([b / n for b, n in zip(seconds["base"], seconds["new"], strict=True)])
    return result


def mean_run(steps: list, block_size: int) -> float:
    """The mean length of the runs of consecutive block ids in the recorded tables (each up to its context)."""
    runs = blocks = 0
    for tables, lens in steps:
        for table, length in zip(tables.tolist(), lens.tolist(), strict=True):
            ids = table[: -(-length // block_size)]
            runs += 1 + sum(b != a + 1 for a, b in pairwise(ids))
            blocks += len(ids)
    return blocks / max(runs, 1)


def compare_pools(recorded: dict[str, dict], dtype: str, every: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """Each pool's recorded tables (one step in `every`) over the same head-major cache, rounds alternated: seconds,
    mean run, speed over the first pool's (the within-round ratios' median, min and max). The pools must have run
    the same workload (the same contexts) on caches of the same size."""
    import torch
    from worker.model.attention import cache_shape, cache_views

    first = next(iter(recorded.values()))
    kernel, dt = replay_kernel(first, dtype)
    heads, kv_heads, head_dim = first["shape"]
    nb, bs = first["num_blocks"], first["block_size"]
    steps = {name: rec["steps"][::every] for name, rec in recorded.items()}
    contexts = {name: [lens.tolist() for _, lens in s] for name, s in steps.items()}
    if any(c != contexts[next(iter(contexts))] for c in contexts.values()):
        raise ValueError("the pools ran different decode steps: the same workload and engine settings are needed")
    gen = torch.Generator().manual_seed(seed)
    caches = cache_views(torch.randn(cache_shape(LAYERS, nb, bs, kv_heads, head_dim, True), generator=gen).to(dt), True)
    queries = [torch.randn(len(lens), heads, head_dim, generator=gen).to(dt) for _, lens in steps[next(iter(steps))]]
    scale = head_dim**-0.5

    def run(name: str) -> None:
        for q, (tables, lens) in zip(queries, steps[name], strict=True):
            for k, v in caches:
                kernel(q, k, v, tables, lens, scale)

    names = list(steps)
    seconds = timed_rounds({name: (lambda name=name: run(name)) for name in names}, rounds)
    result: dict[str, Any] = {"dtype": dtype, "steps": len(queries)}
    for name in names:
        ratios = [b / t for b, t in zip(seconds[names[0]], seconds[name], strict=True)]
        result[name] = {
            "s": round(statistics.median(seconds[name]), 4),
            "mean_run": round(mean_run(steps[name], bs), 2),
            "x_speed": spread(ratios),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--every", type=int, default=5, help="replay one of this many decode steps")
    ap.add_argument("--rounds", type=int, default=7)
    add_shape_args(ap)
    ap.add_argument("--blocks", action="store_true", help="compare the block tables of two pool policies instead")
    ap.add_argument("--prefix-caching", action="store_true", help="--blocks: the engines keep computed blocks")
    ap.add_argument("--base", default=None, help="compare this tree's decode kernel with this commit's instead")
    args = ap.parse_args()
    requests, prompt, output = shape_args(args)
    if args.base:
        from panel_ab import base_module_file, load_module_file

        base = load_module_file(base_module_file(args.base))
        found = compare_builds(
            decode_steps(args.dtype, requests, prompt, output), args.dtype, args.every, args.rounds, base
        )
        x = found["x_new"]
        for name in ("base", "new"):
            print(f"{name:5s} {found[name]['s']:.3f} s  {found[name]['gb_s']:5.1f} GB/s")
        print(
            f"{args.dtype}, {found['steps']} of W's decode steps x {LAYERS} layers: this tree {x['median']:.3f}x "
            f"{args.base} [{x['min']:.3f}-{x['max']:.3f}], outputs apart by at most {found['max_abs_diff']:.2e}"
        )
        print(json.dumps(found))
        return
    if args.blocks:
        pools = {
            "queue_fresh": (QueuePool, False),
            "queue_aged": (QueuePool, True),
            "ours_fresh": (BlockPool, False),
            "ours_aged": (BlockPool, True),
        }
        tables = {
            name: decode_steps(args.dtype, requests, prompt, output, pool, aged, args.prefix_caching)
            for name, (pool, aged) in pools.items()
        }
        found = compare_pools(tables, args.dtype, args.every, args.rounds)
        for name in pools:
            r, x = found[name], found[name]["x_speed"]
            print(
                f"{name:12s} {r['s']:.3f} s  mean run {r['mean_run']:5.2f} blocks  "
                f"{x['median']:.3f}x queue_fresh [{x['min']:.3f}-{x['max']:.3f}]"
            )
        print(json.dumps(found))
        return
    recorded = decode_steps(args.dtype, requests, prompt, output)
    result = compare(recorded, args.dtype, args.every, args.rounds)
    for name in ("token_major", "head_major"):
        print(f"{name:12s} {result[name]['s']:.3f} s  {result[name]['gb_s']:5.1f} GB/s")
    x = result["x_head_major"]
    print(
        f"{args.dtype}, {result['steps']} of W's decode steps x {LAYERS} layers: head-major {x['median']:.3f}x "
        f"token-major [{x['min']:.3f}-{x['max']:.3f}], same outputs: {result['same_outputs']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
