"""The worker's Prometheus metrics, under vLLM's names so one dashboard and one autoscaler serve both engines.

Request-level series (TTFT, inter-token latency, end-to-end latency, token counters, finished reasons) are
observed by the server as it streams, so they include everything a client sees (queueing, injected faults).
Engine-level series (queue sizes, KV-cache use, preemptions, prefix-cache and speculative-decoding counters,
the latter only when the engine speculates) are read from
`EngineClient.stats()` at scrape time. `llmfleet:*` series carry what the fleet needs beyond vLLM's set:
drain state, in-flight requests, the remaining-tokens estimate, and request/error counters for canary analysis.
With LoRA adapters, vLLM's `vllm:lora_requests_info` (a gauge whose labels list the adapters of running and
waiting requests and the slot count; its value is the scrape time, as vLLM sets it) and
`llmfleet:lora_loads_total` / `llmfleet:lora_evictions_total` (adapters put into / evicted from a slot).

Each `WorkerMetrics` owns its own `CollectorRegistry`: no module-level registry, so tests and several apps in one
process never collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from worker.core.request import FinishReason
from worker.engine.protocol import EngineStats

# vLLM v1's buckets (vllm/v1/metrics/loggers.py); ITL gains three finer buckets for fast CPU decode steps.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Values of the `code` label of llmfleet:request_errors_total besides HTTP status codes (failures after a 200
# stream has started, or the client going away).
STREAM_ABORTED = "stream_aborted"  # the server aborted a started request: deadline or drain timeout
STREAM_ERROR = "stream_error"  # the engine failed after the response had started
CLIENT_DISCONNECT = "client_disconnect"


@dataclass(frozen=True)
class ServerGauges:
    draining: bool
    inflight: int
    remaining_tokens: int


class _Family:
    @staticmethod
    def gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model], value)
        return family

    @staticmethod
    def counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model], value)
        return family


class _EngineCollector:
    """vLLM's engine-level series, read at scrape time from the engine's snapshot."""

    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats]) -> None:
        self._model = model_name
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats, m = self._engine_stats(), self._model
        yield _Family.gauge(
            "vllm:num_requests_running", "Requests in the engine's running batch.", m, stats.num_running
        )
        yield _Family.gauge(
            "vllm:num_requests_waiting", "Requests waiting in the engine's queue.", m, stats.num_waiting
        )
        yield _Family.gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1 (1 = full).", m, stats.kv_cache_usage)
        yield _Family.counter("vllm:num_preemptions", "Cumulative preemptions.", m, stats.num_preemptions_total)
        yield _Family.counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            m,
            stats.prefix_cache_queries_total,
        )
        yield _Family.counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", m, stats.prefix_cache_hits_total
        )
        spec = stats.spec_decode
        if spec is not None:  # as vLLM: the spec_decode series exist only when the engine speculates
            yield _Family.counter(
                "vllm:spec_decode_num_drafts", "Requests' steps that verified drafts.", m, spec.num_drafts
            )
            yield _Family.counter(
                "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", m, spec.num_draft_tokens
            )
            yield _Family.counter(
                "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, spec.num_accepted_tokens
            )
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft.",
                labels=["model_name", "position"],
            )
            for position, value in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([m, str(position)], value)
            yield per_pos
        lora = stats.lora
        if lora is not None:  # as vLLM: only when the engine serves adapters
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on LoRA requests (labels: adapters of running and waiting requests, slots).",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            info.add_metric([",".join(lora.running), ",".join(lora.waiting), str(lora.max_loras)], time.time())
            yield info


class _LoraCollector:
    """llmfleet's adapter slot counters, from the engine's snapshot (nothing when it serves no adapters)."""

    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats]) -> None:
        self._model = model_name
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        lora = self._engine_stats().lora
        if lora is None:
            return
        m = self._model
        yield _Family.counter("llmfleet:lora_loads", "LoRA adapters loaded into a slot.", m, lora.loads_total)
        yield _Family.counter(
            "llmfleet:lora_evictions",
            "Idle LoRA adapters evicted from their slot (least recently used) to make room for another.",
            m,
            lora.evictions_total,
        )


class _ServerCollector:
    """llmfleet's scrape-time series: drain state, in-flight requests, remaining-tokens estimate."""

    def __init__(self, model_name: str, server_gauges: Callable[[], ServerGauges]) -> None:
        self._model = model_name
        self._server_gauges = server_gauges

    def collect(self) -> Iterator[Metric]:
        server, m = self._server_gauges(), self._model
        yield _Family.gauge(
            "llmfleet:draining", "1 while the worker drains (lame duck), else 0.", m, int(server.draining)
        )
        yield _Family.gauge(
            "llmfleet:inflight_requests", "Generation requests the server is serving.", m, server.inflight
        )
        yield _Family.gauge(
            "llmfleet:remaining_tokens_estimate",
            "Sum of the remaining max_tokens of in-flight requests (how long a drain may take).",
            m,
            server.remaining_tokens,
        )


class _WithoutCreated:
    """The registry's metrics without the `*_created` samples prometheus-client adds (vLLM exports none; they
    only add series). Filtering here avoids prometheus-client's process-wide switch."""

    def __init__(self, registry: Collector) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class WorkerMetrics:
    """`engine_registry`: a backend that exports vLLM's series itself (the vLLM backend) passes its registry;
    then ours under vLLM's names are left out of `/metrics` (one family must not appear twice) and only the
    `llmfleet:*` series are added to the backend's."""

    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], EngineStats],
        server_gauges: Callable[[], ServerGauges],
        engine_registry: Collector | None = None,
    ) -> None:
        self.registry = CollectorRegistry()  # llmfleet:*
        self.vllm_registry = CollectorRegistry()  # vllm:* (ours)
        self._engine_registry = engine_registry
        label = ["model_name"]
        reg, vreg = self.registry, self.vllm_registry
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            label,
            registry=vreg,
            buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive outputs of a request.",
            label,
            registry=vreg,
            buckets=ITL_BUCKETS,
        ).labels(model_name)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from request arrival to its end.",
            label,
            registry=vreg,
            buckets=E2E_BUCKETS,
        ).labels(model_name)
        self._prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", label, registry=vreg).labels(
            model_name
        )
        self._generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", label, registry=vreg).labels(
            model_name
        )
        success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=vreg,
        )
        self._success = {r: success.labels(model_name, r.value) for r in FinishReason}
        vreg.register(_EngineCollector(model_name, engine_stats))
        self._requests = Counter(
            "llmfleet:requests", "Generation requests received (any outcome).", label, registry=reg
        ).labels(model_name)
        self._errors = Counter(
            "llmfleet:request_errors",
            "Failed generation requests by HTTP status code, or stream_aborted / stream_error / client_disconnect "
            "for failures after the response started.",
            ["model_name", "code"],
            registry=reg,
        )
        self._model = model_name
        reg.register(_ServerCollector(model_name, server_gauges))
        reg.register(_LoraCollector(model_name, engine_stats))

    def request_received(self) -> None:
        self._requests.inc()

    def error(self, code: int | str) -> None:
        self._errors.labels(self._model, str(code)).inc()

    def first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self._ttft.observe(ttft_s)
        self._prompt_tokens.inc(prompt_tokens)

    def token_gap(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def generated(self, num_tokens: int) -> None:
        self._generation_tokens.inc(num_tokens)

    def finished(self, reason: FinishReason, e2e_s: float) -> None:
        self._success[reason].inc()
        self._e2e.observe(e2e_s)

    def render(self) -> bytes:
        ours = generate_latest(_WithoutCreated(self.registry))
        if self._engine_registry is not None:  # the backend's own series, unchanged
            return ours + generate_latest(self._engine_registry)
        return ours + generate_latest(_WithoutCreated(self.vllm_registry))
