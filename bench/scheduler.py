"""Per-step overhead of the engine core without the model: scheduler, KV bookkeeping and output processing.

Why it exists: issue 4 requires the scheduler to cost under 1 ms per step at 64 running requests, so that
Python bookkeeping never eats into the model's step time. A runner that returns a fixed token instantly stands
in for the model; 64 requests with prompts of 32..512 tokens (fixed seed) are prefilled, then decode steps are
timed. It prints, per phase, mean / p50 / p99 in microseconds:
- `schedule`: Scheduler.schedule() (token budget, block allocation, building the SchedulerOutput);
- `update`: Scheduler.update_from_output() (append tokens, stop checks, prefix-cache indexing of full blocks);
- `scheduler`: the two together (the figure the 1 ms target is about);
- `engine_core`: a whole EngineCore.step() minus the runner, i.e. plus detokenisation and stop strings;
in wall-clock and in thread CPU time (on a shared machine, p99 wall time mostly shows the OS scheduling other
processes), and as its LAST line one JSON object with those figures.

`--cold MB` reads a buffer of that size between steps, as a real model step does (SmolLM2's fp32 weights are 540
MB): the engine's Python objects are then evicted from the caches when its step begins, which is what
`bench/engine.py` measures on W (its overhead at 64 running was ~2x this benchmark's warm figure on a Zen 3).

    .venv/bin/python bench/scheduler.py                      # 64 requests, 300 timed decode steps
    .venv/bin/python bench/scheduler.py --requests 256 --steps 100 --tokenizer /path/to/model   # real tokenizer
    .venv/bin/python bench/scheduler.py --tokenizer /path/to/model --no-prefix-caching --cold 256   # as on W
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from worker.core.config import EngineConfig
from worker.core.outputs import ModelRunnerOutput, SchedulerOutput
from worker.core.request import SamplingParams
from worker.engine.core import EngineCore
from worker.engine.toy import ByteTokenizer


class InstantRunner:
    """Samples a fixed token for every request that asks, at no cost: only the engine's own work is timed. With a
    `flush` buffer it first reads all of it (not timed as the engine's), as a model step streams its weights."""

    def __init__(self, num_blocks: int, block_size: int, tokenizer, flush: bytearray | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = 1 << 20
        self.tokenizer = tokenizer
        self.eos_token_id = None
        self.token = tokenizer.encode("a", add_special_tokens=False)[0]
        self.flush = flush

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.flush is not None:
            self.flush.count(b"\x01")  # reads every byte: the caches now hold this buffer, not the engine's objects
        return ModelRunnerOutput(sampled_token_ids={s.req_id: self.token for s in scheduler_output.seqs if s.sample})


def _stats(samples_s: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in samples_s)
    return {
        "mean_us": round(statistics.fmean(us), 1),
        "p50_us": round(us[len(us) // 2], 1),
        "p99_us": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
    }


def _build(args, tokenizer, flush: bytearray | None = None) -> EngineCore:
    config = EngineConfig(
        block_size=16,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, args.requests),
        enable_prefix_caching=not args.no_prefix_caching,
    )
    max_tokens = args.steps * 2 + 64
    num_blocks = args.requests * (-(-(512 + max_tokens) // 16) + 1)
    core = EngineCore.from_config(config, InstantRunner(num_blocks, 16, tokenizer, flush))
    rnd = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=("never-seen",))
    for i in range(args.requests):
        prompt = [rnd.randrange(32, 127) for _ in range(rnd.randrange(32, 513))]
        core.add_request(f"r{i}", prompt, params)
    while core.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()  # prefill everything: the timed steps are pure decode steps of all requests
    return core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--tokenizer", help="model folder whose tokenizer to use (default: the byte tokenizer)")
    parser.add_argument("--cold", type=int, default=0, metavar="MB", help="read MB of memory between steps")
    args = parser.parse_args()
    if args.tokenizer:
        from worker.model.tokenizer import Tokenizer

        tokenizer = Tokenizer(args.tokenizer)
    else:
        tokenizer = ByteTokenizer()

    flush = bytearray(args.cold << 20) if args.cold else None
    # Phase timings of the scheduler alone. Wall time includes moments the OS gives the core to another
    # process (4 ms ticks on a shared machine show up in p99); thread CPU time does not.
    core = _build(args, tokenizer, flush)
    sched, runner = core.scheduler, core.runner
    wall = {"schedule": [], "update": [], "scheduler": []}
    cpu = {"schedule": [], "update": [], "scheduler": []}
    for _ in range(args.steps):
        w0, c0 = time.perf_counter(), time.thread_time()
        out = sched.schedule()
        w1, c1 = time.perf_counter(), time.thread_time()
        runner_out = runner.execute_model(out)
        w2, c2 = time.perf_counter(), time.thread_time()
        sched.update_from_output(out, runner_out)
        w3, c3 = time.perf_counter(), time.thread_time()
        assert len(out.seqs) == args.requests
        for clock, (t0, t1, t2, t3) in ((wall, (w0, w1, w2, w3)), (cpu, (c0, c1, c2, c3))):
            clock["schedule"].append(t1 - t0)
            clock["update"].append(t3 - t2)
            clock["scheduler"].append(t1 - t0 + t3 - t2)

    # Whole EngineCore.step() minus the runner, on a fresh engine.
    core = _build(args, tokenizer, flush)
    runner = core.runner
    execute = runner.execute_model
    runner_time = [0.0, 0.0]

    def timed_execute(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        w, c = time.perf_counter(), time.thread_time()
        result = execute(scheduler_output)
        runner_time[0] += time.perf_counter() - w
        runner_time[1] += time.thread_time() - c
        return result

    runner.execute_model = timed_execute
    wall["engine_core"], cpu["engine_core"] = [], []
    for _ in range(args.steps):
        runner_time[:] = [0.0, 0.0]
        w, c = time.perf_counter(), time.thread_time()
        core.step()
        wall["engine_core"].append(time.perf_counter() - w - runner_time[0])
        cpu["engine_core"].append(time.thread_time() - c - runner_time[1])

    phases = ("schedule", "update", "scheduler", "engine_core")
    result = {
        "requests_running": args.requests,
        "steps": args.steps,
        "prefix_caching": not args.no_prefix_caching,
        "tokenizer": args.tokenizer or "byte",
        "cold_mb": args.cold,
        "wall": {phase: _stats(wall[phase]) for phase in phases},
        "cpu": {phase: _stats(cpu[phase]) for phase in phases},
        "target_us": 1000,
    }
    print(f"per-step overhead at {args.requests} running requests ({args.steps} decode steps), microseconds")
    print(f"{'phase':<12} {'wall mean':>10} {'p50':>8} {'p99':>8} {'cpu mean':>10} {'p50':>8} {'p99':>8}")
    for phase in phases:
        w, c = result["wall"][phase], result["cpu"][phase]
        print(
            f"{phase:<12} {w['mean_us']:>10} {w['p50_us']:>8} {w['p99_us']:>8} "
            f"{c['mean_us']:>10} {c['p50_us']:>8} {c['p99_us']:>8}"
        )
    p50 = result["wall"]["scheduler"]["p50_us"]
    print(f"scheduler wall p50 {p50} us {'meets' if p50 < 1000 else 'MISSES'} the 1000 us target")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
