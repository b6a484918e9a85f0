"""The paged decode attention kernel: its AVX-512 paths (bf16, fp32) against its portable path, in one run.

Why: decode attention was ~58% of a bf16 decode step at 64 running requests (issue #16), and the portable path
ran no faster in bf16 than in fp32. `worker.model.kernels` now runs bf16 (head dims 64 and 128) on CPUs with
AVX512-BF16 through its own code; this times both paths of the same build on the same inputs, interleaved, and
prints per-layer milliseconds, the ratio and the largest difference between their outputs.

Shapes: SmolLM2-135M (9 query / 3 KV heads of 64) and a Llama-3-8B layer (32 / 8 heads of 128), `--seqs`
sequences of `--context` tokens in 16-token blocks scattered over the cache (as a long-running engine's are).
fp32 takes its own AVX-512F path (head dims 64 and 128) on CPUs that have it, as bf16 does with AVX512-BF16.

    .venv/bin/python bench/attention_kernel.py
    .venv/bin/python bench/attention_kernel.py --seqs 64 --context 1024 --threads 1

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from worker.model.kernels import load_paged_decode, load_paged_decode_generic, paged_decode_path

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
BLOCK = 16


def _inputs(seqs: int, context: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    blocks = seqs * per_seq + 8
    k = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: seqs * per_seq].view(seqs, per_seq)
    lens = torch.full((seqs,), context, dtype=torch.long)
    return q, k, v, tables, lens, dim**-0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=21, help="interleaved timings per path; medians are reported")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fast, why = load_paged_decode()
    generic, _ = load_paged_decode_generic()
    if fast is None or generic is None:
        raise SystemExit(f"the kernel cannot be built here: {why}")
    rows = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            inputs = _inputs(args.seqs, args.context, heads, kv_heads, dim, dtype, seed=len(rows))
            diff = (fast(*inputs).float() - generic(*inputs).float()).abs().max().item()
            times: dict[str, list[float]] = {"generic": [], "kernel": []}
            for _ in range(args.repeat):
                for label, fn in (("generic", generic), ("kernel", fast)):
                    start = time.perf_counter()
                    fn(*inputs)
                    times[label].append(time.perf_counter() - start)
            g, f = (1e3 * statistics.median(times[k]) for k in ("generic", "kernel"))
            row = {
                "shape": name,
                "dtype": str(dtype).removeprefix("torch."),
                "path": paged_decode_path(dtype, dim),
                "generic_ms": round(g, 3),
                "kernel_ms": round(f, 3),
                "speedup": round(g / f, 2),
                "max_abs_diff": diff,
            }
            rows.append(row)
            print(
                f"{name:>13} {row['dtype']:>8}: portable {g:7.3f} ms, kernel {f:7.3f} ms per layer "
                f"-> {g / f:4.2f}x (max |diff| {diff:.2e}); path: {row['path']}",
                flush=True,
            )
    print(json.dumps({"seqs": args.seqs, "context": args.context, "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
