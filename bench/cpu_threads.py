"""Engine throughput by torch CPU thread count: why a worker sizes its pool to the CPU its container was given.

Each thread count runs in its own process (torch's pool is per process), one after another, on the same fixed
workload (SmolLM2-135M fp32, greedy, EOS ignored), and the report gives tokens/s and the ratio to 1 thread. On a
node with more cores than the pod's CPU limit, the pool must stop at the limit (worker/cpu_threads.py): threads
beyond it are throttled in turn by the kernel's CFS quota, which this benchmark cannot show on an unlimited box.

    .venv/bin/python bench/cpu_threads.py                    # 1 and all cores, 16 requests x 48 tokens
    .venv/bin/python bench/cpu_threads.py --threads 1,2,4 --requests 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time


def run_one(threads: int, requests: int, max_tokens: int) -> dict[str, float]:
    """Called in a child process: the workload with `threads` torch threads; tokens/s."""
    import torch

    torch.set_num_threads(threads)
    from worker import LLM, SamplingParams
    from worker.model.bundled import ensure_bundled

    llm = LLM(str(ensure_bundled("smollm2-135m-instruct")), max_num_seqs=requests)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(32, 200))] for _ in range(requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - start
    return {"threads": threads, "tok_s": sum(len(o.token_ids) for o in outs) / seconds, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="comma-separated thread counts")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(run_one(args.child, args.requests, args.max_tokens)))
        return
    counts = sorted({int(t) for t in args.threads.split(",") if t.strip()})
    rows = []
    for threads in counts:
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(threads),
                "--requests",
                str(args.requests),
                "--max-tokens",
                str(args.max_tokens),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=1800,
        )
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    base = rows[0]["tok_s"]
    print(f"SmolLM2-135M fp32, {args.requests} requests x {args.max_tokens} tokens, {os.cpu_count()} CPUs here")
    print(f"{'threads':>7} {'tok/s':>8} {'x first':>8}")
    for row in rows:
        print(f"{row['threads']:>7} {row['tok_s']:>8.1f} {row['tok_s'] / base:>8.2f}")
    print(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
