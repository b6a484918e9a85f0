"""The autoscaler in the operator: gather a variant's inputs, call `controllers.autoscaling.decide`, persist it.

Why it exists: the decision is pure (`controllers.autoscaling`); this is its shell. Every InferenceDeployment
gets a kopf timer (`autoscale_interval_seconds`, default 10 s) and Alertmanager alerts trigger the same
evaluation at once (`Autoscaler.on_alerts`, called by `http_server`). A deployment with a variant at zero also
checks, every `wake_interval_seconds` (2 s), whether the gateway holds requests for it, and is evaluated at once
when it does (`Autoscaler.wake_check`): a held request waits for a pod start, not for the next tick. One
evaluation of a deployment:

1. read the CR and its pods fresh from the API server (a deleted or deleting CR is left to the reconcile loop;
   while an edit is invalid, the last valid spec is used, as everywhere);
2. per autoscaled variant: the pods as `PodCounts` (`pod_counts`: ready with their Ready transition time,
   starting with their creation time, draining/terminating apart), the metrics (`metrics_source`: Prometheus
   when configured, else the ready pods' own /metrics), the gateway's requests held at zero (`gateway_url`'s
   `GET /internal/queued`, else Prometheus's `llmfleet_gateway_queued_at_zero`), and the state persisted in
   `status.autoscaling` (`state_from_status`). Any failure to measure is missing data, which never scales down;
3. `decide` (`evaluate_variants`, pure), then a merge patch of `status.autoscaling` only, guarded by the
   CR's resourceVersion (a conflict re-reads the CR and decides again on the same measurements), an Event with
   the decision's reason when a variant's size changes, and a wake-up of the reconcile loop so that pods follow
   at once (the planner reads the size from `status.autoscaling.variants[].desiredReplicas`).

`register_autoscaling` adds the kopf handlers: start/stop of the autoscaler, the operator metrics, the public HTTP
server (`/alerts`, applied only while kopf peering keeps this replica active) and the internal metrics server; the
timer; and a CR event handler that keeps the replica gauges current.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import kopf
from pydantic import ValidationError

from controllers import EmitEvent, EventType, Plan
from controllers.autoscaling import (
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
from controllers.pods import label_selector
from controllers.running_spec import running_spec
from controllers.sizing import desired_sizes
from crds.helpers import parse_status
from crds.models import (
    GROUP,
    PLURAL,
    VERSION,
    AutoscalingStatus,
    DecisionTrigger,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    Recommendation,
    VariantAutoscalingStatus,
)
from crds.pods import LABEL_VARIANT, is_draining, ready_condition
from fleet_operator.alerts import AlertPolicy, ParsedAlerts, ScaleIntent
from fleet_operator.analysis_runner import metrics_source
from fleet_operator.execute import execute
from fleet_operator.http_server import (
    OperatorHttpServer,
    create_metrics_app,
    create_operator_app,
)
from fleet_operator.kube import ApiError, Credentials, KubeApi, namespaced
from fleet_operator.metrics_source import (
    MetricsSource,
    PrometheusSource,
    Selector,
    promql_selector,
    scrape_targets,
)
from fleet_operator.observe import deployment_path
from fleet_operator.operator_metrics import OperatorMetrics
from fleet_operator.peering_state import PeeringState
from fleet_operator.settings import OperatorSettings

log = logging.getLogger(__name__)

CR = (GROUP, VERSION, PLURAL)
GATEWAY_QUEUED = "llmfleet_gateway_queued_at_zero"
# The status keeps at most 1024 window records (CRD); compact well before that (see `compact_window`).
MAX_WINDOW_RECORDS = 512
CONFLICT_ATTEMPTS = 4


# ------------------------------------------------------------------------------------------------- pure glue


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


def queued_by_variant(answer: Any, namespace: str, deployment: str) -> dict[str, float]:
    """The gateway's `GET /internal/queued` answer -> queued requests per variant of one deployment (a variant
    the gateway does not list has nothing queued). Raises ValueError on an answer of another shape."""
    if not isinstance(answer, Mapping) or not isinstance(answer.get("queued"), list):
        raise ValueError("expected {'queued': [{namespace, deployment, variant, queued}, ...]}")  # noqa: TRY004 - callers expect ValueError
    out: dict[str, float] = {}
    for row in answer["queued"]:
        if not isinstance(row, Mapping):
            raise ValueError(f"a queued row is not an object: {row!r}")  # noqa: TRY004 - callers expect ValueError
        if row.get("namespace") == namespace and row.get("deployment") == deployment:
            count = float(row.get("queued") or 0)
            if not math.isfinite(count) or count < 0:
                raise ValueError(f"bad queued count {row.get('queued')!r}")
            variant = str(row.get("variant"))
            out[variant] = out.get(variant, 0.0) + count
    return out


def intents_for(
    intents: Iterable[ScaleIntent], namespace: str, deployment: str, variant: str
) -> list[ScaleIntent]:
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
    return a.model_copy(update={"time": b.time}) == b


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
) -> list[VariantOutcome]:
    """Decide every autoscaled variant that has inputs (pure). The current size is what the planner pursues
    (`controllers.sizing.desired_sizes`: the last decision clamped to min/max, or the initial size); firing
    alert intents for the variant are added to its state first, resolved ones removed."""
    sizes = desired_sizes(spec, previous)
    entries = {entry.name: entry for entry in previous.variants}
    outcomes = []
    for variant in spec.variants:
        if variant.autoscaling is None or variant.name not in inputs:
            continue
        try:
            policy = policy_from_spec(
                variant.autoscaling, expected_startup_seconds=expected_startup_seconds, settle_seconds=settle_seconds
            )
        except ValidationError as error:  # the reconcile loop reports it as InvalidSpec
            log.info("%s/%s: variant %s not autoscaled: %s", namespace, deployment, variant.name, error)
            continue
        current = sizes[variant.name].replicas
        previous_entry = entries.get(variant.name)
        state = state_from_status(previous_entry)
        details: dict[str, tuple[str | None, str]] = {}
        mine = intents_for(intents, namespace, deployment, variant.name)
        for intent in mine:
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
        if mine:
            trigger = DecisionTrigger.ALERT
        elif current == 0 and decision.desired_replicas > 0:
            trigger = DecisionTrigger.WAKE
        else:
            trigger = DecisionTrigger.TIMER
        entry = record_decision(decision, previous_entry, name=variant.name, trigger=trigger, alert_details=details)
        outcomes.append(VariantOutcome(variant.name, trigger, decision, entry))
    return outcomes


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
    return EmitEvent(EventType.NORMAL, "Autoscaled", message)


# ------------------------------------------------------------------------------------------------------- shell


class Autoscaler:
    """Evaluates deployments on the timer and on alerts (its memory is only locks: state lives in the CRs)."""

    def __init__(
        self,
        api: KubeApi,
        source: MetricsSource,
        settings: OperatorSettings,
        metrics: OperatorMetrics,
        *,
        wake: Callable[[str, str], None] = lambda namespace, name: None,
        http: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.source = source
        self.settings = settings
        self.metrics = metrics
        self.wake = wake
        self.clock = clock
        self._http = http or httpx.AsyncClient(timeout=5.0)
        self._owns_http = http is None
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    @property
    def settle_seconds(self) -> float:
        """How long range-aggregated signals lag: Prometheus's TTFT range, else the scrape interval (the pod
        scraper's TTFT p95 is taken over the time between two evaluations)."""
        if isinstance(self.source, PrometheusSource):
            return self.source.ttft_window_s
        return self.settings.autoscale_interval_seconds

    async def tick(self, namespace: str, name: str) -> list[VariantOutcome]:
        """The timer's evaluation; never raises (an API error is logged and the next tick tries again)."""
        try:
            return await self.evaluate(namespace, name)
        except Exception as error:  # noqa: BLE001 - the timer must go on
            log.warning("%s/%s: autoscaling evaluation failed: %s", namespace, name, error)
            return []

    async def wake_check(self, namespace: str, name: str, at_zero: Sequence[str]) -> list[VariantOutcome]:
        """Between timer ticks, for a deployment with variants at zero: evaluate it at once when the gateway holds
        requests for one of them (a held request should not wait for the next tick). Never raises."""
        queued = await self._gateway_queued(namespace, name)
        if not queued or not any((queued.get(v) or 0) > 0 for v in at_zero):
            return []
        log.info("%s/%s: requests held at zero (%s): waking", namespace, name,
                 ", ".join(f"{v}: {queued.get(v):g}" for v in at_zero if queued.get(v)))
        return await self.tick(namespace, name)

    async def on_alerts(self, parsed: ParsedAlerts) -> None:
        """Apply an Alertmanager delivery: evaluate every deployment its intents name, at once. Raises on API
        errors, so the webhook answers 503 and Alertmanager delivers again."""
        targets: dict[tuple[str, str], list[ScaleIntent]] = {}
        for intent in parsed.intents:
            namespaces = [intent.namespace] if intent.namespace else await self._namespaces_of(intent.deployment)
            for namespace in namespaces:
                targets.setdefault((namespace, intent.deployment), []).append(intent)
        if not targets:
            log.info("alerts name no InferenceDeployment this operator serves: %s",
                     ", ".join(sorted({f"{i.alert} -> {i.deployment}" for i in parsed.intents})))
        for (namespace, name), intents in targets.items():
            outcomes = await self.evaluate(namespace, name, intents)
            if not outcomes:
                log.info("%s/%s: alerts %s name no autoscaled variant", namespace, name,
                         ", ".join(sorted({i.alert for i in intents})))

    async def evaluate(
        self, namespace: str, name: str, intents: Sequence[ScaleIntent] = ()
    ) -> list[VariantOutcome]:
        """One evaluation of one deployment (see the module docstring); the outcomes it persisted."""
        async with self._locks.setdefault((namespace, name), asyncio.Lock()):
            resource = await self.api.get(deployment_path(namespace, name))
            spec, previous = _autoscaling_view(resource)
            if resource is None or spec is None:
                return []
            variants = [v.name for v in spec.variants if v.autoscaling is not None]
            if not variants and not previous.variants:
                return []
            pods = await self.api.list(namespaced(namespace, "pods"), label_selector(name))
            inputs = await self._measure(namespace, name, variants, pods, resource["metadata"].get("uid"))
            for _attempt in range(CONFLICT_ATTEMPTS):
                spec, previous = _autoscaling_view(resource)
                if spec is None:
                    return []
                outcomes = evaluate_variants(
                    spec,
                    previous,
                    inputs,
                    namespace=namespace,
                    deployment=name,
                    now=self.clock(),
                    intents=intents,
                    expected_startup_seconds=self.settings.expected_startup_seconds,
                    settle_seconds=self.settle_seconds,
                )
                patch = autoscaling_patch(spec, previous, outcomes)
                if patch is None:
                    return outcomes
                try:
                    await self.api.merge_patch(
                        deployment_path(namespace, name) + "/status",
                        {"metadata": {"resourceVersion": resource["metadata"]["resourceVersion"]}, "status": patch},
                    )
                    break
                except ApiError as error:
                    if error.not_found:
                        return []
                    if error.status != 409:
                        raise
                resource = await self.api.get(deployment_path(namespace, name))
                if resource is None:
                    return []
            else:
                raise RuntimeError(f"status.autoscaling of {namespace}/{name} kept changing under the autoscaler")
        await self._announce(namespace, name, resource, outcomes)
        return outcomes

    async def _announce(
        self, namespace: str, name: str, resource: Mapping[str, Any], outcomes: Sequence[VariantOutcome]
    ) -> None:
        changed = [o for o in outcomes if o.decision.direction != "none"]
        for outcome in outcomes:
            log.debug("%s/%s: %s: %s", namespace, name, outcome.variant, outcome.decision.reason)
        if not changed:
            return
        for outcome in changed:
            log.info("%s/%s: %s", namespace, name, scale_event(outcome).message)
            source = "alert" if outcome.trigger == DecisionTrigger.ALERT else "timer"
            direction = "up" if outcome.decision.direction == "up" else "down"
            self.metrics.count_scale_decision(namespace, name, outcome.variant, direction, source)
        self.wake(namespace, name)
        await execute(self.api, Plan(actions=tuple(scale_event(o) for o in changed)), resource)

    async def _measure(
        self, namespace: str, name: str, variants: Sequence[str], pods: list[dict[str, Any]], uid: str | None
    ) -> dict[str, VariantInputs]:
        own = owned(pods, uid)
        targets = scrape_targets(own)
        samples, gateway = await asyncio.gather(
            asyncio.gather(*(self.source.load(Selector(namespace, name, v), targets) for v in variants)),
            self._gateway_queued(namespace, name),
        )
        observed_at = self.clock()
        inputs = {}
        for variant, sample in zip(variants, samples, strict=True):
            if sample.error:
                log.info("%s/%s: %s: metrics: %s", namespace, name, variant, sample.error)
            queued = _gateway_sample(gateway, variant, observed_at)
            inputs[variant] = VariantInputs(pod_counts(own, variant), sample.to_autoscaling(), queued)
        return inputs

    async def _gateway_queued(self, namespace: str, name: str) -> dict[str, float | None] | None:
        """Requests the gateway holds per variant; None when unknown (no gateway source, or it failed)."""
        try:
            if self.settings.gateway_url:
                key = self.settings.gateway_api_key
                headers = {"authorization": f"Bearer {key.get_secret_value()}"} if key is not None else {}
                response = await self._http.get(self.settings.gateway_url.rstrip("/") + "/internal/queued",
                                                headers=headers)
                response.raise_for_status()
                return dict(queued_by_variant(response.json(), namespace, name))
            if self.settings.prometheus_url:
                labels = promql_selector({"namespace": namespace, "deployment": name})
                response = await self._http.get(
                    self.settings.prometheus_url.rstrip("/") + "/api/v1/query",
                    params={"query": f"sum by (variant) ({GATEWAY_QUEUED}{labels})"},
                )
                response.raise_for_status()
                rows = response.json()["data"]["result"]
                # A variant without a series is unknown here: Prometheus may not scrape the gateway at all.
                return {str(r["metric"].get("variant")): float(r["value"][1]) for r in rows}
        except Exception as error:  # noqa: BLE001 - missing data, never an error upstream
            log.info("%s/%s: gateway queue unknown: %s: %s", namespace, name, type(error).__name__, error)
        return None

    async def _namespaces_of(self, name: str) -> list[str]:
        """Namespaces (of those this operator watches) holding an InferenceDeployment of this name."""
        if self.settings.namespaces:
            found = await asyncio.gather(*(self.api.get(deployment_path(ns, name)) for ns in self.settings.namespaces))
            return [ns for ns, item in zip(self.settings.namespaces, found, strict=True) if item is not None]
        items = await self.api.list(f"/apis/{GROUP}/{VERSION}/{PLURAL}")
        return sorted({item["metadata"]["namespace"] for item in items if item["metadata"].get("name") == name})

    def forget(self, namespace: str, name: str) -> None:
        lock = self._locks.get((namespace, name))
        if lock is not None and not lock.locked():
            del self._locks[(namespace, name)]

    async def aclose(self) -> None:
        await self.source.aclose()
        if self._owns_http:
            await self._http.aclose()


def _gateway_sample(queued: Mapping[str, float | None] | None, variant: str, now: float) -> GatewaySample | None:
    if queued is None:
        return None
    count = queued.get(variant, 0.0)
    return GatewaySample(observed_at=now, queued_requests=count) if count is not None else None


def _autoscaling_view(resource: Mapping[str, Any] | None) -> tuple[InferenceDeploymentSpec | None, AutoscalingStatus]:
    """(the spec the autoscaler acts on, its persisted state), from one read of the CR's status. The spec is the
    one the fleet runs (the last valid one while an edit is invalid, `controllers.running_spec`); None when the CR
    is gone, being deleted, or was never valid. An unreadable status starts over, as the reconcile loop does."""
    if resource is None or (resource.get("metadata") or {}).get("deletionTimestamp"):
        return None, AutoscalingStatus()
    raw_status = resource.get("status")
    try:
        status = parse_status(raw_status if isinstance(raw_status, Mapping) else None)
    except ValidationError:
        status = InferenceDeploymentStatus()
    return running_spec(resource.get("spec"), status.last_valid_spec).spec, status.autoscaling


# ------------------------------------------------------------------------------------------------ kopf wiring


def register_autoscaling(registry: kopf.OperatorRegistry, settings: OperatorSettings, credentials: Credentials) -> None:
    """Add the autoscaler's handlers. Register after the reconcile handlers: kopf runs startup handlers in order,
    and this one hooks the operator metrics into the `Fleet` those create."""

    @kopf.on.startup(registry=registry)
    async def start_autoscaling(memo: kopf.Memo, **_: Any) -> None:
        metrics = OperatorMetrics()

        def wake(namespace: str, name: str) -> None:
            fleet = getattr(memo, "fleet", None)
            if fleet is not None:
                fleet.wake(namespace, name)

        memo.operator_metrics = metrics
        memo.peering_state = PeeringState(settings.peering is not None, metrics.set_active).attach()
        memo.autoscaler = Autoscaler(
            KubeApi(credentials, timeout=settings.api_timeout_seconds),
            metrics_source(settings.prometheus_url),
            settings,
            metrics,
            wake=wake,
        )
        fleet = getattr(memo, "fleet", None)
        if fleet is not None:
            fleet.on_pass = metrics.observe_plan
        token = settings.alerts_token.get_secret_value() if settings.alerts_token is not None else None
        policy = AlertPolicy(
            step=settings.alert_step, max_step=settings.alert_max_step, ttl_seconds=settings.alert_ttl_seconds
        )
        peering_state: PeeringState = memo.peering_state
        app = create_operator_app(metrics, memo.autoscaler.on_alerts, token, policy,
                                  is_active=lambda: peering_state.active)
        memo.http_server = OperatorHttpServer(app, settings.http_host, settings.http_port)
        memo.metrics_server = OperatorHttpServer(create_metrics_app(metrics), settings.metrics_host,
                                                 settings.metrics_port, "/metrics", "METRICS_HOST/_METRICS_PORT")
        await memo.http_server.start()
        await memo.metrics_server.start()

    @kopf.on.cleanup(registry=registry)
    async def stop_autoscaling(memo: kopf.Memo, **_: Any) -> None:
        peering: PeeringState | None = getattr(memo, "peering_state", None)
        if peering is not None:
            peering.detach()
        for server_name in ("http_server", "metrics_server"):
            server: OperatorHttpServer | None = getattr(memo, server_name, None)
            if server is not None:
                await server.stop()
        autoscaler: Autoscaler | None = getattr(memo, "autoscaler", None)
        if autoscaler is not None:
            await autoscaler.aclose()
            await autoscaler.api.aclose()

    @kopf.timer(*CR, id="autoscale", interval=settings.autoscale_interval_seconds, registry=registry)
    async def autoscale(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        if wants_autoscaling(body):
            await memo.autoscaler.tick(namespace, name)

    @kopf.timer(*CR, id="wake", interval=settings.wake_interval_seconds, registry=registry)
    async def wake(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        at_zero = variants_at_zero(body)
        if at_zero:
            await memo.autoscaler.wake_check(namespace, name, at_zero)

    @kopf.on.event(*CR, id="operator-metrics", registry=registry)
    async def deployment_metrics(
        namespace: str, name: str, body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any
    ) -> None:
        if type == "DELETED":
            memo.operator_metrics.forget_deployment(namespace, name)
            memo.autoscaler.forget(namespace, name)
        else:
            memo.operator_metrics.observe_deployment(body)
