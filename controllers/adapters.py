"""LoRA adapters in running pods: which to load or unload where, and how `status.adapters` reads. Pure.

Why it exists: `spec.adapters` is not a pod field (adding an adapter must not roll a GPU fleet), so no pod template
carries it; the operator instead tells each running worker to load or unload adapters over the worker's
authenticated control API (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`, the drain token), and the
gateway routes `MODEL:ADAPTER` only to pods listed here as `Loaded`. This module decides, from
- the spec's adapters (name -> source),
- the pods that serve adapters (`eligible`: live, ready, with an IP, of a revision whose spec has `engine.lora`),
- what each of those pods said it serves this pass (`AdapterProbe`, the shell's `GET /v1/models`),
- what the loads sent last pass answered (`AdapterResult`, kept in memory by the shell for one pass),
- and `status.adapters` as last written (the durable part: per pod, the source loaded or tried, attempts, time),
which `LoadAdapter`/`UnloadAdapter` actions to run, the new `status.adapters`, the `AdaptersReady` condition and
the Warning Events of new failures.

Rules, per adapter A (source S) and eligible pod P:
- P serves A, from S (by the record of the load; a load nobody recorded counts as S): Loaded.
- P serves A from another source (the spec changed it, or the last load of S failed while an older copy stayed):
  reload in place (`replace`: unload, then load S), with the same back-off as a failed load; one pod per adapter
  at a time (a rolling reload: the others keep their `Loaded` entry with the old source and go on serving it, the
  gateway retries a request that meets a pod mid-reload elsewhere), and `readyReplicas` counts only copies of S.
- P does not serve A: load it, unless the last load of S failed and its back-off has not run out (10 s, doubling
  per failed attempt, at most 5 min; a changed source is tried at once). A refused load is `Failed` with the
  worker's message, one Warning Event per new failure; the base model keeps serving and other adapters load.
- P serves an adapter that is not in the spec: unload it.
- P did not answer the probe: its entry stays as it was, nothing is sent to it, and it is asked again in 5 s.
Pods that are not eligible (starting, draining, gone, or of a revision without `engine.lora`) get no entries.

May import crds, controllers.actions, controllers.conditions, controllers.observed, controllers.reasons.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from controllers.actions import EmitEvent, EventType, LoadAdapter, UnloadAdapter
from controllers.conditions import WantedCondition
from controllers.observed import AdapterProbe, AdapterResult, PodInfo, ProbeState
from controllers.reasons import Reason
from crds.models import (
    AdapterPodState,
    AdapterPodStatus,
    AdapterSpec,
    AdapterStatus,
    ConditionStatus,
    ConditionType,
)

RETRY_FIRST_S = 10.0
RETRY_MAX_S = 300.0
# After sending loads, look again this soon: the gateway routes to a pod only once status says Loaded.
CONFIRM_AFTER_S = 1.0
UNANSWERED_RETRY_S = 5.0


@dataclass(frozen=True)
class AdapterPlan:
    """The outcome for one pass: calls to workers, the new `status.adapters`, the condition (None: the deployment
    serves no adapters, the condition is dropped), Events, and when to look again."""

    loads: tuple[LoadAdapter, ...] = ()
    unloads: tuple[UnloadAdapter, ...] = ()
    status: tuple[AdapterStatus, ...] = ()
    condition: WantedCondition | None = None
    events: tuple[EmitEvent, ...] = ()
    requeue_after: float | None = None


@dataclass(frozen=True)
class AdapterInput:
    """Everything `plan_adapters` reads."""

    adapters: Sequence[AdapterSpec]
    lora: bool  # the spec turns LoRA on (`engine.lora`)
    eligible: Sequence[PodInfo]
    addresses: Mapping[str, str]  # pod name -> host:port of its worker
    previous: Sequence[AdapterStatus]
    now: datetime
    probes: Mapping[str, AdapterProbe] = field(default_factory=dict)
    results: Sequence[AdapterResult] = ()


def may_serve_adapters(pod: PodInfo) -> bool:
    """A pod the operator asks about adapters (and, of a LoRA revision, loads them into): live, ready, with an IP."""
    return pod.live and pod.ready and bool(pod.ip)


def retry_delay(attempts: int) -> float:
    """Seconds to wait before trying a source again after `attempts` failed loads of it."""
    return float(min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** max(0, attempts - 1)))


def plan_adapters(given: AdapterInput) -> AdapterPlan:
    """Plan adapter loads and unloads and the status (see the module docstring for the rules)."""
    if not given.lora and not given.adapters:
        return AdapterPlan()
    previous = {a.name: {p.pod: p for p in a.pods} for a in given.previous}
    results = {(r.pod, r.adapter, r.source): r for r in given.results}
    wanted = {a.name for a in given.adapters}
    loads: list[LoadAdapter] = []
    statuses: list[AdapterStatus] = []
    failures: dict[str, list[AdapterPodStatus]] = {}
    waits: list[float] = []
    new_failures: list[tuple[AdapterSpec, AdapterPodStatus]] = []
    pods = sorted(given.eligible, key=lambda p: p.name)
    for adapter in given.adapters:
        entries: list[AdapterPodStatus] = []
        replacing = False  # one pod of an adapter reloads in place per pass; the others serve the old copy meanwhile
        for pod in pods:
            before = previous.get(adapter.name, {}).get(pod.name)
            probe = given.probes.get(pod.name)
            entry, load = _pod_entry(adapter, pod, before, probe, results, given.now)
            if entry is None:
                continue
            replace = load and probe is not None and adapter.name in probe.adapters
            if replace and replacing and before is not None:
                entry, load = before, False
                waits.append(CONFIRM_AFTER_S)
            replacing |= replace and load
            entries.append(entry)
            if load:
                loads.append(LoadAdapter(pod.name, given.addresses[pod.name], adapter.name, adapter.source, replace))
            if entry.state == AdapterPodState.FAILED:
                failures.setdefault(adapter.name, []).append(entry)
                if before is None or before.state != AdapterPodState.FAILED or before.message != entry.message:
                    new_failures.append((adapter, entry))
                if (due := _retry_due(entry)) is not None:
                    waits.append(max(1.0, (due - given.now).total_seconds()))
        ready = sum(1 for e in entries if e.state == AdapterPodState.LOADED and e.source == adapter.source)
        statuses.append(AdapterStatus(name=adapter.name, source=adapter.source, ready_replicas=ready, pods=entries))
    unloads = [
        UnloadAdapter(pod.name, given.addresses[pod.name], name)
        for pod in pods
        if (probe := given.probes.get(pod.name)) is not None and probe.state == ProbeState.ANSWERED
        for name in sorted(probe.adapters - wanted)
    ]
    if loads or unloads:
        waits.append(CONFIRM_AFTER_S)
    if given.adapters and any(
        (probe := given.probes.get(p.name)) is not None and probe.state != ProbeState.ANSWERED for p in pods
    ):
        waits.append(UNANSWERED_RETRY_S)  # ask a pod that did not answer again soon, not at the next resync
    return AdapterPlan(
        loads=tuple(loads),
        unloads=tuple(unloads),
        status=tuple(statuses),
        condition=_condition(statuses, failures, len(given.eligible)),
        events=tuple(_failure_events(new_failures)),
        requeue_after=min(waits) if waits else None,
    )


def _pod_entry(
    adapter: AdapterSpec,
    pod: PodInfo,
    before: AdapterPodStatus | None,
    probe: AdapterProbe | None,
    results: Mapping[tuple[str, str, str], AdapterResult],
    now: datetime,
) -> tuple[AdapterPodStatus | None, bool]:
    """The pod's entry for this adapter after this pass, and whether to send it a load now."""
    if probe is None or probe.state != ProbeState.ANSWERED:
        return before, False  # unknown this pass: keep what we knew, send nothing
    source = adapter.source
    result = results.get((pod.name, adapter.name, source))
    same = before is not None and before.source == source
    if result is not None and result.error is not None:
        # refused; when the pod still serves the adapter, that is its old copy (a reload in place failed)
        attempts = before.attempts if same and before is not None else 1
        tried = before.last_attempt_time if before is not None and before.last_attempt_time else now
        return _failed(pod.name, source, result.error, attempts, tried), False
    if adapter.name in probe.adapters and _loaded_source(before, result, source) == source:
        return AdapterPodStatus(pod=pod.name, state=AdapterPodState.LOADED, source=source), False
    if same and before is not None and before.state == AdapterPodState.FAILED:
        due = _retry_due(before)
        if due is not None and now < due:
            return before, False
    attempts = (before.attempts if same and before is not None else 0) + 1
    return _attempt(pod.name, source, attempts, now), True  # a load, or a reload in place (`replace`)


def _retry_due(entry: AdapterPodStatus) -> datetime | None:
    """When an entry's source may be tried again after its last attempt (None: it records no attempt)."""
    tried = entry.last_attempt_time
    return None if tried is None else tried + timedelta(seconds=retry_delay(entry.attempts))


def _loaded_source(before: AdapterPodStatus | None, result: AdapterResult | None, spec_source: str) -> str | None:
    """The source the pod's copy of the adapter came from, as far as the records tell (None: not a source we know
    of: the last load of the recorded source failed, so the copy served is an older one)."""
    if result is not None and result.error is None:
        return result.source
    if before is None:
        return spec_source  # loaded by nobody we recorded (e.g. at the worker's start): take it as the spec's
    if before.state in (AdapterPodState.LOADED, AdapterPodState.LOADING) and before.source:
        return before.source
    return None


def _failed(pod: str, source: str, error: str, attempts: int, tried: datetime) -> AdapterPodStatus:
    return AdapterPodStatus(
        pod=pod,
        state=AdapterPodState.FAILED,
        source=source,
        message=error[:4096],
        attempts=attempts,
        last_attempt_time=tried,
    )


def _attempt(pod: str, source: str, attempts: int, now: datetime) -> AdapterPodStatus:
    return AdapterPodStatus(
        pod=pod, state=AdapterPodState.LOADING, source=source, attempts=attempts, last_attempt_time=now
    )


def _condition(
    statuses: Sequence[AdapterStatus], failures: Mapping[str, Sequence[AdapterPodStatus]], eligible: int
) -> WantedCondition:
    kind = ConditionType.ADAPTERS_READY
    if failures:
        message = "; ".join(
            f"adapter {name} failed in {', '.join(e.pod for e in entries)}: {entries[0].message}"
            for name, entries in sorted(failures.items())
        )
        return WantedCondition(
            kind,
            ConditionStatus.FALSE,
            Reason.ADAPTER_LOAD_FAILED,
            message + " (the base model and the other adapters keep serving; fix the adapter or its source)",
        )
    if not statuses:
        return WantedCondition(kind, ConditionStatus.TRUE, Reason.ADAPTERS_LOADED, "no adapters in the spec")
    if eligible == 0:
        return WantedCondition(kind, ConditionStatus.FALSE, Reason.ADAPTERS_LOADING, "no ready pod serves adapters yet")
    pending = [s for s in statuses if s.ready_replicas < eligible]
    if pending:
        return WantedCondition(
            kind,
            ConditionStatus.FALSE,
            Reason.ADAPTERS_LOADING,
            "loading " + ", ".join(f"{s.name} ({s.ready_replicas}/{eligible} pods)" for s in pending),
        )
    return WantedCondition(
        kind, ConditionStatus.TRUE, Reason.ADAPTERS_LOADED, f"{len(statuses)} adapter(s) loaded in {eligible} pod(s)"
    )


def _failure_events(new: Sequence[tuple[AdapterSpec, AdapterPodStatus]]) -> list[EmitEvent]:
    by_adapter: dict[str, list[AdapterPodStatus]] = {}
    sources: dict[str, str] = {}
    for adapter, entry in new:
        by_adapter.setdefault(adapter.name, []).append(entry)
        sources[adapter.name] = adapter.source
    return [
        EmitEvent(
            EventType.WARNING,
            Reason.ADAPTER_LOAD_FAILED,
            f"adapter {name} ({sources[name]}) could not be loaded in {', '.join(e.pod for e in entries)}: "
            f"{entries[0].message}. The base model keeps serving; fix the adapter or its source in spec.adapters",
        )
        for name, entries in sorted(by_adapter.items())
    ]
