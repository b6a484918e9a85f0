"""One autoscaling evaluation of a deployment: measured inputs per variant in, status entries and Events out.

Why it exists: `controllers.autoscaling.decide` sizes one variant; around it sit more decisions that are just as
pure and belong with it, not in the operator's shell: which pods count as a variant's capacity (`owned`,
`pod_counts`: ready with their Ready time, starting with their creation time, draining and terminating apart),
which alert intents apply to a variant (`intents_for`) and how they enter its state, what triggered a decision
(alert, wake from zero, timer), how the stabilisation window and the decision history kept in `status.autoscaling`
stay bounded (`collapse_runs`, `compact_window`, `record_decision`), the status merge patch (`autoscaling_patch`)
and the Event of a size change (`scale_event`). `evaluate_variants` runs them for every autoscaled variant. The
operator (`fleet_operator.autoscaler`) only fetches the inputs (pods, metrics, the gateway's held requests, alert
intents), calls `evaluate_variants` and writes the status; time is an argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from controllers.actions import EmitEvent, EventType
from controllers.autoscaling import (
    AutoscalingPolicy,
    AutoscalingState,
    Decision,
    GatewaySample,
    MetricsSample,
    PodCounts,
    add_alert,
    alert_intent,
    decide,
    policy_from_spec,
    remove_alert,
    state_from_status,
    variant_status,
)
from controllers.observed import parse_time
from controllers.reasons import Reason
from controllers.sizing import desired_sizes
from crds.models import (
    AutoscalingStatus,
    DecisionTrigger,
    InferenceDeploymentSpec,
    Recommendation,
    VariantAutoscalingStatus,
)
from crds.pods import LABEL_VARIANT, is_draining, ready_condition

# The status keeps at most 1024 window records (CRD); compact well before that (see `compact_window`).
MAX_WINDOW_RECORDS = 512


@dataclass(frozen=True)
class ScaleIntent:
    """One alert's ask: add `step` pods to a deployment's variant (or all its variants) until `expires_at`;
    `firing=False` ends the intent of the same alert instead."""

    deployment: str
    namespace: str | None
    variant: str | None
    alert: str
    fingerprint: str | None
    firing: bool
    step: int
    received_at: float
    expires_at: float
    reason: str

    @property
    def ttl_seconds(self) -> float:
        return self.expires_at - self.received_at


@dataclass(frozen=True)
class VariantInputs:
    """What was measured for one variant at one evaluation."""

    pods: PodCounts
    metrics: MetricsSample | None = None
    gateway: GatewaySample | None = None


@dataclass(frozen=True)
class VariantOutcome:
    """One variant's decision and the status entry that records it."""

    variant: str
    trigger: DecisionTrigger
    decision: Decision
    entry: VariantAutoscalingStatus


def owned(pods: Iterable[Mapping[str, Any]], uid: str | None) -> list[Mapping[str, Any]]:
    """The pods this InferenceDeployment controls (a pod merely carrying its labels is not its capacity)."""

    def controlled(pod: Mapping[str, Any]) -> bool:
        refs = (pod.get("metadata") or {}).get("ownerReferences") or []
        return any(ref.get("controller") and ref.get("uid") == uid for ref in refs)

    return [pod for pod in pods if controlled(pod)]


def pod_counts(pods: Iterable[Mapping[str, Any]], variant: str) -> PodCounts:
    """The variant's pods as the decision counts them: ready (with when they turned ready), starting (created,
    not ready yet, with their creation time) and leaving (marked draining, or terminating). Ended pods (Failed,
    Succeeded) count as nothing: the reconcile loop replaces them, and the replacement then counts as starting.
    A missing timestamp reads as long ago: settled if ready, stuck (not capacity on its way) if not."""
    ready_since: list[float] = []
    starting_since: list[float] = []
    draining = 0
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(LABEL_VARIANT) != variant:
            continue
        if meta.get("deletionTimestamp") or is_draining(pod):
            draining += 1
            continue
        status = pod.get("status") or {}
        if status.get("phase") in ("Failed", "Succeeded"):
            continue
        created = parse_time(meta.get("creationTimestamp"))
        ready = ready_condition(pod)
        if ready is not None:
            since = parse_time(ready.get("lastTransitionTime")) or created
            ready_since.append(since.timestamp() if since is not None else 0.0)
        else:
            starting_since.append(created.timestamp() if created is not None else 0.0)
    return PodCounts(
        ready=len(ready_since),
        ready_since=tuple(sorted(ready_since)),
        starting_since=tuple(sorted(starting_since)),
        draining=draining,
    )


def wants_autoscaling(body: Mapping[str, Any]) -> bool:
    """Whether a CR (as kopf last saw it) has an autoscaled variant, or autoscaler status left to clean up."""
    variants = (body.get("spec") or {}).get("variants") or []
    leftover = ((body.get("status") or {}).get("autoscaling") or {}).get("variants")
    return bool(leftover) or any(isinstance(v, Mapping) and v.get("autoscaling") for v in variants)


def variants_at_zero(body: Mapping[str, Any]) -> list[str]:
    """Autoscaled variants the autoscaler last sized to zero pods (from the CR as kopf last saw it)."""
    decided = ((body.get("status") or {}).get("autoscaling") or {}).get("variants") or []
    return [str(v.get("name")) for v in decided if isinstance(v, Mapping) and v.get("desiredReplicas") == 0]


def intents_for(intents: Iterable[ScaleIntent], namespace: str, deployment: str, variant: str) -> list[ScaleIntent]:
    """The alert intents that name this variant (no namespace: any; no variant: every autoscaled one)."""
    return [
        intent
        for intent in intents
        if intent.deployment == deployment
        and (intent.namespace is None or intent.namespace == namespace)
        and (intent.variant is None or intent.variant == variant)
    ]


def collapse_runs(records: Sequence[Recommendation]) -> list[Recommendation]:
    """Keep the first record of each run of equal recommendations. The window is piecewise constant (a record
    holds until the next one), so this changes no decision, and a steady variant's window stops changing: its
    status is not rewritten at every tick."""
    kept: list[Recommendation] = []
    for record in records:
        if not kept or kept[-1].replicas != record.replicas:
            kept.append(record)
    return kept


def compact_window(records: Sequence[Recommendation], limit: int = MAX_WINDOW_RECORDS) -> list[Recommendation]:
    """Bound the stabilisation window kept in status: past `limit` records, drop every record (but the oldest,
    which shows how far back the history reaches) that a later record equals or exceeds. The window's maximum
    over any suffix is unchanged, so scale-down is never earlier; at most one record per replica count is left."""
    if len(records) <= limit:
        return list(records)
    kept: list[Recommendation] = []
    highest_later = -1
    for record in reversed(records[1:]):
        if record.replicas > highest_later:
            kept.append(record)
            highest_later = record.replicas
    return [records[0], *reversed(kept)]


def record_decision(
    decision: Decision,
    previous: VariantAutoscalingStatus | None,
    *,
    name: str,
    trigger: DecisionTrigger,
    alert_details: Mapping[str, tuple[str | None, str]] | None = None,
) -> VariantAutoscalingStatus:
    """`variant_status`, with bounds of its own: a decision that repeats the previous one (same trigger, sizes
    and reason) is not recorded again (the record keeps the time it was first made: the size has held since),
    so it neither pushes older, different decisions out of `lastDecisions` nor rewrites the status at every
    tick; the window keeps the first record of each run of equal ones and is compacted before it could outgrow
    the CRD's limit."""
    entry = variant_status(decision, previous, name=name, trigger=trigger, alert_details=alert_details)
    decisions = entry.last_decisions
    if len(decisions) >= 2 and _same(decisions[-1], decisions[-2]):
        decisions = decisions[:-1]
    window = compact_window(collapse_runs(entry.recommendations))
    return entry.model_copy(update={"last_decisions": decisions, "recommendations": window})


def _same(a: Any, b: Any) -> bool:
    return bool(a.model_copy(update={"time": b.time}) == b)


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of a deployment: a decision per autoscaled variant with inputs, and the autoscaled
    variants left alone with why (an autoscaling block `policy_from_spec` refuses; the reconcile loop reports
    it as InvalidSpec)."""

    outcomes: tuple[VariantOutcome, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()  # (variant, why)


def evaluate_variants(
    spec: InferenceDeploymentSpec,
    previous: AutoscalingStatus,
    inputs: Mapping[str, VariantInputs],
    *,
    namespace: str,
    deployment: str,
    now: float,
    intents: Sequence[ScaleIntent] = (),
    expected_startup_seconds: float = 300.0,
    settle_seconds: float = 60.0,
) -> Evaluation:
    """Decide every autoscaled variant that has inputs. The current size is what the planner pursues
    (`controllers.sizing.desired_sizes`: the last decision clamped to min/max, or the initial size); firing
    alert intents for the variant are added to its state first, resolved ones removed."""
    sizes = desired_sizes(spec, previous)
    entries = {entry.name: entry for entry in previous.variants}
    outcomes: list[VariantOutcome] = []
    skipped: list[tuple[str, str]] = []
    for variant in spec.variants:
        if variant.autoscaling is None or variant.name not in inputs:
            continue
        try:
            policy = policy_from_spec(
                variant.autoscaling, expected_startup_seconds=expected_startup_seconds, settle_seconds=settle_seconds
            )
        except ValidationError as error:
            skipped.append((variant.name, str(error)))
            continue
        current = sizes[variant.name].replicas
        previous_entry = entries.get(variant.name)
        mine = intents_for(intents, namespace, deployment, variant.name)
        state, details = _with_alerts(state_from_status(previous_entry), mine, policy, current, now)
        measured = inputs[variant.name]
        decision = decide(
            policy,
            now=now,
            current_replicas=current,
            pods=measured.pods,
            metrics=measured.metrics,
            gateway=measured.gateway,
            state=state,
        )
        trigger = _trigger(bool(mine), current, decision)
        entry = record_decision(decision, previous_entry, name=variant.name, trigger=trigger, alert_details=details)
        outcomes.append(VariantOutcome(variant.name, trigger, decision, entry))
    return Evaluation(tuple(outcomes), tuple(skipped))


def _with_alerts(
    state: AutoscalingState, intents: Sequence[ScaleIntent], policy: AutoscalingPolicy, current: int, now: float
) -> tuple[AutoscalingState, dict[str, tuple[str | None, str]]]:
    """The variant's state with its firing alert intents added and resolved ones removed, and the details
    (fingerprint, reason) of the firing ones, for the status record."""
    details: dict[str, tuple[str | None, str]] = {}
    for intent in intents:
        if intent.firing:
            ask = alert_intent(
                intent.alert,
                now=now,
                current_replicas=current,
                policy=policy,
                step=intent.step,
                ttl_seconds=intent.ttl_seconds,
            )
            state = add_alert(state, ask)
            details[intent.alert] = (intent.fingerprint, intent.reason)
        else:
            state = remove_alert(state, intent.alert)
    return state, details


def _trigger(alerted: bool, current: int, decision: Decision) -> DecisionTrigger:
    """What the status records as the decision's cause: an alert named the variant, a wake from zero, else the
    timer."""
    if alerted:
        return DecisionTrigger.ALERT
    if current == 0 and decision.desired_replicas > 0:
        return DecisionTrigger.WAKE
    return DecisionTrigger.TIMER


def autoscaling_patch(
    spec: InferenceDeploymentSpec, previous: AutoscalingStatus, outcomes: Sequence[VariantOutcome]
) -> dict[str, Any] | None:
    """The `status.autoscaling` merge patch: one entry per autoscaled variant in spec order (new decisions, else
    the previous entry), entries of variants no longer autoscaled dropped; None when nothing changes."""
    decided = {outcome.variant: outcome.entry for outcome in outcomes}
    kept = {entry.name: entry for entry in previous.variants}
    entries = [
        decided.get(v.name) or kept[v.name]
        for v in spec.variants
        if v.autoscaling is not None and (v.name in decided or v.name in kept)
    ]
    after = AutoscalingStatus(variants=entries)
    if after == previous:
        return None
    return {"autoscaling": after.model_dump(mode="json", by_alias=True, exclude_none=True)}


def scale_event(outcome: VariantOutcome) -> EmitEvent:
    """The Event of a size change, with the decision's reason (what `kubectl describe infd` shows)."""
    d = outcome.decision
    message = (
        f"variant {outcome.variant}: {d.current_replicas} -> {d.desired_replicas} replicas "
        f"({outcome.trigger.value.lower()}): {d.reason}"
    )
    return EmitEvent(EventType.NORMAL, Reason.AUTOSCALED, message)
