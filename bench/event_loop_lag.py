"""How late another Python thread runs while our engine serves a prompt-heavy batch, against the engine idle.

Why: the worker's HTTP event loop and tokenizer threads share the process (and the GIL) with the engine thread
(`worker.engine.async_engine`), so every stretch the engine holds the GIL is a stall of every stream, `/health`
included. The native kernels release it (`kernels.MODULE_DEF`). This runs a thread that sleeps 1 ms at a time and
records how much later than asked it wakes: first with the engine idle (the baseline), then while the engine
prefills `--requests` prompts of `--prompt` tokens and decodes `--tokens` each. Prints lateness p50 / p99 / max of
both and the engine's wall time; the LAST line is one JSON object.

Measured on the 2-core Zen 5 (bf16, 8 prompts of 1500 tokens, 16 tokens each), the same run before and after the
kernels released the GIL: lateness during the batch p50 1.60-1.63 -> 0.07 ms, p99 6.9-7.4 -> 0.09-0.10 ms, max
11.1-11.4 -> 3.7-3.9 ms; the engine's wall 4.15-4.26 -> 4.19-4.21 s.

    .venv/bin/python bench/event_loop_lag.py
    .venv/bin/python bench/event_loop_lag.py --dtype float32 --requests 4 --prompt 512
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Callable

TICK_S = 0.001


def lateness(during: Callable[[], object]) -> tuple[list[float], float]:
    """(seconds each 1 ms sleep of a helper thread overran, sorted; seconds `during` took) while `during` runs in
    this thread."""
    late: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            time.sleep(TICK_S)
            late.append(time.perf_counter() - start - TICK_S)

    helper = threading.Thread(target=tick, name="ticker", daemon=True)
    helper.start()
    start = time.perf_counter()
    try:
        during()
    finally:
        took = time.perf_counter() - start
        stop.set()
        helper.join()
    return sorted(late), took


def summary(late: list[float]) -> dict[str, float]:
    """Tick count and lateness p50 / p99 / max in ms of sorted overruns."""
    if not late:
        return {"ticks": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    return {
        "ticks": len(late),
        "p50_ms": round(late[len(late) // 2] * 1e3, 3),
        "p99_ms": round(late[min(len(late) - 1, int(len(late) * 0.99))] * 1e3, 3),
        "max_ms": round(late[-1] * 1e3, 3),
    }


def run(model: str, dtype: str, requests: int, prompt: int, tokens: int, seed: int = 0) -> dict:
    from engine import cache_blocks
    from worker.core.request import SamplingParams
    from worker.engine.llm import LLM
    from worker.model.source import resolve_model_source

    path = str(resolve_model_source(model))
    llm = LLM(
        path,
        dtype=dtype,
        max_num_seqs=max(requests, 1),
        max_num_batched_tokens=2048,
        num_blocks=cache_blocks(requests * (prompt + tokens), requests),
        enable_prefix_caching=False,
    )
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt)] for _ in range(requests)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    busy, wall = lateness(lambda: llm.generate(prompts, params))
    idle, _ = lateness(lambda: time.sleep(min(wall, 2.0)))
    return {
        "model": model,
        "dtype": dtype,
        "requests": requests,
        "prompt": prompt,
        "tokens": tokens,
        "engine_wall_s": round(wall, 3),
        "idle": summary(idle),
        "during_batch": summary(busy),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled://smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1500, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    args = ap.parse_args()
    result = run(args.model, args.dtype, args.requests, args.prompt, args.tokens)
    for name in ("idle", "during_batch"):
        s = result[name]
        print(
            f"{name:>12}: {s['ticks']} ticks, lateness p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, max {s['max_ms']} ms"
        )
    print(f"engine wall {result['engine_wall_s']} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
