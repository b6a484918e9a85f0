"""The planner: `reconcile(resource, observed, now) -> Plan`. Pure: no API calls, no clock, no randomness.

One pass looks at the InferenceDeployment (a dict as the API returns it) and what was observed of its pods, and
returns the actions that move the cluster one safe step towards the spec, plus the status that describes where
it stands. Run it again after the actions land and it asks for the next step; run it twice on the same input
and it asks for the same thing (actions are idempotent: deterministic pod names, uid-guarded deletes).

Rules, per variant (sizes from `controllers.sizing`, revisions and canary steps from `controllers.rollout`):
- The rollout machine decides which revisions the variant runs (the stable one, and during a canary the canary
  beside it, each with its pod count and traffic share); pods of any other revision are old.
- Ended pods (Failed/Succeeded) are deleted and replaced.
- Pods to remove are the old-revision pods and the surplus beyond each wanted revision's count; they go in
  `controllers.ordering` order. An unready pod may always go (it serves nothing); a ready one only while the
  variant keeps at least `wanted - policy.max_unavailable` ready pods. Removal means draining
  (`controllers.draining`): a serving pod is marked and drained, then deleted; one serving nothing is deleted.
- New pods are created up to each wanted count; while old-revision (or surplus) pods remain, the variant may
  hold up to `wanted + policy.max_surge` pods (draining and terminating ones included), so a revision change
  replaces pods without dropping capacity or holding more than `max_surge` extra pods' worth of resources.
- Pods of variants no longer in the spec are removed (drained); pods labelled for the deployment but controlled
  by another owner are left alone. Each variant has a PodDisruptionBudget (`controllers.pods.pdb_manifest`);
  the deployment has a NetworkPolicy admitting only the configured peers to its workers (`controllers.network`,
  unless the policy turns it off), and its pods carry the drain token derived from the operator's key
  (`controllers.drain_token`; in the pod's identity, so never in a revision).
LoRA adapters (`spec.adapters`) are loaded into and unloaded from the running pods that serve adapters, with
their per-pod readiness in `status.adapters` and the `AdaptersReady` condition (`controllers.adapters`).
An invalid spec is reported (InvalidSpec condition, Warning Event) and the last valid one, kept in
`status.lastValidSpec`, goes on running (`controllers.running_spec`): failed pods are replaced, autoscaled sizes
and a running canary go on. A deployment that was never valid changes nothing (drains under way finish). A
deployment being deleted has all its pods drained and deleted; the plan is `finished` once none is left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from controllers import draining, rollout
from controllers.actions import (
    Action,
    CreatePod,
    DeletePdb,
    DeletePod,
    EmitEvent,
    EnsureNetworkPolicy,
    EnsurePdb,
    EnsureService,
    EventType,
    PatchStatus,
    Plan,
    RemoveAnnotations,
    StartDrain,
)
from controllers.adapters import AdapterInput, AdapterPlan, may_serve_adapters, plan_adapters
from controllers.conditions import (
    Health,
    WantedCondition,
    find,
    kstatus_conditions,
    merge_conditions,
)
from controllers.drain_token import deployment_drain_token
from controllers.network import (
    NetworkPolicySettings,
    network_policy_manifest,
    network_policy_matches,
)
from controllers.observed import Observed, PodInfo
from controllers.ordering import deletion_order
from controllers.pods import (
    PodDefaults,
    label_selector,
    pdb_manifest,
    pdb_matches,
    pdb_name,
    pod_manifest,
    pod_name,
    service_manifest,
    service_matches,
)
from controllers.reasons import Reason
from controllers.running_spec import DeploymentView, RunningSpec
from controllers.sizing import (
    VariantSize,
    desired_sizes,
    shares_spec_replicas,
    split_by_weight,
)
from crds.helpers import dump_status
from crds.models import (
    ConditionStatus,
    ConditionType,
    DrainReason,
    DrainSpec,
    DrainStatus,
    Endpoint,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    Phase,
    RevisionReplicas,
    RolloutPhase,
    RolloutStatus,
    VariantSpec,
    VariantStatus,
)

# Status fields this controller writes; the rest (autoscaling) belong to other controllers.
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
    "rollout",
    "drains",
    "lastValidSpec",
    "adapters",
)
MAX_REVISIONS_PER_VARIANT = 8
MAX_ENDPOINTS = 64
MAX_DRAINS = 256
_PERCENT = 100


@dataclass(frozen=True)
class Policy:
    """Operator-wide planning limits (from the operator's settings)."""

    max_surge: int = 1  # extra pods a variant may have while it replaces old-revision pods
    max_unavailable: int = 0  # ready pods a variant may lose at once below its desired size
    defaults: PodDefaults = field(default_factory=PodDefaults)
    network: NetworkPolicySettings = field(default_factory=NetworkPolicySettings)
    # The operator's key for drain tokens (`controllers.drain_token`); None: pods get no token (POST /drain off).
    drain_key: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _VariantOutcome:
    creates: tuple[CreatePod, ...]
    removals: tuple[Action, ...]  # DeletePod (serves nothing) or StartDrain (may serve)
    status: VariantStatus
    endpoints: tuple[Endpoint, ...]
    progressing: str  # why it is still moving, "" when settled
    stuck: tuple[str, ...]  # names of pods that will not get ready by themselves
    failed: tuple[str, ...]  # names of ended pods being replaced
    reconciling: Reason | None = None  # the step under way (None when settled)


def reconcile(
    resource: Mapping[str, Any] | DeploymentView, observed: Observed, now: datetime, policy: Policy = Policy()
) -> Plan:
    """Plan the next step for one InferenceDeployment (see the module docstring for the rules). `resource` is the
    object as the API returns it, or the pass's `DeploymentView` of it (read once, shared with the analysis)."""
    view = DeploymentView.of(resource)
    meta, previous = view.meta, view.status
    own = tuple(pod for pod in observed.pods if pod.owner_uid == meta.get("uid"))
    if view.deleting:
        return _deleting(meta, view.raw_spec, previous, own, observed, now, policy)
    running = view.running
    if running.spec is None:
        return _invalid(meta, view.raw_spec, previous, list(running.problems), own, observed, now, policy)
    return _converge(meta, running, previous, own, observed, now, policy)


# ---------------------------------------------------------------------------------------------------- converge


def _converge(
    meta: Mapping[str, Any],
    running: RunningSpec,
    previous: InferenceDeploymentStatus,
    pods: Sequence[PodInfo],
    observed: Observed,
    now: datetime,
    policy: Policy,
) -> Plan:
    spec = running.spec
    assert spec is not None
    name = meta["name"]
    generation = meta.get("generation")
    sizes = desired_sizes(spec, previous.autoscaling)
    desired = {variant: size.replicas for variant, size in sizes.items()}
    timeout, port = spec.drain.timeout_seconds, policy.defaults.port
    actions: list[Action] = []
    events: list[EmitEvent] = []
    if policy.network.enabled:
        network = network_policy_manifest(meta, policy.network, policy.defaults.port)
        if observed.network_policy is None or not network_policy_matches(observed.network_policy, network):
            actions.append(EnsureNetworkPolicy(network))
    service = service_manifest(meta, policy.defaults)
    if observed.service is None or not service_matches(observed.service, service):
        actions.append(EnsureService(service))
    actions += _pdb_actions(meta, spec, observed)

    decision, revisions = _rollout(meta, spec, previous.rollout, pods, desired, observed, now, policy)
    plans = rollout.variant_rollouts(decision.status, revisions, desired)
    progress = draining.advance(pods, observed.drain_probes, now, timeout_s=timeout, port=port)
    adapters = _adapters(spec, decision.status, revisions, previous, pods, observed, now, port)
    outcomes = [
        _plan_variant(meta, variant, sizes[variant.name], plans[variant.name], pods, policy, now, timeout)
        for variant in spec.variants
    ]
    names = {variant.name for variant in spec.variants}
    orphans = tuple(
        draining.remove(
            p, DrainReason.SCALE_DOWN, f"variant {p.variant!r} is no longer in the spec", now, timeout, port
        )
        for p in pods
        if p.variant not in names and not p.deleting and not p.draining
    )
    actions += progress.actions
    actions += adapters.unloads + adapters.loads
    for outcome in outcomes:
        actions += outcome.removals
    actions += orphans
    for outcome in outcomes:
        actions += outcome.creates
    if decision.remove_annotations:
        actions.append(RemoveAnnotations(decision.remove_annotations))

    old_sizes = {v.name: v.desired_replicas for v in previous.variants}
    for outcome in outcomes:
        size = sizes[outcome.status.name]
        before = old_sizes.get(size.variant)
        if before != size.replicas:
            events.append(
                EmitEvent(
                    EventType.NORMAL,
                    Reason.SCALED,
                    f"variant {size.variant}: desired pods {before or 0} -> {size.replicas} ({size.describe()})",
                )
            )
    if previous.observed_generation != generation and spec.replicas is not None and not shares_spec_replicas(spec):
        events.append(
            EmitEvent(
                EventType.WARNING,
                Reason.REPLICAS_IGNORED,
                f"spec.replicas={spec.replicas} sizes no variant: every variant sets its own replicas or "
                "autoscaling (kubectl scale has no effect)",
            )
        )
    invalid_before = find(previous.conditions, ConditionType.INVALID_SPEC)
    was_invalid = invalid_before is not None and invalid_before.status == ConditionStatus.TRUE
    if running.fallback:
        if _invalid_news(previous, generation, _invalid_message(running.problems)):
            events.append(_invalid_event(generation, running.problems, "the last valid spec keeps running"))
    elif was_invalid:
        events.append(EmitEvent(EventType.NORMAL, Reason.SPEC_VALID, "the spec is valid again; reconciling it"))
    events += decision.events
    events += adapters.events

    starts = [a for a in actions if isinstance(a, StartDrain) and a.mark]
    drains = _drains(progress.drains, starts)
    rejected = any(plan.muted for plan in plans.values())  # the spec asks for a rolled-back revision
    status = _status(
        name, generation, previous, outcomes, orphans, observed, now, decision.status, drains, running, rejected
    )
    status = _with_adapters(status, adapters, now, generation)
    patch = _status_patch(previous, status)
    if patch is not None:
        actions.append(PatchStatus(patch))
    notes = tuple(
        f"{o.status.name}: {o.status.ready_replicas}/{o.status.desired_replicas} ready"
        + (f", {o.progressing}" if o.progressing else "")
        for o in outcomes
    )
    if decision.status.phase != RolloutPhase.STABLE:
        notes += (f"rollout {decision.status.phase.value}: {decision.status.message}",)
    waits = [w for w in (progress.requeue_after, decision.requeue_after, adapters.requeue_after) if w is not None]
    return Plan(actions=tuple(actions) + tuple(events), requeue_after=min(waits) if waits else None, notes=notes)


def _rollout(
    meta: Mapping[str, Any],
    spec: InferenceDeploymentSpec,
    previous: RolloutStatus,
    pods: Sequence[PodInfo],
    desired: Mapping[str, int],
    observed: Observed,
    now: datetime,
    policy: Policy,
) -> tuple[rollout.RolloutDecision, dict[str, rollout.VariantRevisions]]:
    """Run the rollout machine; return its decision and the revisions under the stable snapshot it leaves."""
    name = meta["name"]
    stable = rollout.stable_spec_of(spec, previous.stable_spec)
    revisions = rollout.variant_revisions(name, spec, stable, policy.defaults)
    decision = rollout.advance(
        rollout.RolloutInput(
            canary=spec.rollout.canary if spec.rollout is not None else None,
            previous=previous,
            revisions=revisions,
            snapshot=rollout.pod_snapshot(spec),
            pods=pods,
            desired=desired,
            annotations=meta.get("annotations") or {},
            analysis=observed.analysis,
            now=now,
            canary_metrics_since=observed.canary_metrics_since,
        )
    )
    if decision.status.stable_spec != previous.stable_spec:
        stable = rollout.stable_spec_of(spec, decision.status.stable_spec)
        revisions = rollout.variant_revisions(name, spec, stable, policy.defaults)
    return decision, revisions


def _adapters(
    spec: InferenceDeploymentSpec,
    rollout_status: RolloutStatus,
    revisions: Mapping[str, rollout.VariantRevisions],
    previous: InferenceDeploymentStatus,
    pods: Sequence[PodInfo],
    observed: Observed,
    now: datetime,
    port: int,
) -> AdapterPlan:
    """Adapter loads and unloads for the pods that serve adapters: live, ready, reachable, of a revision whose spec
    turns LoRA on (during a rollout that turns it on, only the canary's pods)."""
    stable = rollout.stable_spec_of(spec, rollout_status.stable_spec)
    lora_revisions = {r.target for r in revisions.values() if spec.engine.lora is not None}
    lora_revisions |= {r.stable for r in revisions.values() if stable.engine.lora is not None}
    eligible = [p for p in pods if may_serve_adapters(p) and p.revision in lora_revisions]
    return plan_adapters(
        AdapterInput(
            adapters=spec.adapters,
            lora=spec.engine.lora is not None,
            eligible=eligible,
            addresses={p.name: draining.address(p, port) or "" for p in eligible},
            previous=previous.adapters,
            now=now,
            probes=observed.adapter_probes,
            results=observed.adapter_results,
        )
    )


def _with_adapters(
    status: InferenceDeploymentStatus, adapters: AdapterPlan, now: datetime, generation: int | None
) -> InferenceDeploymentStatus:
    """The status with `adapters` and the AdaptersReady condition (dropped when the deployment serves none)."""
    kept = [c for c in status.conditions if c.type != ConditionType.ADAPTERS_READY]
    previous = [c for c in status.conditions if c.type == ConditionType.ADAPTERS_READY]
    wanted = [adapters.condition] if adapters.condition is not None else []
    conditions = kept + merge_conditions(previous, wanted, now, generation)
    return status.model_copy(update={"adapters": list(adapters.status), "conditions": conditions})


def _pdb_actions(meta: Mapping[str, Any], spec: InferenceDeploymentSpec, observed: Observed) -> list[Action]:
    """A PodDisruptionBudget per variant; budgets of removed variants (ones this deployment controls) go."""
    actions: list[Action] = []
    wanted = {pdb_name(meta["name"], v.name): pdb_manifest(meta, v.name) for v in spec.variants}
    for name, manifest in wanted.items():
        have = observed.pdbs.get(name)
        if have is None or not pdb_matches(have, manifest):
            actions.append(EnsurePdb(manifest))
    for name, have in sorted(observed.pdbs.items()):
        owners = (have.get("metadata") or {}).get("ownerReferences") or []
        ours = any(ref.get("controller") and ref.get("uid") == meta.get("uid") for ref in owners)
        if name not in wanted and ours:
            actions.append(DeletePdb(name))
    return actions


def _drains(progress: Sequence[DrainStatus], starts: Sequence[StartDrain]) -> list[DrainStatus]:
    """status.drains: the drains going on plus the ones starting now (bounded)."""
    known = {entry.pod for entry in progress}
    fresh = [draining.status_of(start) for start in starts if start.name not in known]
    return sorted([*progress, *fresh], key=lambda entry: entry.started_at)[:MAX_DRAINS]


@dataclass(frozen=True)
class _VariantPods:
    """One variant's pods by what they are to the plan."""

    all: list[PodInfo]  # every pod of the variant
    ended: list[PodInfo]  # Failed/Succeeded, not yet going: to replace
    live: list[PodInfo]  # count towards the size
    going: list[PodInfo]  # deleting or draining
    old: list[PodInfo]  # live pods of a revision the variant should no longer run

    @classmethod
    def of(cls, variant: str, pods: Sequence[PodInfo], wanted: Mapping[str, Any]) -> _VariantPods:
        mine = [p for p in pods if p.variant == variant]
        live = [p for p in mine if p.live]
        return cls(
            all=mine,
            ended=[p for p in mine if p.failed and not p.deleting and not p.draining],
            live=live,
            going=[p for p in mine if not p.live and not p.failed],
            old=[p for p in live if p.revision not in wanted],
        )


def _plan_variant(
    meta: Mapping[str, Any],
    variant: VariantSpec,
    size: VariantSize,
    plan: rollout.VariantRollout,
    all_pods: Sequence[PodInfo],
    policy: Policy,
    now: datetime,
    timeout: int,
) -> _VariantOutcome:
    """One variant's step: replace ended pods, drain old and surplus ones within the availability budget, create
    the missing ones within the surge room, and report its status and routing groups."""
    wanted = {w.revision: w for w in plan.wanted}
    total = sum(w.replicas for w in plan.wanted)
    pods = _VariantPods.of(variant.name, all_pods, wanted)
    removals: list[Action] = [*_replace_ended(variant, pods.ended)]
    removals += _drain_old_and_surplus(variant, plan, pods, policy, now, timeout)
    removed = {getattr(action, "name", None) for action in removals}
    room = _room(plan, pods, removed, policy)
    creates = _create_missing(meta, variant, plan, pods, room, policy)

    ready = sum(p.ready for p in pods.live)
    current = [p for p in pods.live if p.revision in wanted]
    reconciling, progressing = _progress_reason(total, current, pods.old, pods.going, creates, removals)
    return _VariantOutcome(
        creates=tuple(creates),
        removals=tuple(removals),
        status=VariantStatus(
            name=variant.name,
            replicas=len(pods.live),
            ready_replicas=ready,
            desired_replicas=size.replicas,
            draining_replicas=len(pods.going),
            revisions=_revision_status(plan, pods.live),
        ),
        endpoints=_endpoints(variant, plan, pods.live),
        progressing=progressing,
        stuck=tuple(p.name for p in pods.live if p.stuck),
        failed=tuple(p.name for p in pods.ended),
        reconciling=reconciling,
    )


def _replace_ended(variant: VariantSpec, ended: Sequence[PodInfo]) -> list[DeletePod]:
    """Ended pods serve nothing: delete them (their replacements are created like any missing pod)."""
    return [
        DeletePod(
            p.name,
            p.uid,
            variant.name,
            p.revision,
            Reason.FAILED,
            f"pod {p.name} ended ({p.phase.value}{': ' + p.message if p.message else ''}); replacing it",
        )
        for p in ended
    ]


def _drain_old_and_surplus(
    variant: VariantSpec,
    plan: rollout.VariantRollout,
    pods: _VariantPods,
    policy: Policy,
    now: datetime,
    timeout: int,
) -> list[Action]:
    """Remove old-revision pods and each wanted revision's surplus, in deletion order, while the variant keeps
    at least `wanted - max_unavailable` ready pods (a ready pod removed spends one of the budget)."""
    wanted = {w.revision: w for w in plan.wanted}
    total = sum(w.replicas for w in plan.wanted)
    surplus: list[PodInfo] = []
    for want in plan.wanted:
        mine = [p for p in pods.live if p.revision == want.revision]
        surplus += deletion_order(mine, want.revision)[: max(0, len(mine) - want.replicas)]
    budget = sum(p.ready for p in pods.live) - max(0, total - policy.max_unavailable)
    removals: list[Action] = []
    for pod in deletion_order(pods.old + surplus, wanted.keys()):
        if pod.ready:
            if budget <= 0:
                continue
            budget -= 1
        if pod.revision not in wanted:
            reason, why = DrainReason.ROLLOUT, f"revision {pod.revision} replaced by {plan.primary.revision}"
        else:
            count = wanted[pod.revision].replicas
            reason = DrainReason.SCALE_DOWN
            why = f"variant {variant.name} revision {pod.revision} scales down to {count}"
        removals.append(draining.remove(pod, reason, why, now, timeout, policy.defaults.port))
    return removals


def _room(plan: rollout.VariantRollout, pods: _VariantPods, removed: set[str | None], policy: Policy) -> int:
    """How many pods may be created now: up to the wanted count of live pods always; beyond it, while pods are
    kept only for availability (old revisions, or more of a wanted revision than it should have: a canary step
    moves pods from stable to canary), `max_surge` more, counting pods still draining or terminating (they hold
    their node's resources, GPUs included, until they are gone)."""
    total = sum(w.replicas for w in plan.wanted)
    wanted = {w.revision for w in plan.wanted}
    remaining = [p for p in pods.live if p.name not in removed]
    excess = any(p.revision not in wanted for p in remaining) or any(
        sum(p.revision == w.revision for p in remaining) > w.replicas for w in plan.wanted
    )
    leaving = len(pods.going) + sum(p.name in removed for p in pods.live)
    return total - len(remaining) + (max(0, policy.max_surge - leaving) if excess else 0)


def _create_missing(
    meta: Mapping[str, Any],
    variant: VariantSpec,
    plan: rollout.VariantRollout,
    pods: _VariantPods,
    room: int,
    policy: Policy,
) -> list[CreatePod]:
    """Create each wanted revision's missing pods, in wanted order, within `room`, in the lowest free slots."""
    taken = {p.name for p in pods.all}
    creates: list[CreatePod] = []
    for want in plan.wanted:
        have = sum(p.revision == want.revision for p in pods.live)
        count = max(0, min(want.replicas - have, room))
        room -= count
        made, slot = 0, 0
        while made < count:
            if pod_name(meta["name"], variant.name, want.revision, slot) not in taken:
                if want.canary:
                    reason = Reason.CANARY
                else:
                    reason = Reason.ROLLOUT if pods.old else (Reason.REPLACE if pods.ended else Reason.SCALE_UP)
                creates.append(
                    CreatePod(
                        pod_manifest(
                            meta,
                            want.template,
                            variant.name,
                            want.revision,
                            slot,
                            drain_token=deployment_drain_token(policy.drain_key, meta),
                        ),
                        variant.name,
                        want.revision,
                        reason,
                        f"variant {variant.name} wants {want.replicas} pods of revision {want.revision}, has {have}",
                    )
                )
                made += 1
            slot += 1
    return creates


def _progress_reason(
    desired: int,
    current: list[PodInfo],
    old: list[PodInfo],
    going: list[PodInfo],
    creates: list[CreatePod],
    removals: list[Action],
) -> tuple[Reason | None, str]:
    if old:
        return Reason.ROLLING_UPDATE, f"replacing {len(old)} pod(s) of an old revision"
    if len(current) + len(creates) < desired or creates:
        return Reason.SCALING_UP, f"scaling up to {desired}"
    if len(current) > desired or any(getattr(r, "reason", "") == Reason.SCALE_DOWN for r in removals):
        return Reason.SCALING_DOWN, f"scaling down to {desired}"
    starting = sum(not p.ready for p in current)
    if starting:
        return Reason.PODS_STARTING, f"{starting} pod(s) starting"
    if going:
        return Reason.DRAINING, f"{len(going)} pod(s) draining or terminating"
    return None, ""


def _revision_status(plan: rollout.VariantRollout, live: list[PodInfo]) -> list[RevisionReplicas]:
    counts = {w.revision: w.replicas for w in plan.wanted}
    revisions = list(counts) + sorted({p.revision or "" for p in live} - set(counts))
    return [
        RevisionReplicas(
            revision=rev,
            replicas=sum(p.revision == rev for p in live),
            ready_replicas=sum(p.revision == rev and p.ready for p in live),
            desired_replicas=counts.get(rev, 0),
        )
        for rev in revisions[:MAX_REVISIONS_PER_VARIANT]
    ]


def _endpoints(variant: VariantSpec, plan: rollout.VariantRollout, live: list[PodInfo]) -> tuple[Endpoint, ...]:
    """Routing groups of a variant: one per revision with pods (the wanted ones always), weights x100 so shares
    stay integers (weights are relative). During a canary the stable and canary revisions get their step's
    percentages and any other revision none; otherwise the variant's weight is split between its revisions by
    ready pods, except rejected (muted) revisions, which get none."""
    wanted = [w.revision for w in plan.wanted]
    revisions = wanted + sorted({p.revision for p in live if p.revision} - set(wanted))
    revisions = revisions[:MAX_REVISIONS_PER_VARIANT]
    split = {w.revision: w.weight for w in plan.wanted if w.weight is not None}
    if split:
        percents = [split.get(rev, 0) for rev in revisions]
    else:
        ready = [0 if rev in plan.muted else sum(p.revision == rev and p.ready for p in live) for rev in revisions]
        if sum(ready) == 0:
            ready = [1] + [0] * (len(revisions) - 1)
        percents = split_by_weight(_PERCENT, ready)
    canaries = {w.revision for w in plan.wanted if w.canary}
    quantization = {w.revision: w.quantization for w in plan.wanted}
    return tuple(
        Endpoint(
            variant=variant.name,
            revision=rev,
            weight=variant.weight * percent,
            tiers=list(variant.tiers),
            quantization=quantization.get(rev, variant.quantization),
            canary=rev in canaries,
        )
        for rev, percent in zip(revisions, percents, strict=True)
    )


# ------------------------------------------------------------------------------------------------------ status


def _status(
    name: str,
    generation: int | None,
    previous: InferenceDeploymentStatus,
    outcomes: list[_VariantOutcome],
    orphans: tuple[Action, ...],
    observed: Observed,
    now: datetime,
    rollout_status: RolloutStatus,
    drains: list[DrainStatus],
    running: RunningSpec,
    rejected: bool,
) -> InferenceDeploymentStatus:
    variants = [o.status for o in outcomes]
    desired = sum(v.desired_replicas for v in variants)
    short = [v for v in variants if v.desired_replicas > 0 and v.ready_replicas == 0]
    if desired == 0:
        available = WantedCondition(
            ConditionType.AVAILABLE, ConditionStatus.TRUE, Reason.SCALED_TO_ZERO, "no pods wanted; requests wake it"
        )
    elif short:
        available = WantedCondition(
            ConditionType.AVAILABLE,
            ConditionStatus.FALSE,
            Reason.MINIMUM_REPLICAS_UNAVAILABLE,
            "; ".join(f"variant {v.name} has no ready pod (0/{v.desired_replicas})" for v in short),
        )
    else:
        available = WantedCondition(
            ConditionType.AVAILABLE,
            ConditionStatus.TRUE,
            Reason.MINIMUM_REPLICAS_AVAILABLE,
            ", ".join(f"{v.name} {v.ready_replicas}/{v.desired_replicas} ready" for v in variants),
        )
    moving = [f"{o.status.name}: {o.progressing}" for o in outcomes if o.progressing]
    if orphans:
        moving.append(f"removing {len(orphans)} pod(s) of removed variants")
    progressing = _progressing_condition(rollout_status, moving)
    stuck = [pod for o in outcomes for pod in o.stuck]
    failed = [pod for o in outcomes for pod in o.failed]
    troubles = []
    if observed.errors:
        troubles.append((Reason.API_ERROR, "API errors: " + "; ".join(observed.errors)))
    if stuck:
        troubles.append((Reason.PODS_STUCK, "pods that do not start: " + ", ".join(stuck)))
    if failed:
        troubles.append((Reason.PODS_FAILED, "pods ended and are being replaced: " + ", ".join(failed)))
    degraded = (
        WantedCondition(
            ConditionType.DEGRADED, ConditionStatus.TRUE, troubles[0][0], "; ".join(msg for _, msg in troubles)
        )
        if troubles
        else WantedCondition(ConditionType.DEGRADED, ConditionStatus.FALSE, Reason.HEALTHY, "")
    )
    if running.fallback:
        valid = WantedCondition(
            ConditionType.INVALID_SPEC,
            ConditionStatus.TRUE,
            Reason.VALIDATION_FAILED,
            _invalid_message(running.problems) + "; the last valid spec keeps running",
        )
    else:
        valid = WantedCondition(ConditionType.INVALID_SPEC, ConditionStatus.FALSE, Reason.SPEC_VALID, "")
    if running.fallback:
        phase = Phase.INVALID_SPEC
    elif desired == 0 and not any(v.replicas for v in variants):
        phase = Phase.SCALED_TO_ZERO
    elif troubles:
        phase = Phase.DEGRADED
    elif available.status != ConditionStatus.TRUE:
        phase = Phase.PENDING
    elif progressing.status == ConditionStatus.TRUE:
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
                previous.conditions,
                [
                    available,
                    progressing,
                    degraded,
                    valid,
                    *kstatus_conditions(_health(running, rollout_status, rejected, outcomes, orphans, observed)),
                ],
                now,
                generation,
            ),
            "variants": variants,
            "endpoints": endpoints,
            "rollout": rollout_status,
            "drains": drains,
            "last_valid_spec": dict(running.raw) if running.raw is not None else previous.last_valid_spec,
        }
    )


# Reconciling=True reasons while the rollout machine is moving (the spec's revision is not rejected).
_ROLLOUT_STEPS = {
    RolloutPhase.PROGRESSING: Reason.CANARY_PROGRESSING,
    RolloutPhase.PROMOTING: Reason.PROMOTING,
    RolloutPhase.ROLLING_BACK: Reason.ROLLING_BACK,
}


def _health(
    running: RunningSpec,
    rollout_status: RolloutStatus,
    rejected: bool,
    outcomes: list[_VariantOutcome],
    orphans: tuple[Action, ...],
    observed: Observed,
) -> Health:
    """What the kstatus conditions (Ready/Reconciling/Stalled) are made of (`controllers.conditions`)."""
    stalled: list[tuple[Reason, str]] = []
    if running.fallback:
        stalled.append(
            (
                Reason.INVALID_SPEC,
                _invalid_message(running.problems) + "; the last valid spec keeps running: fix the spec",
            )
        )
    if rejected:
        fix = (
            f"to go on, change the spec (or revert it to the stable revision {rollout_status.stable_revision}), "
            f"or annotate {rollout.PROMOTE}=true to promote the rejected revision"
        )
        stalled.append((Reason.CANARY_ROLLED_BACK, f"{rollout_status.message}; {fix}"))
    stuck = [pod for o in outcomes for pod in o.stuck]
    if stuck:
        stalled.append(
            (
                Reason.PODS_CANNOT_START,
                "pods that cannot start (crash loop, image or config "
                "error): " + ", ".join(stuck) + "; fix the image, the engine flags or the resources",
            )
        )
    moving: list[tuple[Reason, str]] = []
    if rollout_status.phase in _ROLLOUT_STEPS and not rejected:
        moving.append((_ROLLOUT_STEPS[rollout_status.phase], rollout_status.message))
    moving += [(o.reconciling, f"{o.status.name}: {o.progressing}") for o in outcomes if o.reconciling is not None]
    if orphans:
        moving.append((Reason.REMOVING_VARIANT, f"removing {len(orphans)} pod(s) of removed variants"))
    variants = [o.status for o in outcomes]
    return Health(
        stalled=stalled,
        moving=moving,
        serving=all(v.ready_replicas >= v.desired_replicas for v in variants),
        scaled_to_zero=not any(v.desired_replicas for v in variants),
        trouble=(Reason.API_ERROR, "API errors: " + "; ".join(observed.errors)) if observed.errors else None,
        summary=", ".join(f"{v.name} {v.ready_replicas}/{v.desired_replicas} ready" for v in variants),
    )


# Progressing=True reasons while the rollout machine is moving.
_ROLLOUT_REASONS = {
    RolloutPhase.PROGRESSING: Reason.CANARY_PROGRESSING,
    RolloutPhase.PROMOTING: Reason.PROMOTING,
    RolloutPhase.ROLLING_BACK: Reason.CANARY_ROLLING_BACK,
}


def _progressing_condition(rollout_status: RolloutStatus, moving: list[str]) -> WantedCondition:
    """Progressing: True while pods move or a rollout is under way; False with `CanaryRolledBack` when the spec's
    revision was rejected (the spec is not what runs, and nothing will change until it does)."""
    phase = rollout_status.phase
    if phase in _ROLLOUT_REASONS:
        message = "; ".join([rollout_status.message, *moving]) if rollout_status.message else "; ".join(moving)
        return WantedCondition(ConditionType.PROGRESSING, ConditionStatus.TRUE, _ROLLOUT_REASONS[phase], message)
    if moving:
        return WantedCondition(
            ConditionType.PROGRESSING, ConditionStatus.TRUE, Reason.REPLICAS_UPDATING, "; ".join(moving)
        )
    if phase == RolloutPhase.ROLLED_BACK:
        return WantedCondition(
            ConditionType.PROGRESSING, ConditionStatus.FALSE, Reason.CANARY_ROLLED_BACK, rollout_status.message
        )
    return WantedCondition(
        ConditionType.PROGRESSING, ConditionStatus.FALSE, Reason.REPLICAS_UP_TO_DATE, "all variants at desired size"
    )


def _status_patch(previous: InferenceDeploymentStatus, status: InferenceDeploymentStatus) -> dict[str, Any] | None:
    """The owned status fields when any changed (None = nothing to write), as a JSON merge patch: removed
    fields, at any depth of an object, are sent as null (lists are replaced whole)."""
    before, after = dump_status(previous), dump_status(status)
    if all(before.get(key) == after.get(key) for key in OWNED_STATUS_FIELDS):
        return None
    return {key: _replacing(before.get(key), after.get(key)) for key in OWNED_STATUS_FIELDS}


def _replacing(before: Any, after: Any) -> Any:
    """`after` as a merge-patch value that turns `before` into `after`."""
    if isinstance(before, dict) and isinstance(after, dict):
        patch = {key: _replacing(before.get(key), value) for key, value in after.items()}
        patch.update({key: None for key in before if key not in after})
        return patch
    return after


def _drain_timeout(raw_spec: Any) -> int:
    """drain.timeoutSeconds of a spec that may not parse (invalid, or being deleted): the default if unreadable."""
    drain = raw_spec.get("drain") if isinstance(raw_spec, Mapping) else None
    try:
        return DrainSpec.model_validate(drain or {}).timeout_seconds
    except ValidationError:
        return DrainSpec().timeout_seconds


# ------------------------------------------------------------------------------------------ invalid and deleting


def _invalid(
    meta: Mapping[str, Any],
    raw_spec: Any,
    previous: InferenceDeploymentStatus,
    problems: list[str],
    pods: Sequence[PodInfo],
    observed: Observed,
    now: datetime,
    policy: Policy,
) -> Plan:
    generation = meta.get("generation")
    message = _invalid_message(problems)
    condition = WantedCondition(ConditionType.INVALID_SPEC, ConditionStatus.TRUE, Reason.VALIDATION_FAILED, message)
    health = Health(stalled=[(Reason.INVALID_SPEC, message + "; nothing runs until the spec is fixed")])
    wanted = [condition, *kstatus_conditions(health)]
    # Drains already under way finish (their workers refuse new requests); nothing else changes.
    progress = draining.advance(
        pods, observed.drain_probes, now, timeout_s=_drain_timeout(raw_spec), port=policy.defaults.port
    )
    starts = [a for a in progress.actions if isinstance(a, StartDrain) and a.mark]
    status = previous.model_copy(
        update={
            "observed_generation": generation,
            "phase": Phase.INVALID_SPEC,
            "label_selector": label_selector(meta["name"]),
            "conditions": merge_conditions(previous.conditions, wanted, now, generation),
            "drains": _drains(progress.drains, starts),
        }
    )
    actions: list[Action] = list(progress.actions)
    patch = _status_patch(previous, status)
    if patch is not None:
        actions.append(PatchStatus(patch))
    if _invalid_news(previous, generation, message):
        actions.append(_invalid_event(generation, problems, "running pods are left as they are"))
    return Plan(actions=tuple(actions), requeue_after=progress.requeue_after, notes=(f"invalid spec: {message}",))


def _invalid_message(problems: Sequence[str]) -> str:
    return "; ".join(problems)


def _invalid_news(previous: InferenceDeploymentStatus, generation: int | None, message: str) -> bool:
    """The invalid spec is not reported yet: a new generation, or other problems than the condition holds."""
    before = find(previous.conditions, ConditionType.INVALID_SPEC)
    return (
        before is None
        or before.status != ConditionStatus.TRUE
        or not before.message.startswith(message)
        or previous.observed_generation != generation
    )


def _invalid_event(generation: int | None, problems: Sequence[str], consequence: str) -> EmitEvent:
    return EmitEvent(
        EventType.WARNING,
        Reason.INVALID_SPEC,
        f"spec generation {generation} is invalid; {consequence}: {_invalid_message(problems)}",
    )


def _deleting(
    meta: Mapping[str, Any],
    raw_spec: Any,
    previous: InferenceDeploymentStatus,
    pods: Sequence[PodInfo],
    observed: Observed,
    now: datetime,
    policy: Policy,
) -> Plan:
    timeout, port = _drain_timeout(raw_spec), policy.defaults.port
    progress = draining.advance(pods, observed.drain_probes, now, timeout_s=timeout, port=port)
    why = "the InferenceDeployment is being deleted"
    removals: list[Action] = [draining.remove(p, DrainReason.DELETION, why, now, timeout, port) for p in pods if p.live]
    removals += [
        DeletePod(p.name, p.uid, p.variant, p.revision, Reason.DELETION, f"{why} (ended pod)")
        for p in pods
        if p.failed and not p.deleting and not p.draining
    ]
    left = len(pods)
    condition = WantedCondition(
        ConditionType.PROGRESSING,
        ConditionStatus.TRUE,
        Reason.TERMINATING,
        f"removing {left} pod(s) before the InferenceDeployment goes",
    )
    terminating = [condition, *kstatus_conditions(Health(moving=[(Reason.TERMINATING, condition.message)]))]
    starts = [a for a in (*progress.actions, *removals) if isinstance(a, StartDrain) and a.mark]
    status = previous.model_copy(
        update={
            "phase": Phase.TERMINATING,
            "conditions": merge_conditions(previous.conditions, terminating, now, meta.get("generation")),
            "drains": _drains(progress.drains, starts),
        }
    )
    actions: list[Action] = [*progress.actions, *removals]
    if left:
        patch = _status_patch(previous, status)
        if patch is not None:
            actions.append(PatchStatus(patch))
    if previous.phase != Phase.TERMINATING and left:
        actions.append(EmitEvent(EventType.NORMAL, Reason.TERMINATING, f"removing {left} pod(s) before deletion"))
    return Plan(
        actions=tuple(actions),
        requeue_after=progress.requeue_after,
        finished=left == 0,
        notes=(f"deleting: {left} pod(s) left",),
    )
