"""The planner: `reconcile(resource, observed, now) -> Plan`. Pure: no API calls, no clock, no randomness.

One pass looks at the InferenceDeployment (a dict as the API returns it) and what was observed of its pods, and
returns the actions that move the cluster one safe step towards the spec, plus the status that describes where
it stands. Run it again after the actions land and it asks for the next step; run it twice on the same input
and it asks for the same thing (actions are idempotent: deterministic pod names, uid-guarded deletes).

Rules, per variant (sizes from `controllers.sizing`, revisions from `controllers.revision`):
- Ended pods (Failed/Succeeded) are deleted and replaced.
- Pods to remove are the old-revision pods and the surplus beyond the desired size; they go in
  `controllers.ordering` order. An unready pod may always go (it serves nothing); a ready one only while the
  variant keeps at least `desired - policy.max_unavailable` ready pods.
- New pods are created up to the desired size; while old-revision pods remain, the variant may hold up to
  `desired + policy.max_surge` pods, so a revision change replaces pods without dropping capacity.
- Pods of variants no longer in the spec are deleted; pods labelled for the deployment but controlled by
  another owner are left alone.
An invalid spec changes nothing running: the pass only reports it (InvalidSpec condition, Warning Event).
A deployment being deleted has all its pods deleted; the plan is `finished` once none is left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from controllers.actions import (
    Action,
    CreatePod,
    DeletePod,
    EmitEvent,
    EnsureSecret,
    EnsureService,
    EventType,
    PatchStatus,
    Plan,
)
from controllers.conditions import WantedCondition, find, merge_conditions
from controllers.observed import Observed, PodInfo
from controllers.ordering import deletion_order
from controllers.pods import (
    DRAIN_TOKEN_KEY,
    PodDefaults,
    label_selector,
    pod_manifest,
    pod_name,
    pod_template,
    secret_manifest,
    service_manifest,
    service_matches,
)
from controllers.revision import revision_of
from controllers.sizing import VariantSize, desired_sizes, shares_spec_replicas, split_by_weight
from crds.helpers import dump_status, parse_spec, parse_status
from crds.models import (
    ConditionStatus,
    ConditionType,
    Endpoint,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    Phase,
    RevisionReplicas,
    VariantSpec,
    VariantStatus,
)
from crds.validate import validate

# Status fields this controller writes; the rest (rollout, autoscaling, drains) belong to other controllers.
OWNED_STATUS_FIELDS = (
    "observedGeneration",
    "phase",
    "replicas",
    "readyReplicas",
    "desiredReplicas",
    "labelSelector",
    "conditions",
    "variants",
    "endpoints",
)
MAX_REVISIONS_PER_VARIANT = 8
MAX_ENDPOINTS = 64
_PERCENT = 100


@dataclass(frozen=True)
class Policy:
    """Operator-wide planning limits (from the operator's settings)."""

    max_surge: int = 1  # extra pods a variant may have while it replaces old-revision pods
    max_unavailable: int = 0  # ready pods a variant may lose at once below its desired size
    defaults: PodDefaults = field(default_factory=PodDefaults)


@dataclass(frozen=True)
class _VariantOutcome:
    creates: tuple[CreatePod, ...]
    deletes: tuple[DeletePod, ...]
    status: VariantStatus
    endpoints: tuple[Endpoint, ...]
    progressing: str  # why it is still moving, "" when settled
    stuck: tuple[str, ...]  # names of pods that will not get ready by themselves
    failed: tuple[str, ...]  # names of ended pods being replaced


def reconcile(resource: Mapping[str, Any], observed: Observed, now: datetime, policy: Policy = Policy()) -> Plan:
    """Plan the next step for one InferenceDeployment (see the module docstring for the rules)."""
    meta = resource.get("metadata") or {}
    previous = _previous_status(resource.get("status"))
    own = tuple(pod for pod in observed.pods if pod.owner_uid == meta.get("uid"))
    if meta.get("deletionTimestamp"):
        return _deleting(meta, previous, own, now)
    problems = validate(resource.get("spec"))
    if problems:
        return _invalid(meta, previous, [str(problem) for problem in problems], now)
    return _converge(meta, parse_spec(resource["spec"]), previous, own, observed, now, policy)


# ---------------------------------------------------------------------------------------------------- converge


def _converge(
    meta: Mapping[str, Any],
    spec: InferenceDeploymentSpec,
    previous: InferenceDeploymentStatus,
    pods: Sequence[PodInfo],
    observed: Observed,
    now: datetime,
    policy: Policy,
) -> Plan:
    name = meta["name"]
    generation = meta.get("generation")
    sizes = desired_sizes(spec, previous.autoscaling)
    actions: list[Action] = []
    events: list[EmitEvent] = []
    if not observed.secret_exists:
        actions.append(EnsureSecret(secret_manifest(meta), DRAIN_TOKEN_KEY))
    service = service_manifest(meta, policy.defaults)
    if observed.service is None or not service_matches(observed.service, service):
        actions.append(EnsureService(service))

    outcomes = [
        _plan_variant(meta, spec, variant, sizes[variant.name], pods, policy) for variant in spec.variants
    ]
    names = {variant.name for variant in spec.variants}
    orphans = tuple(
        DeletePod(p.name, p.uid, p.variant, p.revision, "Orphaned", f"variant {p.variant!r} is no longer in the spec")
        for p in pods
        if p.variant not in names and not p.deleting
    )
    for outcome in outcomes:
        actions += outcome.deletes
    actions += orphans
    for outcome in outcomes:
        actions += outcome.creates

    old_sizes = {v.name: v.desired_replicas for v in previous.variants}
    for outcome in outcomes:
        size = sizes[outcome.status.name]
        before = old_sizes.get(size.variant)
        if before != size.replicas:
            events.append(
                EmitEvent(
                    EventType.NORMAL,
                    "Scaled",
                    f"variant {size.variant}: desired pods {before or 0} -> {size.replicas} ({size.describe()})",
                )
            )
    if previous.observed_generation != generation:
        if spec.replicas is not None and not shares_spec_replicas(spec):
            events.append(
                EmitEvent(
                    EventType.WARNING,
                    "ReplicasIgnored",
                    f"spec.replicas={spec.replicas} sizes no variant: every variant sets its own replicas or "
                    "autoscaling (kubectl scale has no effect)",
                )
            )
    invalid_before = find(previous.conditions, ConditionType.INVALID_SPEC)
    if invalid_before is not None and invalid_before.status == ConditionStatus.TRUE:
        events.append(EmitEvent(EventType.NORMAL, "SpecValid", "the spec is valid again; reconciling it"))

    status = _status(name, generation, previous, outcomes, orphans, observed, now)
    patch = _status_patch(previous, status)
    if patch is not None:
        actions.append(PatchStatus(patch))
    notes = tuple(
        f"{o.status.name}: {o.status.ready_replicas}/{o.status.desired_replicas} ready"
        + (f", {o.progressing}" if o.progressing else "")
        for o in outcomes
    )
    return Plan(actions=tuple(actions) + tuple(events), notes=notes)


def _plan_variant(
    meta: Mapping[str, Any],
    spec: InferenceDeploymentSpec,
    variant: VariantSpec,
    size: VariantSize,
    all_pods: Sequence[PodInfo],
    policy: Policy,
) -> _VariantOutcome:
    template = pod_template(meta["name"], spec, variant, policy.defaults)
    revision = revision_of(template)
    desired = size.replicas
    pods = [p for p in all_pods if p.variant == variant.name]
    ended = [p for p in pods if p.failed and not p.deleting]
    live = [p for p in pods if p.live]
    going = [p for p in pods if not p.live and not p.failed]  # deleting or draining
    current = [p for p in live if p.revision == revision]
    old = [p for p in live if p.revision != revision]

    deletes = [
        DeletePod(
            p.name,
            p.uid,
            variant.name,
            p.revision,
            "Failed",
            f"pod {p.name} ended ({p.phase.value}{': ' + p.message if p.message else ''}); replacing it",
        )
        for p in ended
    ]
    surplus = deletion_order(current, revision)[: max(0, len(current) - desired)]
    budget = sum(p.ready for p in live) - max(0, desired - policy.max_unavailable)
    for pod in deletion_order(old + surplus, revision):
        if pod.ready:
            if budget <= 0:
                continue
            budget -= 1
        if pod.revision != revision:
            reason, why = "Rollout", f"revision {pod.revision} replaced by {revision}"
        else:
            reason, why = "ScaleDown", f"variant {variant.name} scales down to {desired}"
        state = "ready" if pod.ready else "unready"
        deletes.append(DeletePod(pod.name, pod.uid, variant.name, pod.revision, reason, f"{why} ({state} pod)"))

    removed = {d.name for d in deletes}
    remaining = [p for p in live if p.name not in removed]
    old_left = any(p.revision != revision for p in remaining)
    room = desired + (policy.max_surge if old_left else 0) - len(remaining)
    count = max(0, min(desired - len(current), room))
    taken = {p.name for p in pods}
    creates: list[CreatePod] = []
    slot = 0
    while len(creates) < count:
        if pod_name(meta["name"], variant.name, revision, slot) not in taken:
            reason = "Rollout" if old else ("Replace" if ended else "ScaleUp")
            creates.append(
                CreatePod(
                    pod_manifest(meta, template, variant.name, revision, slot),
                    variant.name,
                    revision,
                    reason,
                    f"variant {variant.name} wants {desired} pods of revision {revision}, has {len(current)}",
                )
            )
        slot += 1

    ready = sum(p.ready for p in live)
    progressing = _progress_reason(desired, current, old, going, creates, deletes)
    return _VariantOutcome(
        creates=tuple(creates),
        deletes=tuple(deletes),
        status=VariantStatus(
            name=variant.name,
            replicas=len(live),
            ready_replicas=ready,
            desired_replicas=desired,
            draining_replicas=len(going),
            revisions=_revision_status(revision, desired, live),
        ),
        endpoints=_endpoints(variant, revision, live),
        progressing=progressing,
        stuck=tuple(p.name for p in live if p.stuck),
        failed=tuple(p.name for p in ended),
    )


def _progress_reason(
    desired: int,
    current: list[PodInfo],
    old: list[PodInfo],
    going: list[PodInfo],
    creates: list[CreatePod],
    deletes: list[DeletePod],
) -> str:
    if old:
        return f"replacing {len(old)} pod(s) of an old revision"
    if len(current) + len(creates) < desired or creates:
        return f"scaling up to {desired}"
    if len(current) > desired or any(d.reason == "ScaleDown" for d in deletes):
        return f"scaling down to {desired}"
    starting = sum(not p.ready for p in current)
    if starting:
        return f"{starting} pod(s) starting"
    if going:
        return f"{len(going)} pod(s) terminating"
    return ""


def _revision_status(revision: str, desired: int, live: list[PodInfo]) -> list[RevisionReplicas]:
    revisions = [revision] + sorted({p.revision or "" for p in live} - {revision})
    return [
        RevisionReplicas(
            revision=rev,
            replicas=sum(p.revision == rev for p in live),
            ready_replicas=sum(p.revision == rev and p.ready for p in live),
            desired_replicas=desired if rev == revision else 0,
        )
        for rev in revisions[:MAX_REVISIONS_PER_VARIANT]
    ]


def _endpoints(variant: VariantSpec, revision: str, live: list[PodInfo]) -> tuple[Endpoint, ...]:
    """Routing groups of a variant: one per revision with pods (the current one always), the variant's weight
    split between them by ready pods (x100 so shares stay integers; weights are relative)."""
    revisions = [revision] + sorted({p.revision for p in live if p.revision} - {revision})
    revisions = revisions[:MAX_REVISIONS_PER_VARIANT]
    ready = [sum(p.revision == rev and p.ready for p in live) for rev in revisions]
    if sum(ready) == 0:
        ready = [1] + [0] * (len(revisions) - 1)
    percents = split_by_weight(_PERCENT, ready)
    return tuple(
        Endpoint(
            variant=variant.name,
            revision=rev,
            weight=variant.weight * percent,
            tiers=list(variant.tiers),
            quantization=variant.quantization,
        )
        for rev, percent in zip(revisions, percents, strict=True)
    )


# ------------------------------------------------------------------------------------------------------ status


def _status(
    name: str,
    generation: int | None,
    previous: InferenceDeploymentStatus,
    outcomes: list[_VariantOutcome],
    orphans: tuple[DeletePod, ...],
    observed: Observed,
    now: datetime,
) -> InferenceDeploymentStatus:
    variants = [o.status for o in outcomes]
    desired = sum(v.desired_replicas for v in variants)
    short = [v for v in variants if v.desired_replicas > 0 and v.ready_replicas == 0]
    if desired == 0:
        available = WantedCondition(
            ConditionType.AVAILABLE, ConditionStatus.TRUE, "ScaledToZero", "no pods wanted; requests wake it"
        )
    elif short:
        available = WantedCondition(
            ConditionType.AVAILABLE,
            ConditionStatus.FALSE,
            "MinimumReplicasUnavailable",
            "; ".join(f"variant {v.name} has no ready pod (0/{v.desired_replicas})" for v in short),
        )
    else:
        available = WantedCondition(
            ConditionType.AVAILABLE,
            ConditionStatus.TRUE,
            "MinimumReplicasAvailable",
            ", ".join(f"{v.name} {v.ready_replicas}/{v.desired_replicas} ready" for v in variants),
        )
    moving = [f"{o.status.name}: {o.progressing}" for o in outcomes if o.progressing]
    if orphans:
        moving.append(f"removing {len(orphans)} pod(s) of removed variants")
    progressing = (
        WantedCondition(ConditionType.PROGRESSING, ConditionStatus.TRUE, "ReplicasUpdating", "; ".join(moving))
        if moving
        else WantedCondition(
            ConditionType.PROGRESSING, ConditionStatus.FALSE, "ReplicasUpToDate", "all variants at desired size"
        )
    )
    stuck = [pod for o in outcomes for pod in o.stuck]
    failed = [pod for o in outcomes for pod in o.failed]
    troubles = []
    if observed.errors:
        troubles.append(("ApiError", "API errors: " + "; ".join(observed.errors)))
    if stuck:
        troubles.append(("PodsStuck", "pods that do not start: " + ", ".join(stuck)))
    if failed:
        troubles.append(("PodsFailed", "pods ended and are being replaced: " + ", ".join(failed)))
    degraded = (
        WantedCondition(
            ConditionType.DEGRADED, ConditionStatus.TRUE, troubles[0][0], "; ".join(msg for _, msg in troubles)
        )
        if troubles
        else WantedCondition(ConditionType.DEGRADED, ConditionStatus.FALSE, "Healthy", "")
    )
    valid = WantedCondition(ConditionType.INVALID_SPEC, ConditionStatus.FALSE, "SpecValid", "")
    if desired == 0 and not any(v.replicas for v in variants):
        phase = Phase.SCALED_TO_ZERO
    elif troubles:
        phase = Phase.DEGRADED
    elif available.status != ConditionStatus.TRUE:
        phase = Phase.PENDING
    elif moving:
        phase = Phase.PROGRESSING
    else:
        phase = Phase.AVAILABLE
    endpoints = [e for o in outcomes for e in o.endpoints][:MAX_ENDPOINTS]
    return previous.model_copy(
        update={
            "observed_generation": generation,
            "phase": phase,
            "replicas": sum(v.replicas for v in variants),
            "ready_replicas": sum(v.ready_replicas for v in variants),
            "desired_replicas": desired,
            "label_selector": label_selector(name),
            "conditions": merge_conditions(
                previous.conditions, [available, progressing, degraded, valid], now, generation
            ),
            "variants": variants,
            "endpoints": endpoints,
        }
    )


def _status_patch(previous: InferenceDeploymentStatus, status: InferenceDeploymentStatus) -> dict[str, Any] | None:
    """The owned status fields when any changed (None = nothing to write). Removed fields are sent as null."""
    before, after = dump_status(previous), dump_status(status)
    patch = {key: after.get(key) for key in OWNED_STATUS_FIELDS}
    if all(before.get(key) == patch[key] for key in OWNED_STATUS_FIELDS):
        return None
    return patch


def _previous_status(raw: Any) -> InferenceDeploymentStatus:
    """The status as last written; a status this version cannot read is treated as empty (it is recomputed)."""
    try:
        return parse_status(raw if isinstance(raw, Mapping) else None)
    except ValidationError:
        return InferenceDeploymentStatus()


# ------------------------------------------------------------------------------------------ invalid and deleting


def _invalid(
    meta: Mapping[str, Any], previous: InferenceDeploymentStatus, problems: list[str], now: datetime
) -> Plan:
    generation = meta.get("generation")
    message = "; ".join(problems)
    condition = WantedCondition(ConditionType.INVALID_SPEC, ConditionStatus.TRUE, "ValidationFailed", message)
    keep = [c for c in previous.conditions if c.type != ConditionType.INVALID_SPEC.value]
    status = previous.model_copy(
        update={
            "observed_generation": generation,
            "phase": Phase.INVALID_SPEC,
            "label_selector": label_selector(meta["name"]),
            "conditions": merge_conditions(keep, [condition], now, generation),
        }
    )
    actions: list[Action] = []
    patch = _status_patch(previous, status)
    if patch is not None:
        actions.append(PatchStatus(patch))
    before = find(previous.conditions, ConditionType.INVALID_SPEC)
    if (
        before is None
        or before.status != ConditionStatus.TRUE
        or before.message != condition.message
        or previous.observed_generation != generation
    ):
        actions.append(
            EmitEvent(
                EventType.WARNING,
                "InvalidSpec",
                f"spec generation {generation} is invalid; running pods are left as they are: {message}",
            )
        )
    return Plan(actions=tuple(actions), notes=(f"invalid spec: {message}",))


def _deleting(
    meta: Mapping[str, Any], previous: InferenceDeploymentStatus, pods: Sequence[PodInfo], now: datetime
) -> Plan:
    deletes = tuple(
        DeletePod(p.name, p.uid, p.variant, p.revision, "Deletion", "the InferenceDeployment is being deleted")
        for p in pods
        if not p.deleting
    )
    left = len(pods)
    condition = WantedCondition(
        ConditionType.PROGRESSING,
        ConditionStatus.TRUE,
        "Terminating",
        f"removing {left} pod(s) before the InferenceDeployment goes",
    )
    keep = [c for c in previous.conditions if c.type != ConditionType.PROGRESSING.value]
    status = previous.model_copy(
        update={
            "phase": Phase.TERMINATING,
            "conditions": merge_conditions(keep, [condition], now, meta.get("generation")),
        }
    )
    actions: list[Action] = list(deletes)
    if left:
        patch = _status_patch(previous, status)
        if patch is not None:
            actions.append(PatchStatus(patch))
    if previous.phase != Phase.TERMINATING and left:
        actions.append(EmitEvent(EventType.NORMAL, "Terminating", f"removing {left} pod(s) before deletion"))
    return Plan(actions=tuple(actions), finished=left == 0, notes=(f"deleting: {left} pod(s) left",))

