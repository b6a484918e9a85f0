"""The operator's own Prometheus series, served at `GET /metrics` by `http_server`.

Why it exists: the chart's dashboard and alerts (charts/llmfleet/README.md, "Operator metrics (contract)") read
these exact names, so they are defined in one place, each object with its own `CollectorRegistry` (no global
registry, no module-level state: several operators can live in one test process). Where the numbers come from:

- replicas, ready, desired per variant and the canary weight: the InferenceDeployment's status, from every watch
  event of the CR (`observe_deployment`; a deleted CR's series are removed by `forget_deployment`);
- analysis verdicts and finished rollouts: the Events of each executed plan (`observe_plan`), the one place where
  each check and each rollout outcome appears exactly once;
- scale decisions: the autoscaler, once per replica change it persisted (`count_scale_decision`);
- whether this replica works or stands by (kopf peering): `set_active`, from `peering_state`; a replica that
  pauses drops its CR gauges, so only the working replica exports them;
- Alertmanager deliveries: the HTTP server, per POST /alerts (`count_alert_delivery`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from controllers import EmitEvent, Plan
from controllers.reasons import Reason

AlertResult = Literal["accepted", "ignored", "unauthorized", "standby"]
# Plan Event reasons -> the `result` label of llmfleet_operator_rollouts_total (controllers/rollout.py emits them).
ROLLOUT_RESULTS = {
    Reason.CANARY_PROMOTED: "promoted",
    Reason.CANARY_ROLLED_BACK: "rolled_back",
    Reason.CANARY_SUPERSEDED: "superseded",
    Reason.CANARY_ABORTED: "aborted",
}
# Plan Event reasons -> the `verdict` label of llmfleet_operator_analysis_verdicts_total.
VERDICTS = {Reason.ANALYSIS_PASS: "pass", Reason.ANALYSIS_FAIL: "fail", Reason.ANALYSIS_INCONCLUSIVE: "inconclusive"}


class OperatorMetrics:
    """The contract's series in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        variant = ["namespace", "deployment", "variant"]
        self.replicas = Gauge(
            "llmfleet_operator_replicas", "Worker pods that exist (not terminating).", variant, registry=self.registry
        )
        self.ready_replicas = Gauge(
            "llmfleet_operator_ready_replicas", "Worker pods that are Ready.", variant, registry=self.registry
        )
        self.desired_replicas = Gauge(
            "llmfleet_operator_desired_replicas",
            "Pods the operator wants (autoscaler or spec).",
            variant,
            registry=self.registry,
        )
        self.canary_weight = Gauge(
            "llmfleet_operator_canary_weight",
            "Percent of traffic on the canary revision, 0 without a rollout.",
            ["namespace", "deployment"],
            registry=self.registry,
        )
        self.analysis_verdicts = Counter(
            "llmfleet_operator_analysis_verdicts",
            "Canary analysis checks by verdict.",
            ["namespace", "deployment", "verdict"],
            registry=self.registry,
        )
        self.rollouts = Counter(
            "llmfleet_operator_rollouts",
            "Finished rollouts by result.",
            ["namespace", "deployment", "result"],
            registry=self.registry,
        )
        self.scale_decisions = Counter(
            "llmfleet_operator_scale_decisions",
            "Autoscaler replica changes by direction and trigger.",
            [*variant, "direction", "source"],
            registry=self.registry,
        )
        self.alerts_received = Counter(
            "llmfleet_operator_alerts_received",
            "Alertmanager webhook deliveries by result.",
            ["result"],
            registry=self.registry,
        )
        # (namespace, deployment) -> variants whose gauges are set, to remove series of variants that went away.
        self.active = Gauge(
            "llmfleet_operator_active",
            "1 while this operator replica works, 0 while it stands by (kopf peering).",
            registry=self.registry,
        )
        self._variants: dict[tuple[str, str], set[str]] = {}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def observe_deployment(self, body: Mapping[str, Any]) -> None:
        """Set the gauges from an InferenceDeployment as the API returns it (status as last written)."""
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        status = body.get("status") or {}
        seen: set[str] = set()
        for entry in status.get("variants") or []:
            variant = str(entry.get("name") or "")
            if not variant:
                continue
            seen.add(variant)
            labels = (namespace, name, variant)
            self.replicas.labels(*labels).set(_number(entry.get("replicas")))
            self.ready_replicas.labels(*labels).set(_number(entry.get("readyReplicas")))
            self.desired_replicas.labels(*labels).set(_number(entry.get("desiredReplicas")))
        for gone in self._variants.get((namespace, name), set()) - seen:
            self._remove_variant(namespace, name, gone)
        self._variants[(namespace, name)] = seen
        self.canary_weight.labels(namespace, name).set(_number((status.get("rollout") or {}).get("canaryWeight")))

    def forget_deployment(self, namespace: str, name: str) -> None:
        """Remove the gauges of a deleted InferenceDeployment (counters stay: they are history)."""
        for variant in self._variants.pop((namespace, name), set()):
            self._remove_variant(namespace, name, variant)
        try:
            self.canary_weight.remove(namespace, name)
        except KeyError:
            pass

    def set_active(self, active: bool) -> None:
        """This replica started or stopped working: a standby exports no CR gauges (they would go stale)."""
        self.active.set(1 if active else 0)
        if not active:
            for namespace, name in list(self._variants):
                self.forget_deployment(namespace, name)

    def observe_plan(self, resource: Mapping[str, Any], plan: Plan) -> None:
        """Count the analysis checks and finished rollouts announced by an executed plan's Events."""
        meta = resource.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        for event in plan.of_type(EmitEvent):
            if event.reason in VERDICTS:
                self.analysis_verdicts.labels(namespace, name, VERDICTS[event.reason]).inc()
            elif event.reason in ROLLOUT_RESULTS:
                self.rollouts.labels(namespace, name, ROLLOUT_RESULTS[event.reason]).inc()

    def count_scale_decision(
        self,
        namespace: str,
        name: str,
        variant: str,
        direction: Literal["up", "down"],
        source: Literal["timer", "alert"],
    ) -> None:
        self.scale_decisions.labels(namespace, name, variant, direction, source).inc()

    def count_alert_delivery(self, result: AlertResult) -> None:
        self.alerts_received.labels(result).inc()

    def _remove_variant(self, namespace: str, name: str, variant: str) -> None:
        for gauge in (self.replicas, self.ready_replicas, self.desired_replicas):
            try:
                gauge.remove(namespace, name, variant)
            except KeyError:
                pass


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
