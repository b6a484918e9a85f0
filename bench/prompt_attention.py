"""Prompt attention: the native kernel of a dtype (`kernels.load_prefill_attention`) against torch's SDPA, in one run.

Why: a prompt chunk's causal attention was torch's SDPA on CPUs without AVX-512 (6% of workload W on an AVX2 Zen 3,
more of a prompt-heavy step), and the native kernel ran only on AVX-512. It now runs on AVX2 + FMA too; this times
both on the same inputs, interleaved, exactly as `attention.paged_attention` calls them (q, k and v as strided views
into the fused QKV rows, `testing.qkv_views`; SDPA through `attention.prefill_attention_sdpa`, plain causal from
position 0 and `causal_chunk_mask` after a cached prefix), and prints milliseconds per layer call, the ratio and the largest difference between outputs.

Shapes: SmolLM2-135M (9 query / 3 KV heads of 64) and a Llama-3-8B layer (32 / 8 heads of 128), chunks of `--chunks`
queries after `--start` cached tokens. `--dtype bfloat16` times what a bf16 model runs (AMX's kernel, the
AVX512-BF16 one without AMX, or the fp32 kernel on the chunk widened where neither runs) against torch's bf16 SDPA; `max_abs_diff` is then each path's
largest distance from an fp32 SDPA of the same inputs.

    .venv/bin/python bench/prompt_attention.py
    .venv/bin/python bench/prompt_attention.py --chunks 512,2048 --start 0,1536 --shapes smollm2-135m
    .venv/bin/python bench/prompt_attention.py --dtype bfloat16

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from worker.model.attention import causal_chunk_mask, prefill_attention_sdpa
from worker.model.kernels import load_prefill_attention
from worker.model.testing import qkv_views

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def _time(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _case(kernel, dtype: torch.dtype, shape: str, n: int, start: int, rounds: int) -> dict:
    """Both paths on one chunk of `n` queries after `start` cached tokens, in halves interleaved (drift on a
    shared machine hits both alike)."""
    heads, kv_heads, hd = SHAPES[shape]
    q, k, v = qkv_views(n, start, heads, kv_heads, hd, seed=n + start, dtype=dtype)
    scale = hd**-0.5
    out = torch.empty(n, heads * hd, dtype=dtype)
    mask = causal_chunk_mask(start, n, dtype, "cpu") if start else None  # as build_metadata makes it
    native_s = sdpa_s = 0.0
    for _ in range(2):
        native_s += _time(lambda: kernel(out, q, k, v, start, scale), rounds)
        sdpa_s += _time(lambda: prefill_attention_sdpa(q, k, v, mask, scale), rounds)
    sdpa = prefill_attention_sdpa(q, k, v, mask, scale).float()
    if dtype == torch.float32:
        diffs = {"max_abs_diff": (out - sdpa).abs().max().item()}
    else:  # each path against an fp32 SDPA of the same (bf16) inputs
        wide = causal_chunk_mask(start, n, torch.float32, "cpu") if start else None
        ref = prefill_attention_sdpa(q.float(), k.float(), v.float(), wide, scale)
        diffs = {
            "max_abs_diff": (out.float() - ref).abs().max().item(),
            "sdpa_max_abs_diff": (sdpa - ref).abs().max().item(),
        }
    return {
        "shape": shape,
        "chunk": n,
        "start": start,
        "native_ms": round(native_s / 2 * 1e3, 3),
        "sdpa_ms": round(sdpa_s / 2 * 1e3, 3),
        "x_sdpa": round(sdpa_s / native_s, 2),
        **diffs,
    }


def run(
    shapes: list[str], chunks: list[int], starts: list[int], rounds: int, dtype: torch.dtype = torch.float32
) -> dict:
    """Time both paths on every (shape, chunk, start); print a row per case; return the JSON object."""
    kernel, why = load_prefill_attention(dtype, 64)
    if kernel is None:
        raise SystemExit(f"the native {dtype} prompt attention does not run here: {why}")
    print(f"native kernel: {why}; torch threads: {torch.get_num_threads()}")
    print(f"{'shape':14} {'chunk':>6} {'start':>6} {'native ms':>10} {'sdpa ms':>9} {'x sdpa':>7} {'max |diff|':>11}")
    rows = []
    for shape in shapes:
        for n in chunks:
            for start in starts:
                r = _case(kernel, dtype, shape, n, start, rounds)
                rows.append(r)
                print(
                    f"{shape:14} {n:6} {start:6} {r['native_ms']:10.3f} {r['sdpa_ms']:9.3f} {r['x_sdpa']:7.2f}"
                    f" {r['max_abs_diff']:11.2e}"
                    + (f" (sdpa {r['sdpa_max_abs_diff']:.2e})" if "sdpa_max_abs_diff" in r else "")
                )
    return {
        "kernel": why,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cases": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,llama3-8b", help=f"comma-separated: {','.join(SHAPES)}")
    ap.add_argument("--chunks", default="128,512,2048", help="queries per chunk, comma-separated")
    ap.add_argument("--start", default="0,512", help="cached tokens before the chunk, comma-separated")
    ap.add_argument("--rounds", type=int, default=7, help="timed calls per path and case (the median is kept)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype")
    args = ap.parse_args()
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
    result = run(
        args.shapes.split(","),
        [int(c) for c in args.chunks.split(",")],
        [int(s) for s in args.start.split(",")],
        args.rounds,
        getattr(torch, args.dtype),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
