"""Multi-LoRA serving: 8 adapters over 64 requests in one engine vs the base model alone vs one engine per adapter.

S-LoRA's point is that adapters should cost little: one base model in memory, requests of many adapters batched
together. One fixed workload (default 64 requests, prompts 32..256 and outputs 16..128 tokens from a fixed seed,
random token ids, greedy, EOS ignored so every system generates exactly the same number of tokens), request i using
adapter i % 8, run on the real bundled SmolLM2-135M (the model bench/engine.py uses) by:

* `base`: our engine, no adapters, the same requests (the ceiling adapters are measured against);
* `multi_lora`: our engine with `enable_lora`, `max_loras=8`, 8 random PEFT adapters of ranks 8..16 on all seven
  projections (`worker.model.testing.make_random_lora`), every request with its adapter, all in one batch;
* `per_adapter`: the alternative without multi-LoRA serving, one engine per adapter run one after another: the
  adapter merged into the weights (W + scale * B @ A), its 8 requests served, merged out again. Model loading is
  NOT counted (one runner is reused), which flatters this alternative.

It prints useful tokens/s (generated tokens per wall second) per system and the ratios
`multi_lora / base` (target >= 0.8) and `multi_lora / per_adapter` (target >= 4), measured in this one run; the
LAST line printed is one JSON object.

    .venv/bin/python bench/lora.py              # 64 requests (~3-6 min on 2 cores)
    .venv/bin/python bench/lora.py --quick      # 16 short requests: a smoke run
    .venv/bin/python bench/lora.py --threads 1  # on a machine shared with other jobs
    python3 bench/lora.py --device cuda --dtype bfloat16 --random-weights smollm2-135m  # on a GPU machine

`--random-weights SHAPE` serves random weights in the shape of a real model (`SHAPES`) instead of `--model`: the
throughput of this workload does not depend on the weights' values (EOS is ignored, every system generates the
same tokens' count), and it lets the bench run where neither the bundled GGUF nor a hub is at hand, such as a GPU
machine that can reach nothing. It draws them at a realistic scale (std 0.02), so bf16 activations stay finite.

On one NVIDIA H200 (2026-11-27, `bash bench/gpu_checks.sh`, torch 2.11+cu130, eager, warm round on) a step costs
9-28 ms whether it holds 8 rows or 64: the GPU waits on the host (Python and ~1,000 kernel launches a step), so
batching 8 adapters' requests is nearly free (multi_lora / per_adapter 5.93 SmolLM2-shape bf16, 3.33 Llama-3.2-1B
shape bf16, 2.70 SmolLM2 fp32; 3.2-4.1 in a run without the warm round), while the adapters' own ops (gather,
two bmm, index_add per projection group: ~900 launches a step) double the step (multi_lora / base 0.52-0.72).
Run to run, the same system's ms/step moved by up to 2x. What would pay on a GPU: CUDA-graph capture of the decode
step per batch-size bucket, or one fused kernel per projection group for the adapters (Punica's BGMV/SGMV).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ADAPTERS = 8
RANKS = (8, 16)
# config.json shapes of real models (their public configs), for --random-weights
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "pad_vocab_to": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "pad_vocab_to": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
    },
}


def serve(llm: Any, work, loras: list[str | None]) -> tuple[float, int, int]:
    """Wall seconds, generated tokens and engine steps for all of `work` submitted at t=0 to one engine."""
    from worker.core.request import SamplingParams

    core = llm.engine
    t0 = time.perf_counter()
    for i, ((prompt, n), lora) in enumerate(zip(work, loras, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        core.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_name=lora)
    produced = steps = 0
    while core.has_unfinished_requests():
        steps += 1
        for out in core.step():
            produced += len(out.new_token_ids)
    return time.perf_counter() - t0, produced, steps


def merge(model: Any, lora: Any, sign: float) -> None:
    """Add (sign=1) or remove (sign=-1) an adapter's deltas to/from the fused dense weights of our Llama."""
    import torch
    from worker.model.linear import DenseLinear

    names = {"qkv": "qkv", "o": "o_proj", "gate_up": "gate_up", "down": "down"}
    for layer, deltas in zip(model.layers, lora.layers, strict=True):
        for group, delta in deltas.items():
            linear = getattr(layer, names[group])
            if not isinstance(linear, DenseLinear):
                raise TypeError(f"per_adapter merges into dense weights only, not {type(linear).__name__}")
            w = (delta.a_t.float() @ delta.b_t.float()).t()
            with torch.inference_mode():
                linear.weight += (sign * w).to(linear.weight.dtype)


def result(name: str, wall: float, produced: int, steps: int, **extra: Any) -> dict[str, Any]:
    """One system's line; `ms_per_step` tells a step-bound device (the same cost at 8 rows as at 64) apart."""
    return {
        "system": name,
        "wall_s": round(wall, 2),
        "tokens": produced,
        "tok_s": round(produced / wall, 2),
        "steps": steps,
        "ms_per_step": round(1000 * wall / max(steps, 1), 2),
        **extra,
    }


def measure(
    llm: Any, single: Any, folders: dict[str, Path], work, loras: list[str | None], note: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The three systems, one after another: `llm` serves base and multi_lora, `single` (sharing its runner) serves
    each adapter's requests with that adapter merged into the weights."""
    note("base: all requests without adapters")
    systems = [result("base", *serve(llm, work, [None] * len(work)))]

    note("multi_lora: every request with its adapter, one engine")
    measured = serve(llm, work, loras)
    stats = llm.engine.stats().lora
    systems.append(
        result(
            "multi_lora",
            *measured,
            adapter_loads=stats.loads_total if stats else None,
            adapter_evictions=stats.evictions_total if stats else None,
        )
    )

    note("per_adapter: one engine per adapter (merged weights), one after another")
    runner = single.engine.runner
    total_wall, total_produced, total_steps = 0.0, 0, 0
    for name, folder in folders.items():
        adapter = runner.load_lora(str(folder), name)
        mine = [w for w, lora in zip(work, loras, strict=True) if lora == name]
        merge(runner.model, adapter, 1.0)
        try:
            wall, produced, steps = serve(single, mine, [None] * len(mine))
        finally:
            merge(runner.model, adapter, -1.0)
        total_wall += wall
        total_produced += produced
        total_steps += steps
    systems.append(result("per_adapter", total_wall, total_produced, total_steps, model_loads_not_counted=ADAPTERS))
    return systems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled://smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--random-weights", choices=sorted(SHAPES), help="random weights in this model's shape")
    ap.add_argument(
        "--warm-round",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the three systems once unreported first (default: on a GPU, whose library picks kernels per shape "
        "the first time it meets one, which charged the first system up to 4x its steady step time)",
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="16 requests, prompts 16..64, outputs 8..32")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 on a machine shared with other jobs, where a 2-thread step that "
        "loses a core to another process waits at every barrier (8x slower in one measurement)",
    )
    args = ap.parse_args()
    if args.warm_round is None:
        args.warm_round = not args.device.startswith("cpu")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    from engine import cache_blocks, make_workload
    from worker.core.request import SamplingParams
    from worker.engine.llm import LLM
    from worker.model.source import resolve_model_source
    from worker.model.testing import make_random_lora

    if args.random_weights:
        from worker.model.testing import make_tiny_llama

        shaped = tempfile.TemporaryDirectory(prefix="lora-bench-model-")
        path = str(make_tiny_llama(shaped.name, init_std=0.02, **SHAPES[args.random_weights]))
    else:
        path = str(resolve_model_source(args.model))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    n, prange, orange = (
        (min(args.requests, 16), (16, 64), (8, 32)) if args.quick else (args.requests, (32, 256), (16, 128))
    )
    work = make_workload(n, prange, orange, vocab, args.seed)
    names = [f"adapter{i}" for i in range(ADAPTERS)]
    loras: list[str | None] = [names[i % ADAPTERS] for i in range(n)]
    need = sum(len(p) + k for p, k in work)
    engine_args = {
        "dtype": args.dtype,
        "max_num_seqs": 64,
        "max_num_batched_tokens": max(args.max_num_batched_tokens, 64),
        "num_blocks": cache_blocks(need, n),
        "enable_prefix_caching": False,  # random prompts share nothing; keep the comparison about batching
        "device": args.device,
    }

    def progress(what: str, suffix: str = "") -> None:
        print(f"[bench] {time.strftime('%H:%M:%S')} {what}{suffix} ...", file=sys.stderr, flush=True)

    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        progress(f"writing {ADAPTERS} random adapters (ranks {RANKS[0]}..{RANKS[1]}, all projections)")
        rng = random.Random(args.seed)
        folders = {}
        for i, name in enumerate(names):
            rank = rng.choice(range(RANKS[0], RANKS[1] + 1, 4))
            folders[name] = Path(tmp) / name
            make_random_lora(folders[name], path, rank=rank, alpha=2 * rank, init_std=0.02, seed=i + 1)
        progress("loading the engine (LoRA enabled, max_loras=8)")
        llm = LLM(path, enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANKS[1], **engine_args)
        for name in names:
            llm.add_lora(name, str(folders[name]))
        llm.generate([work[0][0][:32]] * 2, warm, lora=[None, names[0]])  # warm-up, both paths

        runner = llm.engine.runner
        single = LLM(path, runner=runner, **engine_args)
        rounds = 2 if args.warm_round else 1
        for r in range(rounds):
            label = " (warm-up round, not reported)" if r < rounds - 1 else ""
            systems = measure(llm, single, folders, work, loras, functools.partial(progress, suffix=label))

    by = {s["system"]: s for s in systems}
    ratios = {
        "multi_lora_vs_base": round(by["multi_lora"]["tok_s"] / by["base"]["tok_s"], 3),
        "multi_lora_vs_per_adapter": round(by["multi_lora"]["tok_s"] / by["per_adapter"]["tok_s"], 3),
    }
    print(f"{'system':<12} {'wall s':>8} {'tokens':>7} {'tok/s':>8} {'steps':>6} {'ms/step':>8}")
    for s in systems:
        print(
            f"{s['system']:<12} {s['wall_s']:>8} {s['tokens']:>7} {s['tok_s']:>8} {s['steps']:>6} {s['ms_per_step']:>8}"
        )
    print(f"multi_lora / base        = {ratios['multi_lora_vs_base']:.3f}  (target >= 0.8)")
    print(f"multi_lora / per_adapter = {ratios['multi_lora_vs_per_adapter']:.3f}  (target >= 4)")
    workload = {"requests": n, "adapters": ADAPTERS, "prompt_range": prange, "output_range": orange}
    threads = args.threads or "default"
    print(
        json.dumps(
            {
                "bench": "lora",
                "dtype": args.dtype,
                "device": args.device,
                "warm_round": args.warm_round,
                "model": f"random:{args.random_weights}" if args.random_weights else args.model,
                "threads": threads,
                "workload": workload,
                "systems": systems,
                **ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
