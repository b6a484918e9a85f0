"""The gateway's Prometheus metrics, on a registry owned by one app (no module-level state).

Counters and histograms are updated on the request path; live gauges (per-backend outstanding, requests held
at zero, in-flight, admission queue, asyncio tasks, upstream connections) are read from the app's state at scrape
time by a custom collector, so a pod that disappears leaves no stale series behind.

Labels stay bounded: `model` is a served model name (or `unknown` before one is resolved), never the client's raw
`model` string; `adapter` (requests and output tokens only) is a LoRA adapter the deployment declares in
`spec.adapters` (at most 256 per deployment), "" for the base model. The latency histograms carry no adapter label:
their buckets times every adapter would be the one series explosion here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class LiveGauges:
    """Callables returning the live values the collector exports."""

    outstanding: Callable[[], Iterable[tuple[str, str, str, int]]]  # (backend, deployment, variant, n)
    queued_at_zero: Callable[[], Iterable[tuple[str, str, str, int]]]  # (namespace, deployment, variant, n)
    in_flight: Callable[[], int]
    admission_queued: Callable[[], int]
    asyncio_tasks: Callable[[], int]
    upstream_connections: Callable[[], int]
    ready_backends: Callable[[], int]


class _LiveCollector(Collector):
    def __init__(self, live: LiveGauges) -> None:
        self._live = live

    def collect(self) -> Iterable[Metric]:
        out = GaugeMetricFamily(
            "llmfleet_gateway_backend_outstanding_requests",
            "Requests the gateway has outstanding at each backend pod.",
            labels=["backend", "deployment", "variant"],
        )
        for backend, dep, variant, n in self._live.outstanding():
            out.add_metric([backend, dep, variant], n)
        yield out
        held = GaugeMetricFamily(
            "llmfleet_gateway_queued_at_zero",
            "Requests held because their variant has no ready pod (scale-from-zero demand).",
            labels=["namespace", "deployment", "variant"],
        )
        for ns, dep, variant, n in self._live.queued_at_zero():
            held.add_metric([ns, dep, variant], n)
        yield held
        for name, doc, fn in (
            ("llmfleet_gateway_in_flight_requests", "Requests admitted and not yet finished.", self._live.in_flight),
            (
                "llmfleet_gateway_admission_queued",
                "Requests waiting for admission (saturation).",
                self._live.admission_queued,
            ),
            (
                "llmfleet_gateway_asyncio_tasks",
                "asyncio tasks alive in the gateway's event loop.",
                self._live.asyncio_tasks,
            ),
            (
                "llmfleet_gateway_upstream_connections",
                "Open connections in the upstream pool.",
                self._live.upstream_connections,
            ),
            ("llmfleet_gateway_ready_backends", "Backend pods the gateway can route to.", self._live.ready_backends),
        ):
            yield GaugeMetricFamily(name, doc, value=fn())


class GatewayMetrics:
    """All metric objects of one gateway app."""

    def __init__(self, live: LiveGauges) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        # `adapter` (requests and output tokens): a LoRA adapter the deployment declares, "" for the base model;
        # never the client's raw `model` (bounded by spec.adapters).
        self.requests = Counter(
            "llmfleet_gateway_requests",
            'Requests answered, by served model, LoRA adapter ("" for the base model) and HTTP status.',
            ["model", "adapter", "status"],
            registry=r,
        )
        self.errors = Counter(
            "llmfleet_gateway_errors",
            "Requests that failed at or behind the gateway, by kind "
            "(connect, upstream_status, timeout, midstream, no_backend, adapter_not_ready, client_disconnect).",
            ["model", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "llmfleet_gateway_retries",
            "Upstream attempts retried on another pod (before the first byte), by reason (connect, reset, 429, 503, "
            "adapter_missing).",
            ["model", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "llmfleet_gateway_time_to_first_token_seconds",
            "Time from the request's arrival to the first streamed chunk sent to the client.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "llmfleet_gateway_inter_token_latency_seconds",
            "Mean time per output token after the first of each stream as the client received it (one observation "
            "per stream: its first to last chunk over the worker's completion tokens - 1).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rate_limited = Counter(
            "llmfleet_gateway_rate_limit_rejections",
            'Requests rejected with 429 by per-key limits or a LoRA adapter\'s shared limit (limit="adapter tokens").',
            ["tier", "limit"],
            registry=r,
        )
        self.shed = Counter(
            "llmfleet_gateway_shed",
            "Requests refused with 503 by admission or the scale-to-zero hold.",
            ["tier", "reason"],
            registry=r,
        )
        self.output_tokens = Counter(
            "llmfleet_gateway_output_tokens",
            "Output tokens the workers reported (usage) for answers passed to clients, by served model and LoRA "
            'adapter ("" for the base model).',
            ["model", "adapter"],
            registry=r,
        )
        r.register(_LiveCollector(live))
