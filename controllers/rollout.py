"""Canary rollouts: which revisions run, how many pods and how much traffic each gets, step by step.

Why it exists: a change of what runs in the pods (model, engine flags, quantization, image, env, ...) must reach
production gradually, be judged on LLM metrics, and be undone automatically when it is worse. This module is
the pure state machine behind that; `controllers.reconcile` turns its decisions into pods, drains and status,
and the operator's analysis runner feeds it analysis checks (`controllers.analysis`).

The model (after Argo Rollouts' canary steps and analysis, reduced to what an LLM fleet needs):

- The stable revision is remembered as a snapshot of the pod-relevant spec (`status.rollout.stableSpec`), so
  stable pods can be rebuilt while `spec` already describes the canary. A variant's revision is the hash of its
  pod-relevant intent (`controllers.revision`); a variant whose spec revision differs from its stable one is *changed*.
  The canary is the set of changed variants; its id (`canaryRevision`) is their spec revision (several variants:
  a hash of the variant -> revision map).
- No `spec.rollout`: a change is promoted at once and pods are replaced by draining (a rolling replace).
  The first revision of a deployment is stable at once too (there is nothing to compare it with).
- With `spec.rollout.canary`, a change starts a canary at step 0. Step i sets the canary's traffic weight w
  (`status.endpoints`, `status.rollout.canaryWeight`) and pods: per changed variant of D desired pods,
  canary `ceil(w% of D)` (at least 1) and stable `ceil((100-w)% of D)` (at least 1 below 100%).
- A step is complete when its `pauseSeconds` have passed since it began, the canary's pods for it are ready, and
  the latest analysis check of the step passed (at 100%, where stable gets no traffic to compare with: is not a
  failure). Missing metrics make a check Inconclusive, which never completes a step: the rollout waits for data
  (or for a manual promote). After the last step the canary is promoted: it becomes stable, old pods drain.
- The analysis clock starts when the canary's metrics series first appear (`status.rollout.canaryMetricsSince`),
  not when the canary starts: until then the shell only looks for them (`analysis_request` asks it to,
  `await_series` judges what it found), so no check runs on no data; the first check comes one `intervalSeconds`
  after they appeared. Series still missing `SERIES_TIMEOUT_INTERVALS` intervals after the canary's first pod was
  ready fail a check ("no canary metrics after N s"), once per interval, until `failureLimit` rolls it back.
- `failureLimit` consecutive failed checks roll the canary back: weight 0, canary pods drained, `rejectedRevision`
  set (that revision is not tried again until the spec changes), a Warning Event and the reason in status.
  An Inconclusive check neither counts as a failure nor breaks a run of them.
- Annotations `llmfleet.io/promote=true` (make the spec's revision stable now, even a rejected one) and
  `llmfleet.io/abort=true` (roll the running canary back) are one-shot commands: the operator removes them after
  acting, so the spec stays declarative for GitOps.
- A new pod-relevant spec during a canary supersedes it: its pods drain, the new canary starts at step 0.
  Reverting the spec to the stable revision aborts the canary (not a rejection).
- Phases: Stable; Progressing (a canary runs); Promoting / RollingBack while pods of the losing revision are still
  going away; RolledBack while the spec still asks for the rejected revision. Every decision is a function of
  the spec, the last status, the pods and `now`, so an operator restart resumes at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from controllers.actions import EmitEvent, EventType
from controllers.observed import PodInfo, parse_time
from controllers.pods import PodDefaults, pod_template
from controllers.reasons import Reason
from controllers.revision import (
    NON_POD_FIELDS,
    NON_POD_VARIANT_FIELDS,
    revision_of,
    variant_revision,
)
from controllers.running_spec import DeploymentView
from crds.helpers import dump_spec, parse_spec
from crds.models import (
    AnalysisResult,
    AnalysisSpec,
    CanarySpec,
    InferenceDeploymentSpec,
    Quantization,
    RolloutPhase,
    RolloutStatus,
    Verdict,
)
from crds.pods import LABEL_REVISION, LABEL_VARIANT, marked, ready_condition
from crds.pods import labels as pod_labels

PROMOTE = "llmfleet.io/promote"
ABORT = "llmfleet.io/abort"
MAX_ANALYSIS = 20  # status.rollout.analysis is bounded (oldest dropped first)
# No canary metrics series this many analysis intervals after its first pod was ready: the check fails.
SERIES_TIMEOUT_INTERVALS = 2
# While waiting for the canary's series, a pass looks for them this often.
SERIES_POLL_SECONDS = 1.0
_PERCENT = 100
# Spec fields that never reach a pod: left out of the stable snapshot and always taken from the current spec.
_NON_POD_FIELDS = NON_POD_FIELDS
_NON_POD_VARIANT_FIELDS = NON_POD_VARIANT_FIELDS
_VERDICT_RANK = {Verdict.PASS: 0, Verdict.INCONCLUSIVE: 1, Verdict.FAIL: 2}
# The Event of each analysis check (a Warning when it failed).
ANALYSIS_EVENTS = {
    Verdict.PASS: Reason.ANALYSIS_PASS,
    Verdict.FAIL: Reason.ANALYSIS_FAIL,
    Verdict.INCONCLUSIVE: Reason.ANALYSIS_INCONCLUSIVE,
}


# ------------------------------------------------------------------------------------------- revisions and specs


def pod_snapshot(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The pod-relevant part of a spec: what `status.rollout.stableSpec` keeps of the stable revision."""
    data = dump_spec(spec)
    for key in _NON_POD_FIELDS:
        data.pop(key, None)
    data["variants"] = [
        {key: value for key, value in variant.items() if key not in _NON_POD_VARIANT_FIELDS}
        for variant in data["variants"]
    ]
    return data


def stable_spec_of(spec: InferenceDeploymentSpec, snapshot: Mapping[str, Any] | None) -> InferenceDeploymentSpec:
    """The spec the stable pods are built from: the snapshot's pod-relevant fields with the current spec's sizes,
    weights and tiers. Variants the snapshot does not know (added since) have no older revision: they take the
    current spec. Without a readable snapshot the current spec is stable."""
    if not snapshot or not isinstance(snapshot.get("variants"), list):
        return spec
    current = dump_spec(spec)
    known = {v.get("name"): v for v in snapshot["variants"] if isinstance(v, Mapping)}
    variants = []
    for variant in current["variants"]:
        old = known.get(variant["name"])
        if old is None:
            variants.append(variant)
        else:
            variants.append({**old, **{k: variant[k] for k in _NON_POD_VARIANT_FIELDS if k in variant}})
    merged = {
        **{k: v for k, v in snapshot.items() if k != "variants"},
        **{k: current[k] for k in _NON_POD_FIELDS if k in current},
        "variants": variants,
    }
    try:
        return parse_spec(merged)
    except ValidationError:
        return spec  # written by another version and no longer readable: the current spec becomes stable


@dataclass(frozen=True)
class VariantRevisions:
    """The stable and the spec ("target") revision of one variant, with the pod templates that make them."""

    variant: str
    stable: str
    stable_template: Mapping[str, Any]
    target: str
    target_template: Mapping[str, Any]
    stable_quantization: Quantization
    target_quantization: Quantization

    @property
    def changed(self) -> bool:
        return self.stable != self.target


def variant_revisions(
    deployment: str, spec: InferenceDeploymentSpec, stable: InferenceDeploymentSpec, defaults: PodDefaults
) -> dict[str, VariantRevisions]:
    """Per variant of `spec` (in order): its stable and target revisions."""
    stable_variants = {v.name: v for v in stable.variants}
    result: dict[str, VariantRevisions] = {}
    for variant in spec.variants:
        old = stable_variants.get(variant.name, variant)
        target_template = pod_template(deployment, spec, variant, defaults)
        stable_template = pod_template(deployment, stable, old, defaults)
        result[variant.name] = VariantRevisions(
            variant=variant.name,
            stable=variant_revision(deployment, stable, old, defaults),
            stable_template=stable_template,
            target=variant_revision(deployment, spec, variant, defaults),
            target_template=target_template,
            stable_quantization=old.quantization,
            target_quantization=variant.quantization,
        )
    return result


def revision_id(revisions: Mapping[str, str]) -> str | None:
    """One id for a set of variant revisions: the revision itself for one variant (so it matches the pods'
    `llmfleet.io/revision` label), a hash of the variant -> revision map for several; None for none."""
    if not revisions:
        return None
    if len(revisions) == 1:
        return next(iter(revisions.values()))
    return revision_of({"variants": dict(sorted(revisions.items()))})


def shares(weight: int, desired: int) -> tuple[int, int]:
    """(stable pods, canary pods) of a variant of `desired` pods with `weight`% of its traffic on the canary."""
    if desired <= 0:
        return 0, 0
    canary = max(1, math.ceil(weight * desired / _PERCENT))
    stable = math.ceil((_PERCENT - weight) * desired / _PERCENT)
    return (max(1, stable) if weight < _PERCENT else 0), canary


# ------------------------------------------------------------------------------------------------- step machine


@dataclass(frozen=True)
class RolloutInput:
    """Everything one step of the machine looks at."""

    canary: CanarySpec | None  # spec.rollout.canary (None: no canary rollout, changes replace pods directly)
    previous: RolloutStatus
    revisions: Mapping[str, VariantRevisions]  # from the previous snapshot
    snapshot: Mapping[str, Any]  # pod_snapshot(spec): the stable snapshot once the spec's revision is stable
    pods: Sequence[PodInfo]  # the deployment's own pods
    desired: Mapping[str, int]  # desired pods per variant
    annotations: Mapping[str, str]
    analysis: AnalysisResult | None  # a check the shell ran for this pass
    now: datetime
    canary_metrics_since: datetime | None = None  # the shell found the canary's metrics series in this pass


@dataclass(frozen=True)
class RolloutDecision:
    """The rollout status after this pass, and what to tell and undo."""

    status: RolloutStatus
    events: tuple[EmitEvent, ...] = ()
    remove_annotations: tuple[str, ...] = ()
    requeue_after: float | None = None


def advance(inp: RolloutInput) -> RolloutDecision:
    """One step of the rollout state machine (see the module docstring)."""
    prev = inp.previous
    changed = {name: r for name, r in inp.revisions.items() if r.changed}
    target_id = revision_id({name: r.target for name, r in changed.items()})
    promote, abort = marked(inp.annotations.get(PROMOTE)), marked(inp.annotations.get(ABORT))
    remove = tuple(key for key, on in ((PROMOTE, promote), (ABORT, abort)) if on)
    running = prev.phase == RolloutPhase.PROGRESSING and prev.canary_revision is not None
    if running:
        decision = _running(inp, changed, target_id, promote, abort)
    else:
        decision = _idle(inp, changed, target_id, promote, abort)
    return RolloutDecision(decision.status, decision.events, remove, decision.requeue_after)


def _idle(
    inp: RolloutInput,
    changed: Mapping[str, VariantRevisions],
    target_id: str | None,
    promote: bool,
    abort: bool,
) -> RolloutDecision:
    """No canary runs: settle a promotion or rollback, or start what the spec asks for."""
    prev = inp.previous
    events: list[EmitEvent] = []
    if abort:
        events.append(EmitEvent(EventType.NORMAL, Reason.ABORT_IGNORED, f"{ABORT}: no canary is running"))
    if not changed:
        if promote:
            events.append(EmitEvent(EventType.NORMAL, Reason.PROMOTE_IGNORED, f"{PROMOTE}: nothing to promote"))
        phase = _settled(prev.phase, _leftovers(inp), changed=False)
        stable_id = revision_id({n: r.stable for n, r in inp.revisions.items()})
        if prev.phase == RolloutPhase.ROLLED_BACK:
            why = (Reason.SPEC_REVERTED, f"the spec is back at stable revision {stable_id}")
        else:
            why = (Reason.STABLE, f"revision {stable_id} is stable")
        status = prev.model_copy(
            update={
                "phase": phase,
                "stable_revision": stable_id,
                "canary_revision": None,
                "canary_weight": 0,
                "stable_spec": dict(inp.snapshot),
                **_reason(prev, phase, *why),
            }
        )
        return RolloutDecision(status, tuple(events))
    if inp.canary is None or promote:
        message = (
            f"{PROMOTE}: revision {target_id} promoted without analysis"
            if promote
            else f"no spec.rollout: revision {target_id} replaces {_stable_id(inp)} directly (pods drain)"
        )
        reason = Reason.MANUAL_PROMOTE if promote else Reason.ROLLING_REPLACE
        return RolloutDecision(_promoted(inp, reason, message), (*events, EmitEvent(EventType.NORMAL, reason, message)))
    if target_id == prev.rejected_revision:
        phase = _settled(prev.phase, _leftovers(inp), changed=True)
        message = (
            f"revision {target_id} was rolled back before: change the spec to try another revision, or "
            f"annotate {PROMOTE}=true to promote it anyway"
        )
        status = prev.model_copy(
            update={
                "phase": phase,
                "canary_revision": None,
                "canary_weight": 0,
                **_reason(prev, phase, Reason.REVISION_REJECTED, message),
            }
        )
        return RolloutDecision(status, tuple(events))
    return _start(
        inp, target_id, Reason.CANARY_STARTED, f"canary {target_id} started beside stable {_stable_id(inp)}", events
    )


def _running(
    inp: RolloutInput,
    changed: Mapping[str, VariantRevisions],
    target_id: str | None,
    promote: bool,
    abort: bool,
) -> RolloutDecision:
    """A canary runs: follow spec changes and commands, record analysis, step, promote or roll back."""
    interrupted = _interrupted(inp, changed, target_id, promote, abort)
    return interrupted if interrupted is not None else _step(inp, changed)


def _interrupted(
    inp: RolloutInput,
    changed: Mapping[str, VariantRevisions],
    target_id: str | None,
    promote: bool,
    abort: bool,
) -> RolloutDecision | None:
    """What ends or replaces the running canary before its step is judged: the spec reverted to stable,
    `spec.rollout` removed, the spec moved to another (or a rejected) revision, or a promote/abort command.
    None when the canary simply goes on."""
    prev = inp.previous
    canary_id = prev.canary_revision
    if not changed:
        why = f"the spec was reverted to stable {_stable_id(inp)}: canary {canary_id} aborted, its pods drain"
        status = prev.model_copy(
            update={
                "phase": RolloutPhase.ROLLING_BACK,
                "canary_revision": None,
                "canary_weight": 0,
                "step_started_at": None,
                "canary_metrics_since": None,
                "consecutive_failures": 0,
                "reason": Reason.SPEC_REVERTED,
                "message": why,
            }
        )
        return RolloutDecision(status, (EmitEvent(EventType.NORMAL, Reason.CANARY_ABORTED, why),))
    if inp.canary is None:
        why = f"spec.rollout was removed: canary {canary_id} promoted without further steps"
        return RolloutDecision(
            _promoted(inp, Reason.ROLLOUT_SPEC_REMOVED, why),
            (EmitEvent(EventType.NORMAL, Reason.CANARY_PROMOTED, why),),
        )
    if target_id != canary_id:
        if target_id == prev.rejected_revision:
            why = f"the spec now asks for rejected revision {target_id}: canary {canary_id} stops, its pods drain"
            status = prev.model_copy(
                update={
                    "phase": RolloutPhase.ROLLING_BACK,
                    "canary_revision": None,
                    "canary_weight": 0,
                    "step_started_at": None,
                    "canary_metrics_since": None,
                    "reason": Reason.REVISION_REJECTED,
                    "message": why,
                }
            )
            return RolloutDecision(status, (EmitEvent(EventType.NORMAL, Reason.CANARY_ABORTED, why),))
        events = [
            EmitEvent(
                EventType.NORMAL,
                Reason.CANARY_SUPERSEDED,
                f"canary {canary_id} superseded by {target_id} (the spec changed); its pods drain",
            )
        ]
        why = f"canary {target_id} replaced canary {canary_id}"
        return _start(inp, target_id, Reason.CANARY_SUPERSEDED, why, events)
    if abort:
        return _rolled_back(inp, Reason.MANUAL_ABORT, f"{ABORT}: canary {canary_id} rolled back by request")
    if promote:
        why = f"{PROMOTE}: canary {canary_id} promoted at step {prev.step + 1} without further analysis"
        promoted = _promoted(inp, Reason.MANUAL_PROMOTE, why)
        return RolloutDecision(promoted, (EmitEvent(EventType.NORMAL, Reason.CANARY_PROMOTED, why),))
    return None


def _step(inp: RolloutInput, changed: Mapping[str, VariantRevisions]) -> RolloutDecision:
    """The running canary's step: record a due analysis result (rolling back at `failureLimit` failures in a
    row), then advance to the next step, promote after the last, or keep waiting (and say for what)."""
    prev = inp.previous
    canary_id = prev.canary_revision
    canary = inp.canary
    assert canary is not None  # `_interrupted` promotes a canary whose spec.rollout was removed
    steps = canary.steps
    index = min(prev.step, len(steps) - 1)
    status = prev.model_copy(update={"step": index, "canary_weight": steps[index].weight})
    if status.canary_metrics_since is None and inp.canary_metrics_since is not None:
        status = status.model_copy(update={"canary_metrics_since": inp.canary_metrics_since})
    events: list[EmitEvent] = []
    result = inp.analysis
    if result is not None:
        status, event = _record(status, result, len(steps))
        events.append(event)
        if status.consecutive_failures >= canary.analysis.failure_limit:
            why = (
                f"canary {canary_id} failed {status.consecutive_failures} analysis check(s) in a row "
                f"(failureLimit {canary.analysis.failure_limit}) at step {index + 1}/{len(steps)}: {result.message}"
            )
            decision = _rolled_back(inp, Reason.ANALYSIS_FAILED, why, base=status)
            return RolloutDecision(decision.status, (*events, *decision.events))
    waiting = _step_waits(status, canary, changed, inp)
    if waiting is None:
        if index + 1 >= len(steps):
            why = f"canary {canary_id} passed all {len(steps)} step(s): promoted"
            promoted = _promoted(inp, Reason.ALL_STEPS_PASSED, why, base=status)
            return RolloutDecision(promoted, (*events, EmitEvent(EventType.NORMAL, Reason.CANARY_PROMOTED, why)))
        nxt = steps[index + 1]
        why = f"canary {canary_id} step {index + 2}/{len(steps)}: weight {nxt.weight}%"
        status = status.model_copy(
            update={
                "step": index + 1,
                "canary_weight": nxt.weight,
                "step_started_at": inp.now,
                "reason": Reason.STEP_ADVANCED,
                "message": why,
            }
        )
        events.append(EmitEvent(EventType.NORMAL, Reason.CANARY_STEP, why))
        waiting = f"step {index + 2} just began"
    else:
        status = status.model_copy(
            update={
                "message": f"canary {canary_id} at step {index + 1}/{len(steps)} "
                f"(weight {status.canary_weight}%): {waiting}"
            }
        )
    return RolloutDecision(status, tuple(events), requeue_after=_next_wake(status, canary, inp.now))


def _start(
    inp: RolloutInput, target_id: str | None, reason: Reason, why: str, events: Iterable[EmitEvent]
) -> RolloutDecision:
    assert inp.canary is not None
    first = inp.canary.steps[0]
    message = f"{why}; step 1/{len(inp.canary.steps)}: weight {first.weight}%"
    status = inp.previous.model_copy(
        update={
            "phase": RolloutPhase.PROGRESSING,
            "stable_revision": _stable_id(inp),
            "canary_revision": target_id,
            "step": 0,
            "canary_weight": first.weight,
            "started_at": inp.now,
            "step_started_at": inp.now,
            "canary_metrics_since": None,
            "consecutive_failures": 0,
            "reason": reason,
            "message": message,
        }
    )
    started = EmitEvent(EventType.NORMAL, Reason.CANARY_STARTED, message)
    return RolloutDecision(status, (*events, started), requeue_after=_next_wake(status, inp.canary, inp.now))


def _promoted(inp: RolloutInput, reason: Reason, why: str, base: RolloutStatus | None = None) -> RolloutStatus:
    """The spec's revision becomes stable now; pods of the old one drain (phase Promoting until they are gone)."""
    prev = base or inp.previous
    target = revision_id({n: r.target for n, r in inp.revisions.items()})
    promoted = revision_id({n: r.target for n, r in inp.revisions.items() if r.changed})
    return prev.model_copy(
        update={
            "phase": RolloutPhase.PROMOTING,
            "stable_revision": target,
            "canary_revision": None,
            "rejected_revision": None if prev.rejected_revision == promoted else prev.rejected_revision,
            "step": 0,
            "canary_weight": 0,
            "step_started_at": None,
            "canary_metrics_since": None,
            "consecutive_failures": 0,
            "stable_spec": dict(inp.snapshot),
            "reason": reason,
            "message": why,
        }
    )


def _rolled_back(inp: RolloutInput, reason: Reason, why: str, base: RolloutStatus | None = None) -> RolloutDecision:
    """Give up the running canary: no traffic, its pods drain, and its revision is not tried again."""
    prev = base or inp.previous
    status = prev.model_copy(
        update={
            "phase": RolloutPhase.ROLLING_BACK,
            "rejected_revision": prev.canary_revision,
            "canary_revision": None,
            "canary_weight": 0,
            "step_started_at": None,
            "canary_metrics_since": None,
            "reason": reason,
            "message": why,
        }
    )
    return RolloutDecision(status, (EmitEvent(EventType.WARNING, Reason.CANARY_ROLLED_BACK, why),))


def _record(status: RolloutStatus, result: AnalysisResult, steps: int) -> tuple[RolloutStatus, EmitEvent]:
    """Append a check (bounded) and count failures in a row (Inconclusive leaves the count as it is)."""
    failures = status.consecutive_failures
    if result.verdict == Verdict.FAIL:
        failures += 1
    elif result.verdict == Verdict.PASS:
        failures = 0
    recorded = status.model_copy(
        update={"analysis": [*status.analysis, result][-MAX_ANALYSIS:], "consecutive_failures": failures}
    )
    kind = EventType.WARNING if result.verdict == Verdict.FAIL else EventType.NORMAL
    event = EmitEvent(
        kind,
        ANALYSIS_EVENTS[result.verdict],
        f"canary {status.canary_revision} step {status.step + 1}/{steps}: {result.message}",
    )
    return recorded, event


def _step_waits(
    status: RolloutStatus, canary: CanarySpec, changed: Mapping[str, VariantRevisions], inp: RolloutInput
) -> str | None:
    """What the current step still waits for, or None when it is complete."""
    step = canary.steps[status.step]
    started = status.step_started_at or inp.now
    until = started + timedelta(seconds=step.pause_seconds)
    if inp.now < until:
        return f"pausing until {until.isoformat(timespec='seconds')}"
    for name, revisions in changed.items():
        _, want = shares(status.canary_weight, inp.desired.get(name, 0))
        ready = sum(p.live and p.ready and p.variant == name and p.revision == revisions.target for p in inp.pods)
        if ready < want:
            return f"variant {name}: {ready}/{want} canary pod(s) ready"
    checks = [a for a in status.analysis if a.step == status.step and a.time >= started]
    if not checks:
        if status.canary_metrics_since is None:
            return "waiting for the canary's metrics series (the analysis clock starts when they appear)"
        return "waiting for an analysis check"
    latest = checks[-1]
    if latest.verdict == Verdict.PASS:
        return None
    if status.canary_weight >= _PERCENT and latest.verdict != Verdict.FAIL:
        return None  # stable takes no traffic at 100%: nothing to compare, no failure is enough
    return f"the latest analysis check is {latest.verdict.value}: {latest.message}"


def _settled(phase: RolloutPhase, leftovers: bool, *, changed: bool) -> RolloutPhase:
    """Promoting/RollingBack end once the losing revision's pods are gone."""
    if leftovers and phase in (RolloutPhase.PROMOTING, RolloutPhase.ROLLING_BACK):
        return phase
    return RolloutPhase.ROLLED_BACK if changed else RolloutPhase.STABLE


def _leftovers(inp: RolloutInput) -> bool:
    """Pods (serving, draining or terminating) of a variant in the spec whose revision is not the stable one."""
    return any(
        p.variant is not None
        and p.variant in inp.revisions
        and p.revision != inp.revisions[p.variant].stable
        and not p.failed
        for p in inp.pods
    )


def _reason(prev: RolloutStatus, phase: RolloutPhase, reason: Reason, message: str) -> dict[str, Any]:
    """Reason and message for a settled phase: a phase reached by settling (Promoting -> Stable, RollingBack ->
    RolledBack or Stable) keeps why it got there; a fresh status or a jump from another phase takes these."""
    settling = {RolloutPhase.PROMOTING, RolloutPhase.ROLLING_BACK}
    if prev.reason and (phase == prev.phase or prev.phase in settling):
        return {}
    return {"reason": reason, "message": message}


def _stable_id(inp: RolloutInput) -> str | None:
    return revision_id({n: r.stable for n, r in inp.revisions.items()})


# ------------------------------------------------------------------------------------------------------- timing


def _canary_runs(status: RolloutStatus, canary: CanarySpec | None) -> bool:
    return canary is not None and status.phase == RolloutPhase.PROGRESSING and status.canary_revision is not None


def awaiting_series(status: RolloutStatus, canary: CanarySpec | None) -> bool:
    """A canary runs whose metrics series have not appeared yet: its analysis clock has not started."""
    return _canary_runs(status, canary) and status.canary_metrics_since is None


def next_analysis_at(status: RolloutStatus, canary: CanarySpec | None) -> datetime | None:
    """When the next analysis check is due (None when no canary runs or its series have not appeared):
    `intervalSeconds` after the latest check of this canary, or after its metrics series appeared."""
    if canary is None or not _canary_runs(status, canary) or status.canary_metrics_since is None:
        return None
    since = [status.canary_metrics_since, *([status.analysis[-1].time] if status.analysis else [])]
    return max(since) + timedelta(seconds=canary.analysis.interval_seconds)


def analysis_due(status: RolloutStatus, canary: CanarySpec | None, now: datetime) -> bool:
    due = next_analysis_at(status, canary)
    return due is not None and now >= due


def _next_wake(status: RolloutStatus, canary: CanarySpec, now: datetime) -> float:
    """Seconds until something may change by itself: the step's pause ends, an analysis check is due, or (while
    waiting for the canary's series) the next look for them."""
    moments = [next_analysis_at(status, canary)]
    if awaiting_series(status, canary):
        moments.append(now + timedelta(seconds=SERIES_POLL_SECONDS))
    if status.step_started_at is not None:
        moments.append(status.step_started_at + timedelta(seconds=canary.steps[status.step].pause_seconds))
    waits = [(m - now).total_seconds() for m in moments if m is not None and m > now]
    return max(0.5, min(waits)) if waits else 1.0


# ------------------------------------------------------------------------------------------ pods and traffic


@dataclass(frozen=True)
class WantedRevision:
    """A revision a variant should run: its pods, their template, and its traffic share."""

    revision: str
    template: Mapping[str, Any]
    replicas: int
    weight: int | None  # percent of the variant's traffic; None = shared with old revisions by ready pods
    quantization: Quantization = Quantization.NONE
    canary: bool = False


@dataclass(frozen=True)
class VariantRollout:
    """The revisions a variant should run now; pods of any other revision go (drained)."""

    wanted: tuple[WantedRevision, ...]
    muted: frozenset[str] = field(default_factory=frozenset)  # revisions that must get no traffic (rejected)

    @property
    def primary(self) -> WantedRevision:
        """The revision the variant is heading to (the canary during a canary, else the only one)."""
        return self.wanted[-1]


def variant_rollouts(
    status: RolloutStatus, revisions: Mapping[str, VariantRevisions], desired: Mapping[str, int]
) -> dict[str, VariantRollout]:
    """What each variant runs under `status` (revisions computed from `status.stableSpec`)."""
    running = status.phase == RolloutPhase.PROGRESSING and status.canary_revision is not None
    plans: dict[str, VariantRollout] = {}
    for name, r in revisions.items():
        count = desired.get(name, 0)
        if running and r.changed:
            stable_n, canary_n = shares(status.canary_weight, count)
            plans[name] = VariantRollout(
                (
                    WantedRevision(
                        r.stable, r.stable_template, stable_n, _PERCENT - status.canary_weight, r.stable_quantization
                    ),
                    WantedRevision(
                        r.target, r.target_template, canary_n, status.canary_weight, r.target_quantization, canary=True
                    ),
                )
            )
        elif running:
            plans[name] = VariantRollout(
                (WantedRevision(r.target, r.target_template, count, _PERCENT, r.target_quantization),)
            )
        else:
            muted = frozenset({r.target}) if r.changed else frozenset()
            plans[name] = VariantRollout(
                (WantedRevision(r.stable, r.stable_template, count, None, r.stable_quantization),), muted
            )
    return plans


# ----------------------------------------------------------------------------------------------- analysis input


@dataclass(frozen=True)
class Comparison:
    """One changed variant to analyse: its stable and canary revisions, and whether quantization changes (then
    the quality probe runs)."""

    variant: str
    stable: str
    canary: str
    quality_required: bool


def comparisons(revisions: Mapping[str, VariantRevisions]) -> tuple[Comparison, ...]:
    """The changed variants, as analysis comparisons."""
    return tuple(
        Comparison(name, r.stable, r.target, r.stable_quantization != r.target_quantization)
        for name, r in revisions.items()
        if r.changed
    )


def combine(results: Mapping[str, AnalysisResult], *, step: int, now: datetime) -> AnalysisResult:
    """One check from per-variant checks: the worst verdict, the values of the worst variant, every message."""
    if not results:
        return AnalysisResult(
            time=now, step=step, verdict=Verdict.INCONCLUSIVE, message="Inconclusive: nothing to compare"
        )
    if len(results) == 1:
        return next(iter(results.values()))
    worst_name = max(results, key=lambda n: _VERDICT_RANK[results[n].verdict])
    worst = results[worst_name]
    message = "; ".join(f"variant {name}: {r.message}" for name, r in results.items())
    if len(message) > 4096:
        message = message[:4093] + "..."
    return worst.model_copy(update={"message": message, "time": now, "step": step})


@dataclass(frozen=True)
class AnalysisRequest:
    """What the shell should do about a canary's analysis now: run the check that is due, or (`awaiting_series`)
    only look whether the canary's metrics series exist yet (then `await_series` decides)."""

    step: int
    comparisons: tuple[Comparison, ...]
    spec: AnalysisSpec
    model: str  # the served model name (quality-probe requests name it)
    window_s: float  # the interval the check covers
    awaiting_series: bool = False  # the analysis clock has not started: look for the canary's series, check nothing
    step_started_at: datetime | None = None  # the wait's start when the canary's readiness is unknown
    not_before: datetime | None = None  # no check earlier than this (one interval after the latest one)


@dataclass(frozen=True)
class SeriesWait:
    """What a look for the canary's series found: `metrics_since` (they appeared: the clock starts then), a failed
    check `result` (still none after the timeout), or neither (keep waiting)."""

    metrics_since: datetime | None = None
    result: AnalysisResult | None = None


def await_series(request: AnalysisRequest, *, present: bool, ready_since: datetime | None, now: datetime) -> SeriesWait:
    """Judge one look for the canary's metrics series. `present`: the metrics source has series of every compared
    canary revision; `ready_since`: when the canary's first (still) ready pod became ready (None: unknown, then
    the step's start counts). Missing series fail a check `SERIES_TIMEOUT_INTERVALS` intervals after that, and
    again at most once per interval."""
    if present:
        return SeriesWait(metrics_since=now)
    since = ready_since or request.step_started_at
    if since is None:
        return SeriesWait()
    timeout = timedelta(seconds=SERIES_TIMEOUT_INTERVALS * request.spec.interval_seconds)
    deadline = max(d for d in (since + timeout, request.not_before) if d is not None)
    if now < deadline:
        return SeriesWait()
    waited = (now - since).total_seconds()
    message = (
        f"{Verdict.FAIL.value}: no canary metrics after {waited:.0f} s (the metrics source has no series of "
        f"the canary's pods; timeout {SERIES_TIMEOUT_INTERVALS} x intervalSeconds after its first pod was "
        "ready)"
    )
    return SeriesWait(result=AnalysisResult(time=now, step=request.step, verdict=Verdict.FAIL, message=message))


def canary_ready_since(pods: Iterable[Mapping[str, Any]], variant: str, revision: str) -> datetime | None:
    """When the earliest of the variant's ready pods of `revision` became ready (its Ready condition's
    lastTransitionTime); None without one."""
    moments: list[datetime] = []
    for pod in pods:
        if pod_labels(pod).get(LABEL_VARIANT) != variant or pod_labels(pod).get(LABEL_REVISION) != revision:
            continue
        condition = ready_condition(pod)
        moment = parse_time(condition.get("lastTransitionTime")) if condition is not None else None
        if moment is not None:
            moments.append(moment)
    return min(moments) if moments else None


def analysis_request(
    resource: Mapping[str, Any] | DeploymentView, now: datetime, defaults: PodDefaults
) -> AnalysisRequest | None:
    """What the operator should do about this InferenceDeployment's canary analysis now: look for the canary's
    metrics series (until they appear), run the check that is due, or nothing (None): no canary runs, the spec is
    invalid, the deployment is being deleted, no check is due yet, or the spec has moved on from the running
    canary (the next reconcile pass supersedes it; analysing it would be wasted). `resource`: the object, or the
    pass's `DeploymentView` of it."""
    view = DeploymentView.of(resource)
    if view.deleting or not view.status_readable:
        return None
    meta, status = view.meta, view.status
    spec = view.running.spec  # the last valid one while invalid
    if spec is None:
        return None
    canary = spec.rollout.canary if spec.rollout is not None else None
    waiting = awaiting_series(status.rollout, canary)
    if canary is None or not (waiting or analysis_due(status.rollout, canary, now)):
        return None
    revisions = variant_revisions(meta["name"], spec, stable_spec_of(spec, status.rollout.stable_spec), defaults)
    compared = comparisons(revisions)
    if not compared or revision_id({c.variant: c.canary for c in compared}) != status.rollout.canary_revision:
        return None
    return AnalysisRequest(
        step=status.rollout.step,
        comparisons=compared,
        spec=canary.analysis,
        model=spec.model.name,
        window_s=float(canary.analysis.interval_seconds),
        awaiting_series=waiting,
        step_started_at=status.rollout.step_started_at,
        not_before=_latest_check_of(status.rollout, canary),
    )


def _latest_check_of(status: RolloutStatus, canary: CanarySpec) -> datetime | None:
    """One interval after the latest check of the running canary (None without one)."""
    checks = [a.time for a in status.analysis if status.started_at is None or a.time >= status.started_at]
    return max(checks) + timedelta(seconds=canary.analysis.interval_seconds) if checks else None
