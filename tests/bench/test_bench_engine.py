"""`bench/engine.py`'s roofline: what a step asks of the machine, and the least time the steps need."""

from __future__ import annotations

from types import SimpleNamespace
from typing import get_args

import pytest
from engine import roofline, step_shape
from worker.model.config import ModelConfig
from worker.model.linear import LinearKernel
from worker.model.testing import make_tiny_llama


def _sched(*seqs: tuple[int, int, bool]) -> SimpleNamespace:
    """(start_pos, tokens computed, sampled) per sequence."""
    return SimpleNamespace(seqs=[SimpleNamespace(start_pos=s, token_ids=[7] * q, sample=smp) for s, q, smp in seqs])


@pytest.mark.parametrize(
    ("seqs", "expected"),
    [
        ([(9, 1, True)], (1, 1, 10, 10)),  # one decode: one token attends over its 10 keys
        ([(0, 4, True)], (4, 1, 4, 10)),  # a whole 4-token prompt: causal, 1+2+3+4 pairs
        ([(8, 4, False)], (4, 0, 12, 4 * 8 + 10)),  # a later chunk: the 8 cached keys for each, then causal
        ([(9, 1, True), (0, 4, True), (8, 4, False)], (9, 2, 26, 10 + 10 + 42)),  # a step's totals
    ],
)
def test_step_shape(seqs, expected) -> None:
    assert step_shape(_sched(*seqs)) == expected


def test_the_roofline_takes_the_larger_of_compute_and_memory_for_each_step(tmp_path) -> None:
    root = make_tiny_llama(tmp_path / "m")
    cfg = ModelConfig.from_dir(root)
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    layer_params = (cfg.q_size + 2 * cfg.kv_size) * h + h * cfg.q_size + 2 * i * h + h * i
    streamed = {"weight_bytes": 1_000_000, "kv_bytes_per_token": 100}
    decode = (1, 1, 10, 10)  # tiny FLOPs, 1 MB of weights: bound by memory
    prefill = (4096, 1, 4096, 4096 * 4097 // 2)  # many FLOPs: bound by compute at 1 GFLOP/s
    got = roofline(str(root), [decode, prefill], streamed, gemm_gflops=1.0, bw=1.0)
    decode_s = (1_000_000 + 100 * 10) / 1e9
    prefill_flops = (
        2.0 * layers * layer_params * 4096 + 2.0 * cfg.vocab_size * h + 4.0 * layers * cfg.q_size * (4096 * 4097 // 2)
    )
    assert prefill_flops / 1e9 > (1_000_000 + 100 * 4096) / 1e9  # the case is what it claims
    assert got["memory_bound_steps"] == 1 and got["steps"] == 2
    assert got["floor_s"] == round(decode_s + prefill_flops / 1e9, 2)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_gemm_ceiling_says_which_kernel_it_measured(tmp_path, quantization) -> None:
    from engine import gemm_ceiling

    root = make_tiny_llama(tmp_path / "m")
    got = gemm_ceiling(str(root), [([1] * 8, 4)], "float32", quantization)
    assert got["gemm_gflops"] > 0 and got["ceiling_tok_s"] > 0
    if quantization is None:
        assert got["linear_kernel"] in get_args(LinearKernel) and got["kernel_reason"]
    else:  # the quantized layer's own account of its kernel (quant.py's `path`), not a fixed string
        assert got["linear_kernel"] == "int8" and got["kernel_reason"].startswith("int8 weight-only on ")
        assert len(got["kernel_reason"]) > len("int8 weight-only on ") + 10


def _entry(variant: str, system: str, tok_s: float | None, **extra: float) -> dict:
    if tok_s is None:
        return {"variant": variant, "system": system, "error": "boom"}
    return {"variant": variant, "system": system, "tok_s": tok_s, "useful_tokens": 100, **extra}


_CEILINGS = {
    "fp32": {"ceiling_tok_s": 200.0, "roofline": {"floor_tok_s": 100.0}},
    "int8": {"ceiling_tok_s": 250.0},
}


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        (  # ours against vLLM of the same round, its ceiling and the roofline; vLLM only against the roofline
            [_entry("fp32", "ours", 150.0), _entry("fp32", "vllm", 100.0)],
            {
                ("fp32", "ours"): {"x_vllm": 1.5, "x_ceiling": 0.75, "x_roofline": 1.5},
                ("fp32", "vllm"): {"x_vllm": 1.0, "x_roofline": 1.0},
            },
        ),
        (  # a quantized variant: against our fp32 and vLLM in fp32 (its activations' dtype), no roofline here
            [_entry("fp32", "ours", 100.0), _entry("fp32", "vllm", 80.0), _entry("int8", "ours", 110.0)],
            {("int8", "ours"): {"x_fp32": 1.1, "x_vllm": 1.375, "x_ceiling": 0.44}},
        ),
        (  # a failed vLLM gives no ratio
            [_entry("fp32", "ours", 100.0), _entry("fp32", "vllm", None)],
            {("fp32", "ours"): {"x_ceiling": 0.5, "x_roofline": 1.0}},
        ),
        (  # the latency targets: vLLM's latency over ours (> 1: ours faster), each from the same round
            [
                _entry("fp32", "ours", 150.0, ttft_p50_s=20.0, itl_p99_ms=5000.0),
                _entry("fp32", "vllm", 100.0, ttft_p50_s=30.0, itl_p99_ms=4000.0),
                _entry("int8", "ours", 160.0, ttft_p50_s=24.0, itl_p99_ms=4000.0),
            ],
            {
                ("fp32", "ours"): {
                    "x_vllm": 1.5,
                    "x_ceiling": 0.75,
                    "x_roofline": 1.5,
                    "x_vllm_ttft_p50_s": 1.5,
                    "x_vllm_itl_p99_ms": 0.8,
                },
                ("int8", "ours"): {
                    "x_fp32": 1.067,
                    "x_vllm": 1.6,
                    "x_ceiling": 0.64,
                    "x_vllm_ttft_p50_s": 1.25,
                    "x_vllm_itl_p99_ms": 1.0,
                },
            },
        ),
        (  # a latency one side lacks gives no latency ratio
            [_entry("fp32", "ours", 150.0, ttft_p50_s=20.0), _entry("fp32", "vllm", 100.0, itl_p99_ms=4000.0)],
            {("fp32", "ours"): {"x_vllm": 1.5, "x_ceiling": 0.75, "x_roofline": 1.5}},
        ),
    ],
)
def test_a_rounds_ratios_are_taken_within_it(found, expected) -> None:
    from engine import add_ratios

    add_ratios(found, _CEILINGS)
    for r in found:
        want = expected.get((r["variant"], r["system"]))
        if want is not None:
            assert {k: v for k, v in r.items() if k.startswith("x_")} == want


def test_rounds_report_the_median_round_and_the_median_of_each_ratio() -> None:
    from engine import summarize_rounds

    rounds = [
        [_entry("fp32", "ours", 120.0, x_vllm=1.6, ttft_p50_s=20.0), _entry("fp32", "vllm", 75.0, x_vllm=1.0)],
        [_entry("fp32", "ours", 100.0, x_vllm=1.4, ttft_p50_s=25.0), _entry("fp32", "vllm", None)],
        [_entry("fp32", "ours", 110.0, x_vllm=1.7, ttft_p50_s=22.0), _entry("fp32", "vllm", 65.0, x_vllm=1.0)],
    ]
    ours, vllm = summarize_rounds(rounds)
    assert (ours["system"], vllm["system"]) == ("ours", "vllm")
    assert ours["tok_s"] == 110.0 and ours["ttft_p50_s"] == 22.0  # the median round's latencies
    assert ours["x_vllm"] == 1.6  # the median ratio, not a ratio of medians (110 / 70 = 1.57)
    assert ours["tok_s_rounds"] == [120.0, 100.0, 110.0] and ours["x_vllm_rounds"] == [1.6, 1.4, 1.7]
    assert ours["rounds"] == 3 and vllm["rounds"] == 2  # a failed round does not count
    assert vllm["tok_s"] == 70.0  # two rounds: the mean of the middle two; the lower one's latencies


def test_the_latency_targets_take_the_median_of_the_rounds_ratios() -> None:
    """The median round (by tok/s) may be the one where a slow spell hit ours' prompt phase: the latency
    targets are judged by the median of the per-round ratios, as x_vllm is."""
    from engine import add_ratios, summarize_rounds

    rounds = [
        [_entry("fp32", "ours", o, ttft_p50_s=t, itl_p99_ms=i), _entry("fp32", "vllm", v, ttft_p50_s=vt, itl_p99_ms=vi)]
        for o, t, i, v, vt, vi in (
            (115.0, 30.0, 4700.0, 86.0, 27.0, 5000.0),  # the median round: ours' TTFT worse here
            (125.0, 21.5, 4750.0, 82.0, 29.8, 5450.0),
            (109.0, 29.9, 4770.0, 89.0, 35.9, 5540.0),
        )
    ]
    for found in rounds:
        add_ratios(found, _CEILINGS)
    ours = summarize_rounds(rounds)[0]
    assert ours["ttft_p50_s"] == 30.0  # the median round's own latency: worse than its vLLM's
    assert ours["x_vllm_ttft_p50_s_rounds"] == [0.9, 1.386, 1.201]
    assert ours["x_vllm_ttft_p50_s"] == 1.201  # but ours is faster in two rounds of three
    assert ours["x_vllm_itl_p99_ms"] == 1.147


def test_a_system_that_failed_every_round_keeps_its_error() -> None:
    from engine import summarize_rounds

    rounds = [[_entry("fp32", "vllm", None)], [_entry("fp32", "vllm", None)]]
    assert summarize_rounds(rounds) == [{"variant": "fp32", "system": "vllm", "error": "boom"}]


def test_ours_runs_with_the_loaded_model_frozen_as_the_worker_runs_it(tmp_path, monkeypatch) -> None:
    # The overhead target is about the worker process, which freezes its start-up heap (worker.heap): timed
    # without that, a full collection over the model's objects lands inside a step. Each heap is given back.
    import gc

    from engine import run_ours
    from worker.engine.core import EngineCore

    root = make_tiny_llama(tmp_path / "m")
    seen: list[int] = []
    step = EngineCore.step

    def watched(self):
        seen.append(gc.get_freeze_count())
        return step(self)

    monkeypatch.setattr(EngineCore, "step", watched)
    gc.unfreeze()
    try:
        got = run_ours(
            str(root), [([1, 2, 3], 3), ([4] * 9, 2)], dtype="float32", max_num_seqs=4, batched_tokens=64, name="ours"
        )
        assert got["useful_tokens"] == 5 and got["gc_passes"] >= 0 and got["gc_longest_ms"] >= 0
        assert len(seen) > 1 and all(n > 0 for n in seen[-got["steps"] :])  # the timed steps ran frozen
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_the_overhead_at_peak_is_split_into_schedule_and_the_rest(tmp_path, monkeypatch) -> None:
    # schedule() runs warm (after the last step's output processing), the rest right after the model step: the
    # split says which one a change or a host moved. A schedule() that takes at least 3 ms shows up in its part.
    import time

    from engine import run_ours
    from worker.core.scheduler import Scheduler

    root = make_tiny_llama(tmp_path / "m")
    plan = Scheduler.schedule

    def slow(self):
        time.sleep(0.003)
        return plan(self)

    monkeypatch.setattr(Scheduler, "schedule", slow)
    got = run_ours(
        str(root), [([1, 2, 3], 3), ([4] * 9, 2)], dtype="float32", max_num_seqs=4, batched_tokens=64, name="ours"
    )
    assert got["overhead_ms_at_peak_schedule_p50"] >= 3.0
    assert got["overhead_ms_at_peak_p50"] >= got["overhead_ms_at_peak_schedule_p50"]
    assert got["overhead_ms_at_peak_after_model_p50"] >= 0


def test_the_collectors_passes_are_counted_while_the_block_runs_only() -> None:
    import gc

    from engine import collector_pauses

    before = list(gc.callbacks)
    with collector_pauses() as pauses:
        gc.collect()
        gc.collect()
    gc.collect()
    assert len(pauses) == 2 and all(p >= 0 for p in pauses)
    assert gc.callbacks == before


def test_each_system_runs_in_a_process_of_its_own(tmp_path, monkeypatch) -> None:
    # A variant run after another in one process paid for what the first left in the heap (run_system says how
    # much): each run is a child process, which a run_ours broken in this process cannot reach.
    import sys

    import engine

    def broken(*args, **kwargs):
        raise AssertionError("ran in the benchmark's own process")

    monkeypatch.setattr(engine, "run_ours", broken)
    root = make_tiny_llama(tmp_path / "m")
    work = [([1, 2, 3], 3), ([4] * 9, 2)]
    got = engine.run_system(
        sys.executable, "ours", str(root), work, dtype="float32", quantization="int8", batched_tokens=64, timeout_s=600
    )
    assert got["system"] == "ours" and got["useful_tokens"] == 5, got
    # the steps' shapes come back for the roofline, as (tokens, sampled, KV read, pairs) each
    assert sum(tokens for tokens, _, _, _ in got["_schedule"]) == 3 + 9 + 2 + 1
    assert got["_streamed"]["weight_bytes"] > 0


def test_a_system_that_cannot_run_reports_why(tmp_path) -> None:
    import sys

    from engine import run_system

    got = run_system(
        sys.executable,
        "ours",
        str(tmp_path / "none"),
        [([1], 1)],
        dtype="float32",
        quantization=None,
        batched_tokens=64,
        timeout_s=600,
    )
    assert got["system"] == "ours" and got["error"].startswith("exit 1:") and "none" in got["error"]


def test_the_steady_phase_times_decode_steps_of_every_prompt_running_at_once(tmp_path) -> None:
    from engine import steady_overhead
    from worker.engine.llm import LLM

    root = make_tiny_llama(tmp_path / "m")
    core = LLM(str(root), max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64, enable_prefix_caching=False).engine
    shapes: list[list[int]] = []
    execute = core.runner.execute_model

    def spy(sched):
        shapes.append(sorted(len(s.token_ids) for s in sched.seqs))
        return execute(sched)

    core.runner.execute_model = spy
    got = steady_overhead(core, [[1, 2, 3], [4] * 9, [5] * 5], steps=4)
    assert got["steady_steps"] == 4 and got["steady_running"] == 3
    assert shapes[-4:] == [[1, 1, 1]] * 4 and len(shapes) > 4  # the prompts first, untimed; then 4 decode steps
    assert not core.has_unfinished_requests()  # the phase's requests were aborted
    assert got["steady_overhead_ms_p50"] <= got["steady_overhead_ms_p99"] <= got["steady_overhead_ms_max"]
    assert 0 <= got["steady_overhead_cpu_ms_p50"] <= got["steady_overhead_cpu_ms_p99"]


def test_ours_runs_the_steady_phase_after_w_when_asked(tmp_path) -> None:
    from engine import run_ours

    root = make_tiny_llama(tmp_path / "m")
    work = [([1, 2, 3], 3), ([4] * 9, 2)]
    kw = {"dtype": "float32", "max_num_seqs": 4, "batched_tokens": 64, "name": "ours"}
    assert run_ours(str(root), work, steady_steps=3, **kw)["steady_steps"] == 3
    assert "steady_steps" not in run_ours(str(root), work, **kw)
