"""The autoscaling decision for one variant: metrics, pod counts and persisted history in, a replica count out.

Why it exists: the arithmetic that sizes a variant must be testable with tables and identical in the operator,
in the simulation benchmark (bench/autoscale_sim.py) and after an operator restart. So it is one pure function,
`decide`, with time as an argument and every piece of memory it needs (the stabilisation window, alert intents,
the last time traffic was seen, the last scale-up per signal, the last queue total) passed in and handed back as
`AutoscalingState`. The operator's timer and the Alertmanager webhook only gather inputs, call `decide`, persist
`Decision.state` and `Decision` records in the CR status (`state_from_status` / `variant_status` convert), and act
on `Decision.desired_replicas` (scale-down goes through the drain path). docs/autoscaling.md explains the
algorithm and maps PromQL queries to the signals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from crds.models import (
    AlertIntent as AlertIntentStatus,
)
from crds.models import (
    AutoscalingSpec,
    DecisionTrigger,
    MetricInputs,
    Recommendation,
    ScaleDecision,
    VariantAutoscalingStatus,
)

SignalName = Literal["queueDepthPerReplica", "kvCacheUtilization", "ttftP95Seconds"]
Direction = Literal["up", "down", "none"]

# ceil() of a product of floats such as 2 * 0.8 / 0.8 must not round 2.0000000000000004 up to 3.
_CEIL_EPSILON = 1e-9
# Signals aggregated over a time range (a 1-minute average, a 1-minute percentile): they keep reporting old
# congestion for that long after new pods serve. The queue is an instant gauge.
_LAGGING: frozenset[SignalName] = frozenset({"kvCacheUtilization", "ttftP95Seconds"})
_LABELS: dict[SignalName, str] = {
    "queueDepthPerReplica": "queue depth",
    "kvCacheUtilization": "KV-cache utilisation",
    "ttftP95Seconds": "TTFT p95",
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class AutoscalingPolicy(_Frozen):
    """How one variant scales. The first nine fields mirror the CR's `variants[].autoscaling` (and its defaults;
    `policy_from_spec` converts); the last three are operator settings."""

    min_replicas: int = Field(1, ge=0, description="Lower bound; 0 only together with scale_to_zero_after_seconds.")
    max_replicas: int = Field(10, ge=1, description="Upper bound.")
    queue_depth_per_replica: float | None = Field(
        2.0, gt=0, description="Target mean of vllm:num_requests_waiting per ready pod; None disables the signal."
    )
    kv_cache_utilization: float | None = Field(
        0.7, gt=0, le=1, description="Target mean vllm:kv_cache_usage_perc (0..1); None disables the signal."
    )
    ttft_p95_seconds: float | None = Field(
        None, gt=0, description="Target p95 time to first token in seconds; None disables the signal."
    )
    tolerance: float = Field(0.1, ge=0, lt=1, description="No change while demand is within this fraction of current.")
    scale_up_max_step: int | None = Field(4, ge=1, description="Most pods added by one decision; None: no limit.")
    scale_down_stabilization_seconds: float = Field(
        120.0, ge=0, description="Scale down only to the highest recommendation of this many past seconds."
    )
    scale_to_zero_after_seconds: float | None = Field(
        None, gt=0, description="Scale to zero after this long without traffic; needs min_replicas 0."
    )
    max_metrics_age_seconds: float = Field(
        60.0, gt=0, description="Metrics older than this are stale: they never scale down."
    )
    expected_startup_seconds: float = Field(
        300.0, gt=0, description="How long a starting pod counts as capacity on its way; after that it is stuck."
    )
    settle_seconds: float = Field(
        60.0, ge=0, description="How long range-aggregated signals (1m KV average, TTFT p95) lag a new ready pod."
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingPolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) is greater than maxReplicas ({self.max_replicas}): "
                "lower minReplicas or raise maxReplicas"
            )
        if self.min_replicas == 0 and self.scale_to_zero_after_seconds is None:
            raise ValueError(
                "minReplicas 0 needs scaleToZeroAfterSeconds (how long without traffic before scaling to zero): "
                "set it, or set minReplicas to at least 1"
            )
        if self.scale_to_zero_after_seconds is not None and self.min_replicas != 0:
            raise ValueError(
                f"scaleToZeroAfterSeconds is set but minReplicas is {self.min_replicas}: "
                "set minReplicas to 0 to allow scaling to zero, or remove scaleToZeroAfterSeconds"
            )
        return self

    def targets(self) -> dict[SignalName, float]:
        """The configured signal targets, by CR field name."""
        configured: dict[SignalName, float | None] = {
            "queueDepthPerReplica": self.queue_depth_per_replica,
            "kvCacheUtilization": self.kv_cache_utilization,
            "ttftP95Seconds": self.ttft_p95_seconds,
        }
        return {name: target for name, target in configured.items() if target is not None}


class MetricsSample(_Frozen):
    """Pod metrics for one variant, averaged over the `ready_pods` pods that reported, taken at `observed_at`."""

    observed_at: float = Field(description="Unix seconds when the sample was taken (or the query's evaluation time).")
    ready_pods: int = Field(ge=0, description="How many ready pods the averages were taken over.")
    queue_depth_per_replica: float | None = Field(None, ge=0, description="Mean vllm:num_requests_waiting per pod.")
    kv_cache_utilization: float | None = Field(None, ge=0, le=1, description="Mean vllm:kv_cache_usage_perc.")
    ttft_p95_seconds: float | None = Field(None, ge=0, description="p95 of vllm:time_to_first_token_seconds.")
    running_requests: float | None = Field(None, ge=0, description="Sum of vllm:num_requests_running.")
    waiting_requests: float | None = Field(None, ge=0, description="Sum of vllm:num_requests_waiting.")

    def value(self, name: SignalName) -> float | None:
        return {
            "queueDepthPerReplica": self.queue_depth_per_replica,
            "kvCacheUtilization": self.kv_cache_utilization,
            "ttftP95Seconds": self.ttft_p95_seconds,
        }[name]


class GatewaySample(_Frozen):
    """What the gateway reports for the variant: requests it holds because no pod can take them (at zero)."""

    observed_at: float
    queued_requests: float = Field(ge=0)


class PodCounts(_Frozen):
    """The variant's pods right now. Draining pods are leaving and count as neither capacity nor demand."""

    ready: int = Field(ge=0)
    starting_since: tuple[float, ...] = Field(
        (), description="Creation times (unix seconds) of pods that exist but are not ready yet."
    )
    ready_since: tuple[float, ...] = Field(
        (), description="When each ready pod turned ready (its Ready condition's lastTransitionTime); optional."
    )
    draining: int = Field(0, ge=0)

    @property
    def starting(self) -> int:
        return len(self.starting_since)


class AlertIntent(_Frozen):
    """A bounded scale-up asked for by an alert: keep at least `min_replicas` until `expires_at`."""

    name: str = Field(min_length=1)
    received_at: float
    expires_at: float
    min_replicas: int = Field(ge=1)

    @model_validator(mode="after")
    def _check_expiry(self) -> AlertIntent:
        if self.expires_at <= self.received_at:
            raise ValueError(
                f"alert intent {self.name!r} expires at {self.expires_at} before it was received "
                f"({self.received_at}): give it a positive time to live"
            )
        return self


class RecommendationRecord(_Frozen):
    """One past recommendation (bounded, before the scale-up step limit)."""

    time: float
    replicas: int = Field(ge=0)


class QueueRecord(_Frozen):
    """The total of waiting requests over the variant's ready pods at one evaluation."""

    time: float
    total: float = Field(ge=0)


class AutoscalingState(_Frozen):
    """Everything `decide` remembers between calls; the caller persists it (see `variant_status`)."""

    window: tuple[RecommendationRecord, ...] = Field((), description="Recommendations of the stabilisation window.")
    alerts: tuple[AlertIntent, ...] = ()
    last_active_at: float | None = Field(None, description="Last time traffic was seen (or could not be ruled out).")
    answered: dict[SignalName, RecommendationRecord] = Field(
        default_factory=dict, description="Per signal, the last scale-up it asked for: when, and to how many."
    )
    queue: QueueRecord | None = Field(None, description="The last queue total seen, to tell a draining backlog.")


class SignalRecommendation(_Frozen):
    """What one signal asks for: ceil(measured pods * value / target), or current within tolerance."""

    name: SignalName
    value: float
    target: float
    measured_pods: int
    replicas: int
    within_tolerance: bool


class Decision(_Frozen):
    """The outcome of one evaluation. `state` must be persisted; `reason` is fit for an Event and describe."""

    time: float
    current_replicas: int
    desired_replicas: int
    recommendation: int = Field(description="Bounded recommendation before the scale-up step limit.")
    signals: tuple[SignalRecommendation, ...]
    metrics: MetricsSample | None = Field(description="The sample decided on; None if missing or stale.")
    gateway_queued: float | None
    pods: PodCounts
    traffic_seen: bool
    state: AutoscalingState
    reason: str

    @property
    def direction(self) -> Direction:
        if self.desired_replicas > self.current_replicas:
            return "up"
        if self.desired_replicas < self.current_replicas:
            return "down"
        return "none"


# ------------------------------------------------------------------------------------------------ the decision


def decide(
    policy: AutoscalingPolicy,
    *,
    now: float,
    current_replicas: int,
    pods: PodCounts,
    metrics: MetricsSample | None = None,
    gateway: GatewaySample | None = None,
    state: AutoscalingState | None = None,
) -> Decision:
    """Size one variant at time `now`. `current_replicas` is the count asked for so far (status desiredReplicas).

    1. Per signal: demand = ready pods measured * value / target; within `tolerance` of current nothing changes,
       else ceil(demand). The recommendation is the max over signals (startup-aware, see `_startup_aware`; a
       shrinking queue asks for nothing, see `_draining_queue`).
    2. Missing or stale metrics hold the current size: they never scale down, never to zero.
    3. Alert intents raise the floor while they live; then min/max bound it (0 only via the idle rule).
    4. Scale up at once, by at most `scale_up_max_step`; scale down only to the highest recommendation of the
       last `scale_down_stabilization_seconds` (the window is in `state`, so a restart keeps it).
    5. After `scale_to_zero_after_seconds` without traffic go to zero; at zero, wake when the gateway holds
       requests (one pod per `queue_depth_per_replica` queued requests, at least one).
    """
    if current_replicas < 0:
        raise ValueError(f"current_replicas must be >= 0, got {current_replicas}")
    state = state or AutoscalingState()
    fresh = metrics if metrics is not None and now - metrics.observed_at <= policy.max_metrics_age_seconds else None
    fresh_gateway = (
        gateway if gateway is not None and now - gateway.observed_at <= policy.max_metrics_age_seconds else None
    )
    alerts = tuple(alert for alert in state.alerts if alert.expires_at > now)
    alert = max(alerts, key=lambda intent: intent.min_replicas, default=None)
    traffic = _traffic_seen(fresh, fresh_gateway)
    last_active_at = now if traffic or state.last_active_at is None else state.last_active_at

    signals = signal_recommendations(policy, fresh, current_replicas) if fresh is not None else ()
    wanted: dict[SignalName, int] = {}
    notes: list[str] = []
    if current_replicas == 0:
        recommendation, headline = _from_zero(policy, fresh_gateway)
    elif signals:
        headline = _describe_signal(max(signals, key=lambda signal: signal.replicas))
        wanted = _startup_aware(policy, now, current_replicas, pods, state.answered, signals, notes)
        wanted = _draining_queue(policy, now, current_replicas, fresh, state.queue, wanted, notes)
        recommendation = max(wanted.values())
    else:
        recommendation = current_replicas
        headline = _missing_data_headline(metrics, now)

    if alert is not None and alert.min_replicas > recommendation:
        recommendation = alert.min_replicas
        notes.append(f"alert {alert.name} holds at least {alert.min_replicas} for {alert.expires_at - now:.0f}s more")
    floor = policy.min_replicas if current_replicas == 0 else max(policy.min_replicas, 1)
    if recommendation < floor:
        recommendation = floor
        notes.append(f"minReplicas {policy.min_replicas}" if policy.min_replicas else "at least 1 while active")
    if recommendation > policy.max_replicas:
        recommendation = policy.max_replicas
        notes.append(f"maxReplicas {policy.max_replicas}")

    idle_for = now - last_active_at
    to_zero = (
        policy.scale_to_zero_after_seconds is not None
        and current_replicas > 0
        and not traffic
        and alert is None
        and idle_for >= policy.scale_to_zero_after_seconds
    )
    if to_zero:
        recommendation = 0
        headline = f"no traffic for {idle_for:.0f}s (scaleToZeroAfterSeconds {policy.scale_to_zero_after_seconds:g})"

    window = _prune(
        (*state.window, RecommendationRecord(time=now, replicas=recommendation)),
        now,
        policy.scale_down_stabilization_seconds,
    )
    desired = _apply_rate_rules(policy, now, current_replicas, recommendation, window, to_zero, notes)
    if desired > policy.max_replicas:  # a lowered maxReplicas applies at once, without stabilisation
        desired = policy.max_replicas
    reason = f"{headline} -> {desired} replicas"
    if notes:
        reason = f"{reason} ({'; '.join(notes)})"
    scaled_up = {
        name: min(replicas, policy.max_replicas) for name, replicas in wanted.items() if desired > current_replicas
    }
    return Decision(
        time=now,
        current_replicas=current_replicas,
        desired_replicas=desired,
        recommendation=recommendation,
        signals=signals,
        metrics=fresh,
        gateway_queued=fresh_gateway.queued_requests if fresh_gateway is not None else None,
        pods=pods,
        traffic_seen=traffic,
        state=AutoscalingState(
            window=window,
            alerts=alerts,
            last_active_at=last_active_at,
            answered=_answered(policy, now, state.answered, scaled_up, current_replicas),
            queue=_queue_record(fresh) or state.queue,
        ),
        reason=reason,
    )


def signal_recommendations(
    policy: AutoscalingPolicy, metrics: MetricsSample, current_replicas: int
) -> tuple[SignalRecommendation, ...]:
    """Per configured signal present in `metrics`: the replicas that bring it to its target (HPA formula).

    Demand is measured_pods * value / target pods' worth (the value was measured on those pods, and starting pods
    are already part of `current_replicas`); within `tolerance` of `current_replicas` nothing changes.
    """
    if metrics.ready_pods == 0:
        return ()
    out = []
    for name, target in policy.targets().items():
        value = metrics.value(name)
        if value is None:
            continue
        demand = metrics.ready_pods * value / target
        within = current_replicas > 0 and abs(demand / current_replicas - 1) <= policy.tolerance
        out.append(
            SignalRecommendation(
                name=name,
                value=value,
                target=target,
                measured_pods=metrics.ready_pods,
                replicas=current_replicas if within else _ceil(demand),
                within_tolerance=within,
            )
        )
    return tuple(out)


def _ceil(value: float) -> int:
    return math.ceil(value - _CEIL_EPSILON)


def _fmt(name: SignalName, value: float) -> str:
    if name == "queueDepthPerReplica":
        return f"{value:.3g}/replica"
    if name == "kvCacheUtilization":
        return f"{value * 100:.0f}%"
    return f"{value:.3g}s"


def _describe_signal(signal: SignalRecommendation) -> str:
    label, value = _LABELS[signal.name], _fmt(signal.name, signal.value)
    target = f"{signal.target:.3g}" if signal.name == "queueDepthPerReplica" else _fmt(signal.name, signal.target)
    if signal.within_tolerance:
        return f"{label} {value} within tolerance of target {target}"
    relation = ">" if signal.value > signal.target else "<="
    return f"{label} {value} {relation} target {target} (wants {signal.replicas})"


def _missing_data_headline(metrics: MetricsSample | None, now: float) -> str:
    if metrics is None:
        why = "no metrics"
    elif metrics.ready_pods == 0:
        why = "no ready pod reported metrics"
    else:
        why = f"metrics stale ({now - metrics.observed_at:.0f}s old)"
    return f"{why}: holding, missing data never scales down"


def _traffic_seen(metrics: MetricsSample | None, gateway: GatewaySample | None) -> bool:
    """True unless fresh data positively shows no running, waiting or gateway-queued request."""
    if gateway is not None and gateway.queued_requests > 0:
        return True
    if metrics is None or metrics.running_requests is None or metrics.waiting_requests is None:
        return True
    return metrics.running_requests > 0 or metrics.waiting_requests > 0


def _from_zero(policy: AutoscalingPolicy, gateway: GatewaySample | None) -> tuple[int, str]:
    """At zero there are no pod metrics: only requests held by the gateway (or an alert) wake the variant."""
    if gateway is None or gateway.queued_requests <= 0:
        return 0, "at zero with no queued requests"
    per_replica = policy.queue_depth_per_replica or 1.0
    wanted = max(1, _ceil(gateway.queued_requests / per_replica))
    return wanted, f"waking from zero: gateway holds {gateway.queued_requests:g} queued requests"


def _hold_period(policy: AutoscalingPolicy) -> float:
    return policy.expected_startup_seconds + policy.settle_seconds


def _answered(
    policy: AutoscalingPolicy,
    now: float,
    previous: dict[SignalName, RecommendationRecord],
    asked: dict[SignalName, int],
    current: int,
) -> dict[SignalName, RecommendationRecord]:
    """Remember, per signal, the scale-up it asked for; forget what is older than any hold could last."""
    kept = {name: record for name, record in previous.items() if now - record.time < _hold_period(policy)}
    for name, replicas in asked.items():
        if replicas > current:
            kept[name] = RecommendationRecord(time=now, replicas=replicas)
    return kept


def _startup_aware(
    policy: AutoscalingPolicy,
    now: float,
    current: int,
    pods: PodCounts,
    answered: dict[SignalName, RecommendationRecord],
    signals: tuple[SignalRecommendation, ...],
    notes: list[str],
) -> dict[SignalName, int]:
    """Per signal, its recommendation, except that no signal adds pods twice for the demand it already asked for.

    Starting pods are already in `current`, so a steady signal asks for nothing more while they load. But a queue
    keeps growing until new pods serve, and averages and percentiles over a range keep reporting the congestion
    after they are ready, so signals rise although the capacity that answers them is on its way. While pods still
    load (created less than `expected_startup_seconds` ago), a signal that asked for a scale-up within that time
    is held at what it asked for; range-aggregated signals stay held while new pods settle (ready for less than
    `settle_seconds`). Signals that did not ask are free: new demand of another kind (or after a small scale-up
    caused by noise in another signal) is answered at once.
    """
    wanted = {signal.name: signal.replicas for signal in signals}
    loading = [t for t in pods.starting_since if now - t < policy.expected_startup_seconds]
    settling = [t for t in pods.ready_since if now - t < policy.settle_seconds]
    if max(wanted.values()) <= current or not (loading or settling):
        return wanted
    held = dict(wanted)
    for name, replicas in wanted.items():
        record = answered.get(name)
        if record is None or now - record.time >= _hold_period(policy) or replicas <= record.replicas:
            continue
        if loading or name in _LAGGING:
            held[name] = max(current, record.replicas)
    if max(held.values()) < max(wanted.values()):
        what = f"{len(loading)} pod(s) starting" if loading else f"{len(settling)} new pod(s) settling"
        notes.append(f"{what}: holding at {max(held.values())} for the demand they answer")
    return held


def _queue_record(metrics: MetricsSample | None) -> QueueRecord | None:
    if metrics is None or metrics.queue_depth_per_replica is None or metrics.ready_pods == 0:
        return None
    return QueueRecord(time=metrics.observed_at, total=metrics.queue_depth_per_replica * metrics.ready_pods)


def _draining_queue(
    policy: AutoscalingPolicy,
    now: float,
    current: int,
    metrics: MetricsSample | None,
    previous: QueueRecord | None,
    wanted: dict[SignalName, int],
    notes: list[str],
) -> dict[SignalName, int]:
    """A queue that shrank since the last evaluation is being worked off: it asks for no more pods.

    Requests wait in the pod they were routed to, so after a burst a few pods can hold a backlog that new pods
    cannot take over; the mean queue stays high while capacity is already sufficient, and adding pods then is
    pure overshoot. A growing (or steady) queue still scales by the formula.
    """
    record = _queue_record(metrics)
    asked = wanted.get("queueDepthPerReplica")
    if record is None or previous is None or asked is None or asked <= current:
        return wanted
    if now - previous.time > policy.max_metrics_age_seconds or record.total >= previous.total:
        return wanted
    notes.append(f"queue shrinking ({previous.total:g} -> {record.total:g} waiting): not adding pods for it")
    return {**wanted, "queueDepthPerReplica": current}


def _prune(window: tuple[RecommendationRecord, ...], now: float, seconds: float) -> tuple[RecommendationRecord, ...]:
    """Keep the records of the last `seconds`, plus the newest older one: it held at the window's start."""
    ordered = sorted(window, key=lambda record: record.time)
    start = now - seconds
    inside = [record for record in ordered if record.time > start]
    before = [record for record in ordered if record.time <= start]
    return tuple(before[-1:] + inside)


def _apply_rate_rules(
    policy: AutoscalingPolicy,
    now: float,
    current: int,
    recommendation: int,
    window: tuple[RecommendationRecord, ...],
    to_zero: bool,
    notes: list[str],
) -> int:
    """Scale up at once (by at most scale_up_max_step); scale down only to the window's highest recommendation,
    and only once the window covers the whole stabilisation period. Scaling to zero has its own idle timer."""
    if recommendation > current:
        step = policy.scale_up_max_step
        if step is not None and recommendation - current > step:
            notes.append(f"max step {step}")
            return current + step
        return recommendation
    if recommendation == current or current == 0:
        return current
    if to_zero:
        return 0
    period = policy.scale_down_stabilization_seconds
    if window[0].time > now - period:
        notes.append(f"scale-down waits for {period:g}s of history")
        return current
    highest = max(record.replicas for record in window)
    if highest >= current:
        notes.append(f"scale-down stabilisation: {highest} recommended within the last {period:g}s")
        return current
    return highest


# ----------------------------------------------------------------------------------------------- alert intents


def alert_intent(
    name: str,
    *,
    now: float,
    current_replicas: int,
    policy: AutoscalingPolicy,
    step: int = 1,
    ttl_seconds: float = 300.0,
) -> AlertIntent:
    """The intent of a firing alert: `step` more pods than now (bounded by scale_up_max_step and max_replicas),
    until `ttl_seconds` from now."""
    if step < 1:
        raise ValueError(f"alert step must be at least 1, got {step}")
    if policy.scale_up_max_step is not None:
        step = min(step, policy.scale_up_max_step)
    floor = min(policy.max_replicas, current_replicas + step)
    return AlertIntent(name=name, received_at=now, expires_at=now + ttl_seconds, min_replicas=max(floor, 1))


def add_alert(state: AutoscalingState, intent: AlertIntent) -> AutoscalingState:
    """Record an intent. A repeat of a live alert (Alertmanager re-sends while it fires) extends its expiry
    without stacking another step on top: the floor stays the higher of the two."""
    live = [alert for alert in state.alerts if alert.name == intent.name and alert.expires_at > intent.received_at]
    others = tuple(alert for alert in state.alerts if alert.name != intent.name)
    if live:
        previous = live[0]
        intent = AlertIntent(
            name=intent.name,
            received_at=previous.received_at,
            expires_at=max(previous.expires_at, intent.expires_at),
            min_replicas=max(previous.min_replicas, intent.min_replicas),
        )
    return state.model_copy(update={"alerts": (*others, intent)})


def remove_alert(state: AutoscalingState, name: str) -> AutoscalingState:
    """End the intent of a resolved alert."""
    return state.model_copy(update={"alerts": tuple(alert for alert in state.alerts if alert.name != name)})


# --------------------------------------------------------------------------------------- the CR's spec and status


def policy_from_spec(
    spec: AutoscalingSpec,
    *,
    max_metrics_age_seconds: float = 60.0,
    expected_startup_seconds: float = 300.0,
    settle_seconds: float = 60.0,
) -> AutoscalingPolicy:
    """The policy of a variant's `autoscaling` spec plus the operator's settings. Raises pydantic's
    ValidationError for combinations crds/validate.py reports as InvalidSpec (min > max, zero without idle time)."""
    targets = spec.targets
    return AutoscalingPolicy(
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        queue_depth_per_replica=targets.queue_depth_per_replica,
        kv_cache_utilization=targets.kv_cache_utilization,
        ttft_p95_seconds=targets.ttft_p95_seconds,
        tolerance=spec.tolerance,
        scale_up_max_step=spec.scale_up_max_step,
        scale_down_stabilization_seconds=spec.scale_down_stabilization_seconds,
        scale_to_zero_after_seconds=spec.scale_to_zero_after_seconds,
        max_metrics_age_seconds=max_metrics_age_seconds,
        expected_startup_seconds=expected_startup_seconds,
        settle_seconds=settle_seconds,
    )


def _ts(moment: datetime) -> float:
    return moment.timestamp()


def _dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def state_from_status(status: VariantAutoscalingStatus | None) -> AutoscalingState:
    """The decision's memory from a variant's `status.autoscaling.variants[]` entry. The per-signal scale-up
    records and the last queue total have no status field: after a restart they start empty, which only means
    one evaluation without the startup hold and the draining-queue check."""
    if status is None:
        return AutoscalingState()
    return AutoscalingState(
        window=tuple(RecommendationRecord(time=_ts(r.time), replicas=r.replicas) for r in status.recommendations),
        alerts=tuple(
            AlertIntent(
                name=a.alert, received_at=_ts(a.received_at), expires_at=_ts(a.expires_at), min_replicas=a.replicas
            )
            for a in status.alert_intents
            if a.replicas >= 1 and a.expires_at > a.received_at
        ),
        last_active_at=_ts(status.idle_since) if status.idle_since is not None else None,
    )


def variant_status(
    decision: Decision,
    previous: VariantAutoscalingStatus | None,
    *,
    name: str,
    trigger: DecisionTrigger = DecisionTrigger.TIMER,
    alert_details: Mapping[str, tuple[str | None, str]] | None = None,
    max_decisions: int = 10,
) -> VariantAutoscalingStatus:
    """The variant's new `status.autoscaling.variants[]` entry after `decision`: desired size, window, live alert
    intents, idle time, and the decision appended to the bounded `lastDecisions` (oldest first). An intent's
    Alertmanager fingerprint and summary come from `alert_details` (alert name -> (fingerprint, summary)) for
    alerts just received, else from `previous`."""
    previous = previous or VariantAutoscalingStatus(name=name)
    details = {alert.alert: (alert.fingerprint, alert.reason) for alert in previous.alert_intents}
    details.update(alert_details or {})
    record = ScaleDecision(
        time=_dt(decision.time),
        trigger=trigger,
        current_replicas=decision.current_replicas,
        ready_replicas=decision.pods.ready,
        starting_replicas=decision.pods.starting,
        desired_replicas=decision.desired_replicas,
        inputs=MetricInputs(
            queue_depth_per_replica=decision.metrics.queue_depth_per_replica if decision.metrics else None,
            kv_cache_utilization=decision.metrics.kv_cache_utilization if decision.metrics else None,
            ttft_p95_seconds=decision.metrics.ttft_p95_seconds if decision.metrics else None,
            gateway_queued=math.ceil(decision.gateway_queued) if decision.gateway_queued is not None else None,
        ),
        reason=decision.reason[:4096],
    )
    state = decision.state
    return VariantAutoscalingStatus(
        name=name,
        desired_replicas=decision.desired_replicas,
        last_scale_time=_dt(decision.time) if decision.direction != "none" else previous.last_scale_time,
        idle_since=None if decision.traffic_seen or state.last_active_at is None else _dt(state.last_active_at),
        last_decisions=[*previous.last_decisions, record][-max_decisions:],
        recommendations=[Recommendation(time=_dt(r.time), replicas=r.replicas) for r in state.window],
        alert_intents=[
            AlertIntentStatus(
                alert=alert.name,
                fingerprint=details.get(alert.name, (None, ""))[0],
                replicas=alert.min_replicas,
                received_at=_dt(alert.received_at),
                expires_at=_dt(alert.expires_at),
                reason=details.get(alert.name, (None, ""))[1][:4096],
            )
            for alert in state.alerts
        ],
    )
