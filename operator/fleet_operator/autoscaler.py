"""The autoscaler in the operator: fetch a deployment's inputs, call `controllers.autoscaling_plan`, persist it.

Why it exists: every decision is pure and lives in `controllers` (`controllers.autoscaling.decide` sizes one
variant; `controllers.autoscaling_plan` counts pods, applies alert intents, bounds the status records and builds
the status patch and Events); this is its shell: it only fetches and writes. Every InferenceDeployment
gets a kopf timer (`autoscale_interval_seconds`, default 10 s) and Alertmanager alerts trigger the same
evaluation at once (`Autoscaler.on_alerts`, called by `http_server`). A deployment with a variant at zero also
checks, every `wake_interval_seconds` (2 s), whether the gateway holds requests for it, and is evaluated at once
when it does (`Autoscaler.wake_check`): a held request waits for a pod start, not for the next tick. One
evaluation of a deployment:

1. read the CR and its pods fresh from the API server (a deleted or deleting CR is left to the reconcile loop;
   while an edit is invalid, the last valid spec is used, as everywhere);
2. per autoscaled variant: the pods (`controllers.autoscaling_plan.pod_counts`: ready with their Ready
   transition time, starting with their creation time, draining/terminating apart), the metrics
   (`metrics_source`: Prometheus when configured, else the ready pods' own /metrics), the gateway's requests held
   at zero (`gateway_url`'s `GET /internal/queued`, else Prometheus's `llmfleet_gateway_queued_at_zero`), and the
   state persisted in `status.autoscaling`. Any failure to measure is missing data, which never scales down;
3. `controllers.autoscaling_plan.evaluate_variants` (pure), then a merge patch of `status.autoscaling` only,
   guarded by the CR's resourceVersion (a conflict re-reads the CR and decides again on the same measurements),
   an Event with the decision's reason when a variant's size changes, and a wake-up of the reconcile loop so that
   pods follow at once (the planner reads the size from `status.autoscaling.variants[].desiredReplicas`).

`register_autoscaling` adds the kopf handlers: start/stop of the autoscaler, the operator metrics, the public HTTP
server (`/alerts`, applied only while kopf peering keeps this replica active) and the internal metrics server; the
timer; and a CR event handler that keeps the replica gauges current.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import kopf

from controllers import Plan
from controllers.autoscaling import GatewaySample
from controllers.autoscaling_plan import (
    ScaleIntent,
    VariantInputs,
    VariantOutcome,
    autoscaling_patch,
    evaluate_variants,
    owned,
    pod_counts,
    scale_event,
    variants_at_zero,
    wants_autoscaling,
)
from controllers.pods import label_selector
from controllers.running_spec import DeploymentView
from crds.models import (
    GROUP,
    PLURAL,
    VERSION,
    AutoscalingStatus,
    DecisionTrigger,
    InferenceDeploymentSpec,
)
from fleet_operator.alerts import AlertPolicy, ParsedAlerts
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
CONFLICT_ATTEMPTS = 4

# ------------------------------------------------------------------------------------------------------ inputs


def queued_by_variant(answer: Any, namespace: str, deployment: str) -> dict[str, float]:
    """The gateway's `GET /internal/queued` answer -> queued requests per variant of one deployment (a variant
    the gateway does not list has nothing queued). Raises ValueError on an answer of another shape."""
    if not isinstance(answer, Mapping) or not isinstance(answer.get("queued"), list):
        raise ValueError("expected {'queued': [{namespace, deployment, variant, queued}, ...]}")
    out: dict[str, float] = {}
    for row in answer["queued"]:
        if not isinstance(row, Mapping):
            raise ValueError(f"a queued row is not an object: {row!r}")
        if row.get("namespace") == namespace and row.get("deployment") == deployment:
            count = float(row.get("queued") or 0)
            if not math.isfinite(count) or count < 0:
                raise ValueError(f"bad queued count {row.get('queued')!r}")
            variant = str(row.get("variant"))
            out[variant] = out.get(variant, 0.0) + count
    return out


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
        log.info(
            "%s/%s: requests held at zero (%s): waking",
            namespace,
            name,
            ", ".join(f"{v}: {queued.get(v):g}" for v in at_zero if queued.get(v)),
        )
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
            log.info(
                "alerts name no InferenceDeployment this operator serves: %s",
                ", ".join(sorted({f"{i.alert} -> {i.deployment}" for i in parsed.intents})),
            )
        for (namespace, name), intents in targets.items():
            outcomes = await self.evaluate(namespace, name, intents)
            if not outcomes:
                log.info(
                    "%s/%s: alerts %s name no autoscaled variant",
                    namespace,
                    name,
                    ", ".join(sorted({i.alert for i in intents})),
                )

    async def evaluate(self, namespace: str, name: str, intents: Sequence[ScaleIntent] = ()) -> list[VariantOutcome]:
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
                evaluation = evaluate_variants(
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
                for variant, why in evaluation.skipped:
                    log.info("%s/%s: variant %s not autoscaled: %s", namespace, name, variant, why)
                outcomes = list(evaluation.outcomes)
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
            self.metrics.count_scale_decision(
                namespace,
                name,
                outcome.variant,
                "up" if outcome.decision.direction == "up" else "down",
                "alert" if outcome.trigger == DecisionTrigger.ALERT else "timer",
            )
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
                response = await self._http.get(
                    self.settings.gateway_url.rstrip("/") + "/internal/queued", headers=headers
                )
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
    """(the spec the autoscaler acts on, its persisted state), from one read of the CR (`DeploymentView`). The
    spec is the one the fleet runs (the last valid one while an edit is invalid); None when the CR is gone, being
    deleted, or was never valid. An unreadable status starts over, as the reconcile loop does."""
    if resource is None:
        return None, AutoscalingStatus()
    view = DeploymentView.of(resource)
    if view.deleting:
        return None, AutoscalingStatus()
    return view.running.spec, view.status.autoscaling


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
        app = create_operator_app(
            metrics, memo.autoscaler.on_alerts, token, policy, is_active=lambda: peering_state.active
        )
        memo.http_server = OperatorHttpServer(app, settings.http_host, settings.http_port)
        memo.metrics_server = OperatorHttpServer(
            create_metrics_app(metrics),
            settings.metrics_host,
            settings.metrics_port,
            "/metrics",
            "METRICS_HOST/_METRICS_PORT",
        )
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

    @kopf.timer(*CR, id="autoscale", interval=settings.autoscale_interval_seconds, registry=registry)  # type: ignore[arg-type]  # kopf types handlers with every kwarg; ours take what they use
    async def autoscale(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        if wants_autoscaling(body):
            await memo.autoscaler.tick(namespace, name)

    @kopf.timer(*CR, id="wake", interval=settings.wake_interval_seconds, registry=registry)  # type: ignore[arg-type]  # kopf types handlers with every kwarg; ours take what they use
    async def wake(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        at_zero = variants_at_zero(body)
        if at_zero:
            await memo.autoscaler.wake_check(namespace, name, at_zero)

    @kopf.on.event(*CR, id="operator-metrics", registry=registry)  # type: ignore[arg-type]  # kopf types handlers with every kwarg; ours take what they use
    async def deployment_metrics(
        namespace: str, name: str, body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any
    ) -> None:
        if type == "DELETED":
            memo.operator_metrics.forget_deployment(namespace, name)
            memo.autoscaler.forget(namespace, name)
        else:
            memo.operator_metrics.observe_deployment(body)
