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

`--w-prompts` draws prompt and sampled token ids over the tokenizer's whole vocabulary (from id 100, as
`bench/engine.py`'s W does) instead of printable bytes and one fixed token: byte pieces that split characters then
reach the detokenizer as they do on W. Every request has a stop string ("never-seen"), so the stop matcher runs
on every delta; `--no-stop-strings` leaves it out, as W's requests do.

`--base REV` compares the engine step outside the model (the `engine_core` figure) of commit REV with this tree's,
paired: two child processes run the same engine on the same requests, one importing REV's `worker_image` (from a
temporary git worktree) and one this tree's, and this process has them step in turn (ABBA order), so that both
see the same moments of a host whose speed moves by half within minutes. It prints each side's p50 and p99 and the
median over step pairs of base / new (above 1: this tree is faster), and one JSON object as its LAST line:

    .venv/bin/python bench/scheduler.py --base HEAD~1 --tokenizer /path/to/model --no-prefix-caching --cold 256 \
        --w-prompts
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from engine import W_LOWEST_ID, step_until_prefilled
from worker.core.config import EngineConfig
from worker.core.outputs import ModelRunnerOutput, SchedulerOutput
from worker.core.request import SamplingParams
from worker.engine.core import EngineCore
from worker.engine.toy import ByteTokenizer


class InstantRunner:
    """Samples a fixed token for every request that asks, at no cost: only the engine's own work is timed. With a
    `flush` buffer it first reads all of it (not timed as the engine's), as a model step streams its weights."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        tokenizer,
        flush: bytearray | None = None,
        sample_ids: tuple[int, int] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = 1 << 20
        self.tokenizer = tokenizer
        self.eos_token_id = None
        self.token = tokenizer.encode("a", add_special_tokens=False)[0]
        self.flush = flush
        self.sample_ids = sample_ids  # (low, high): sample ids drawn from that range (seeded) instead of `token`
        self.rnd = random.Random(1)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.flush is not None:
            self.flush.count(b"\x01")  # reads every byte: the caches now hold this buffer, not the engine's objects
        if self.sample_ids is not None:
            low, high = self.sample_ids
            draw = self.rnd.randrange
            return ModelRunnerOutput(
                sampled_token_ids={s.req_id: draw(low, high) for s in scheduler_output.seqs if s.sample}
            )
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
    sample_ids = (W_LOWEST_ID, tokenizer.vocab_size) if args.w_prompts else None
    ids = sample_ids or (32, 127)  # prompts: W's ids, or printable bytes
    core = EngineCore.from_config(config, InstantRunner(num_blocks, 16, tokenizer, flush, sample_ids))
    rnd = random.Random(0)
    stop = () if args.no_stop_strings else ("never-seen",)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop)
    for i in range(args.requests):
        prompt = [rnd.randrange(*ids) for _ in range(rnd.randrange(32, 513))]
        core.add_request(f"r{i}", prompt, params)
    step_until_prefilled(core)  # the timed steps are pure decode steps of all requests
    return core


def _timed_core_step(args, tokenizer, flush: bytearray | None) -> Callable[[], tuple[float, float]]:
    """A fresh engine, and a function that runs one EngineCore.step() and returns its (wall, thread CPU) seconds
    outside the runner."""
    core = _build(args, tokenizer, flush)
    execute = core.runner.execute_model
    runner_time = [0.0, 0.0]

    def timed_execute(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        w, c = time.perf_counter(), time.thread_time()
        result = execute(scheduler_output)
        runner_time[0] += time.perf_counter() - w
        runner_time[1] += time.thread_time() - c
        return result

    core.runner.execute_model = timed_execute

    def step() -> tuple[float, float]:
        runner_time[:] = [0.0, 0.0]
        w, c = time.perf_counter(), time.thread_time()
        core.step()
        return time.perf_counter() - w - runner_time[0], time.thread_time() - c - runner_time[1]

    return step


def _serve(args, tokenizer, flush: bytearray | None) -> None:
    """`--serve`, one side of `--base`: say which `worker` this process imported, then run one step for every
    line read and answer its wall seconds outside the runner, until stdin closes."""
    import worker

    step = _timed_core_step(args, tokenizer, flush)
    print(Path(worker.__file__).resolve().parent, flush=True)
    for _ in sys.stdin:
        print(step()[0], flush=True)


def _compare(args) -> None:
    """`--base REV`: REV's engine and this tree's, each in a child process (`--serve`), stepped in turn."""
    from panel_ab import worktree

    here = Path(__file__).resolve().parent.parent / "worker_image"
    with worktree(args.base) as tree:
        sides = {}
        for name, image in (("base", tree / "worker_image"), ("new", here)):
            env = dict(os.environ, PYTHONPATH=str(image))
            proc = subprocess.Popen(
                [sys.executable, __file__, *sys.argv[1:], "--serve"],  # --serve wins over --base
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdin is not None and proc.stdout is not None
            imported = proc.stdout.readline().strip()
            if Path(imported) != (image / "worker").resolve():  # e.g. an editable install shadowing PYTHONPATH
                raise RuntimeError(f"the {name} side imported {imported}, not {image / 'worker'}")
            sides[name] = proc
        times: dict[str, list[float]] = {"base": [], "new": []}
        for i in range(args.steps):
            for name in ("base", "new") if i % 2 == 0 else ("new", "base"):  # ABBA: neither side always first
                proc = sides[name]
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("step\n")
                proc.stdin.flush()
                times[name].append(float(proc.stdout.readline()))
        for proc in sides.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait()
    ratios = [b / n for b, n in zip(times["base"], times["new"], strict=True)]
    result = {
        "base": args.base,
        "requests_running": args.requests,
        "steps": args.steps,
        "cold_mb": args.cold,
        "w_prompts": args.w_prompts,
        "stop_strings": not args.no_stop_strings,
        "engine_core_base": _stats(times["base"]),
        "engine_core_new": _stats(times["new"]),
        "x_base_p50": round(statistics.median(ratios), 3),  # base / new per step pair: above 1, this tree is faster
        "x_base_of_p99": round(_stats(times["base"])["p99_us"] / _stats(times["new"])["p99_us"], 3),
    }
    b, n = result["engine_core_base"], result["engine_core_new"]
    print(f"engine step outside the model at {args.requests} running, {args.steps} step pairs, microseconds")
    print(f"  base {args.base}: p50 {b['p50_us']}, p99 {b['p99_us']}; this tree: p50 {n['p50_us']}, p99 {n['p99_us']}")
    print(f"  base / this tree: median of pairs {result['x_base_p50']}, of the p99s {result['x_base_of_p99']}")
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--tokenizer", help="model folder whose tokenizer to use (default: the byte tokenizer)")
    parser.add_argument("--cold", type=int, default=0, metavar="MB", help="read MB of memory between steps")
    parser.add_argument("--w-prompts", action="store_true", help="prompt and sampled ids over the whole vocabulary")
    parser.add_argument("--no-stop-strings", action="store_true", help="requests without a stop string, as W's")
    parser.add_argument("--base", metavar="REV", help="compare the engine step with commit REV's, paired")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # one side of --base
    args = parser.parse_args()
    if args.base and not args.serve:
        _compare(args)
        return
    if args.tokenizer:
        from worker.model.tokenizer import Tokenizer

        tokenizer = Tokenizer(args.tokenizer)
    else:
        tokenizer = ByteTokenizer()

    flush = bytearray(args.cold << 20) if args.cold else None
    if args.serve:
        _serve(args, tokenizer, flush)
        return
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
    step = _timed_core_step(args, tokenizer, flush)
    wall["engine_core"], cpu["engine_core"] = [], []
    for _ in range(args.steps):
        w, c = step()
        wall["engine_core"].append(w)
        cpu["engine_core"].append(c)

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
