"""The simulated fleet (bench/autoscaling_sim.py) and the benchmark's output contract (bench/autoscale_sim.py).
These check shape and behaviour on short traces, not the benchmark's targets."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from autoscaling_sim import (
    Autoscaler,
    EngineProfile,
    FleetView,
    KedaHpaAutoscaler,
    KubeAIAutoscaler,
    LlmfleetAutoscaler,
    Trace,
    Workload,
    generate_requests,
    replicas_needed,
    simulate,
    step_trace,
)

from controllers.autoscaling import AutoscalingPolicy

PROFILE = EngineProfile()
WORKLOAD = Workload()
PER_REPLICA_RPS = PROFILE.token_rate / WORKLOAD.mean_tokens


class Fixed(Autoscaler):
    name = "fixed"
    interval_s = 10.0

    def evaluate(self, view: FleetView) -> int:
        return view.desired


def flat(rate: float, duration: float = 600.0) -> Trace:
    return Trace(name="flat", duration_s=duration, rate=lambda t: rate, peak_rate=rate)


def run(trace: Trace, autoscaler: Autoscaler, replicas: int = 2, startup_s: float = 6.0):
    return simulate(
        trace,
        autoscaler,
        profile=PROFILE,
        workload=WORKLOAD,
        startup_s=startup_s,
        slo_ttft_s=6.0,
        initial_replicas=replicas,
        needed_utilization=0.75,
        seed=3,
    )


def first_increase(series: list[tuple[float, int]], after: float) -> float:
    start = next(count for time, count in series if time >= after)
    return next(time for time, count in series if time >= after and count > start)


def test_light_load_meets_the_slo_and_serves_everything() -> None:
    result = run(flat(0.3 * PER_REPLICA_RPS * 2), Fixed())
    assert result.slo_violation_s == 0
    assert all(r.finished_at is not None for r in result.requests if r.arrival < 600.0 - 60)
    assert all(r.first_token_at is None or r.first_token_at >= r.arrival for r in result.requests)
    assert result.replica_s == pytest.approx(2 * 600.0)


def test_overload_grows_ttft_and_violates() -> None:
    result = run(flat(1.5 * PER_REPLICA_RPS * 2), Fixed())
    assert result.slo_violation_s > 300
    assert result.p95_ttft_s > 30


def test_simulation_is_deterministic() -> None:
    trace = step_trace(0.8, before_s=120, after_s=240)
    policy = AutoscalingPolicy(max_replicas=12, kv_cache_utilization=0.12)
    first = run(trace, LlmfleetAutoscaler(policy))
    second = run(trace, LlmfleetAutoscaler(policy))
    assert (first.slo_violation_s, first.replica_s, first.replicas_series) == (
        second.slo_violation_s,
        second.replica_s,
        second.replicas_series,
    )
    assert generate_requests(trace, WORKLOAD, 5)[0] == generate_requests(trace, WORKLOAD, 5)[0]


def test_our_policy_reacts_within_a_few_ticks_of_a_step() -> None:
    trace = step_trace(0.8, before_s=300, after_s=300)
    result = run(trace, LlmfleetAutoscaler(AutoscalingPolicy(max_replicas=12, kv_cache_utilization=0.12)))
    assert first_increase(result.replicas_series, 300) <= 300 + 40
    assert result.peak_replicas >= replicas_needed(trace.peak_rate, PROFILE, WORKLOAD, 0.75)


def _view(now: float, desired: int, running: int, ready: int = 2) -> FleetView:
    pods = tuple(SimpleNamespace(running=running / ready, waiting=[]) for _ in range(ready))
    return FleetView(
        now=now,
        desired=desired,
        ready=pods,
        starting_since=(),
        draining=0,
        gateway_queued=0,
        ttft_p95_60s=None,
        kv_total_60s=None,
    )


def test_keda_waits_for_its_scale_up_stabilisation_then_doubles() -> None:
    keda = KedaHpaAutoscaler(running_target=5, waiting_target=2, min_replicas=1, max_replicas=12)
    desired, history = 2, {}
    for now in range(0, 346, 15):
        desired = keda.evaluate(_view(float(now), desired, running=40))  # 40 running: 8 replicas' worth
        history[now] = desired
    assert {history[t] for t in range(0, 300, 15)} == {2}
    assert (history[300], history[315], history[330]) == (4, 8, 8)


def test_keda_tolerance_and_scale_down_window() -> None:
    keda = KedaHpaAutoscaler(running_target=5, waiting_target=2, min_replicas=1, max_replicas=12)
    assert keda.evaluate(_view(0.0, 4, running=21)) == 4  # 21 / (5 * 4) = 1.05: within tolerance
    desired = 4
    for now in range(15, 331, 15):
        desired = keda.evaluate(_view(float(now), desired, running=5))
        if now < 300:
            assert desired == 4
    assert desired == 1


def test_kubeai_moving_average_lags_and_holds() -> None:
    trace = step_trace(0.8, before_s=300, after_s=600)
    kubeai = KubeAIAutoscaler(target_requests=6, min_replicas=1, max_replicas=12)
    result = run(trace, kubeai)
    ours = run(trace, LlmfleetAutoscaler(AutoscalingPolicy(max_replicas=12, kv_cache_utilization=0.12)))
    assert first_increase(result.replicas_series, 300) > first_increase(ours.replicas_series, 300)


def test_kubeai_averages_ten_minutes_and_needs_consecutive_lower_results() -> None:
    kubeai = KubeAIAutoscaler(target_requests=10, min_replicas=1, max_replicas=10, scale_down_delay_s=30)
    assert kubeai.evaluate(_view(0.0, 4, running=40)) == 4
    desired, dropped_at = 4, None
    for tick in range(1, 40):
        desired = kubeai.evaluate(_view(tick * 10.0, desired, running=0))
        if desired < 4 and dropped_at is None:
            dropped_at = tick
    # The 60-sample average of 40 in-flight falls to 30 (3 replicas' worth) after 15 idle samples; then three
    # consecutive lower results (30 s / 10 s) are needed before the fourth scales down.
    assert dropped_at == 15 + 3
    no_endpoints = FleetView(
        now=500.0,
        desired=3,
        ready=(),
        starting_since=(),
        draining=0,
        gateway_queued=5,
        ttft_p95_60s=None,
        kv_total_60s=None,
    )
    assert kubeai.evaluate(no_endpoints) == 3  # "No ready endpoints found for model, skipping"


def _bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "autoscale_sim.py"
    spec = importlib.util.spec_from_file_location("autoscale_sim_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_prints_one_json_object_last(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    assert bench.main(["--scale", "0.1", "--seed", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert set(summary) == {"traces"}
    assert set(summary["traces"]) == {"step4x", "spike", "diurnal"}
    for trace, policies in summary["traces"].items():
        assert set(policies) == {"llmfleet", "kubeai", "keda"}, trace
        for figures in policies.values():
            assert set(figures) == {"slo_violation_s", "replica_s", "peak_overshoot"}
            assert figures["slo_violation_s"] >= 0 and figures["slo_violation_s"] % 10 == 0
            assert figures["replica_s"] > 0 and math.isfinite(figures["replica_s"])
            assert isinstance(figures["peak_overshoot"], int)
    # Every pod costs at least the base fleet for the whole trace.
    step = summary["traces"]["step4x"]
    assert min(figures["replica_s"] for figures in step.values()) >= 2 * (90 + 270) * 0.5
    assert any(line.startswith("step4x   llmfleet") for line in lines)
