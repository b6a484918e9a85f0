"""Where the operator's numbers come from: Prometheus when one is configured, else the pods' own /metrics.

Why it exists: the autoscaler (`controllers.autoscaling`) and the canary analysis (`controllers.analysis`) are pure
functions over metric samples; this module is the one place that fetches those samples. `MetricsSource` is the
interface; `PrometheusSource` queries Prometheus with `prometheus-api-client` and `ScrapeSource` scrapes the worker
pods directly with httpx. Both answer the same two questions with the same types:

- `load(selector, targets)` -> `LoadSample`: the autoscaling signals of one (namespace, deployment, variant).
- `revision(selector, targets, window_s)` -> `controllers.analysis.RevisionSample`: one revision's TTFT/ITL p95,
  requests and errors over the analysis interval.

Every sample carries `observed_at` (unix seconds of the oldest data used) and `stale` (data missing or older than
`max_age_s`). Errors never reach the caller: an unreachable Prometheus or pod, a bad answer or a parse failure
becomes missing values plus an `error` text, so "no data" can never be mistaken for "no load" (the autoscaler
never scales down on missing data, the analysis never passes on it).

Pod labels `llmfleet.io/{deployment,variant,revision}` appear in Prometheus as the target labels `deployment`,
`variant`, `revision` (plus `namespace`, `pod`): `file_sd_targets` renders them for the local fleet (localkube has
no service discovery Prometheus could use, so the operator or `llmfleet up` writes a file_sd JSON of the ready
pods and `local_prometheus_config` points Prometheus at it); on a real cluster the chart's PodMonitor relabels
the pod labels the same way (docs/canary.md shows both). The PromQL per signal, with S the label selector
`{namespace="...",deployment="...",variant="..."}` and R = `... unless on(instance) (llmfleet:draining{S} == 1)`
(draining pods are leaving: neither capacity nor demand):

    ready pods          count(vllm:num_requests_waiting{S} R)
    queue per pod       sum(vllm:num_requests_waiting{S} R) / ready pods
    KV-cache usage      avg(vllm:kv_cache_usage_perc{S} R)
    running requests    sum(vllm:num_requests_running{S} R)
    TTFT p95            histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{S}[W])))
    data time           min(timestamp(vllm:num_requests_waiting{S} R))

and per revision (S also holds `revision="..."`; W = the analysis interval, at least `min_window_s`):

    TTFT p95   histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{S}[W])))
    ITL p95    histogram_quantile(0.95, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{S}[W])))
    requests   with C = llmfleet:requests_total{S}: COUNT(C) and on() count(C)
    errors     COUNT(llmfleet:request_errors_total{S,code=~"5..|stream_aborted|stream_error"})
               where COUNT(X) = (sum(increase(X[W]) and X offset W) or vector(0)) + (sum(X unless X offset W) or
               vector(0)): a labelled counter is born at its first event, which `increase` cannot see, so series
               born inside the window count with their whole value. Requests and errors are counted alike, so
               a fresh canary's error rate is not overstated; no error series is 0 errors, no request series
               at all is missing data (the check is inconclusive)
    pods       count(llmfleet:requests_total{S})
    data time  min(timestamp(llmfleet:requests_total{S}))

`ScrapeSource` computes the same numbers from two scrapes: gauges from the latest scrape, counters and histogram
buckets as increases since this source's previous scrape of the same pod for the same purpose (load and analysis
keep separate baselines, so one never shortens the other's interval), quantiles with
`controllers.analysis.histogram_quantile`. A pod's first scrape only sets its baseline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx
import requests
from prometheus_api_client import PrometheusConnect
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field
from urllib3.util.retry import Retry

from controllers.analysis import (
    RevisionSample,
    bucket_deltas,
    counter_delta,
    histogram_quantile,
    merge_buckets,
)
from controllers.autoscaling import MetricsSample
from crds.pods import (
    LABEL_DEPLOYMENT,
    LABEL_REVISION,
    LABEL_VARIANT,
    WORKER_PORT,
    host_port,
    is_draining,
    is_ready,
    named_port,
)

log = logging.getLogger(__name__)

QUANTILE = 0.95
# Error codes of llmfleet:request_errors_total that count against a canary: server errors and streams the server
# aborted or failed after they started. 4xx (client mistakes) and client disconnects are not the canary's fault.
ERROR_CODES = r"5..|stream_aborted|stream_error"

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
REQUESTS = "llmfleet:requests_total"
ERRORS = "llmfleet:request_errors_total"
DRAINING_GAUGE = "llmfleet:draining"


# ------------------------------------------------------------------------------------------------------- types


@dataclass(frozen=True)
class Selector:
    """Which pods a sample is about: one deployment's variant (autoscaling) or revision (canary analysis)."""

    namespace: str
    deployment: str
    variant: str | None = None
    revision: str | None = None

    def labels(self) -> dict[str, str]:
        """The Prometheus target labels this selector matches."""
        labels = {"namespace": self.namespace, "deployment": self.deployment}
        if self.variant is not None:
            labels["variant"] = self.variant
        if self.revision is not None:
            labels["revision"] = self.revision
        return labels

    def matches(self, target: ScrapeTarget) -> bool:
        return (
            target.namespace == self.namespace
            and target.deployment == self.deployment
            and (self.variant is None or target.variant == self.variant)
            and (self.revision is None or target.revision == self.revision)
        )

    def describe(self) -> str:
        return "/".join(v for v in (self.namespace, self.deployment, self.variant, self.revision) if v is not None)


@dataclass(frozen=True)
class ScrapeTarget:
    """A worker pod whose /metrics can be read: its address and the labels Prometheus gives its series."""

    namespace: str
    pod: str
    address: str  # host:port
    deployment: str
    variant: str
    revision: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.address}"


class LoadSample(BaseModel):
    """Autoscaling signals of one variant; a value is None when it could not be measured."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    observed_at: float | None = Field(None, description="Unix seconds of the oldest data used; None = no data.")
    stale: bool = Field(True, description="No data, or data older than the source's max_age_s.")
    ready_pods: int = Field(0, ge=0, description="Pods the averages were taken over.")
    queue_depth_per_replica: float | None = Field(None, ge=0)
    kv_cache_utilization: float | None = Field(None, ge=0, le=1)
    ttft_p95_seconds: float | None = Field(None, ge=0)
    running_requests: float | None = Field(None, ge=0)
    waiting_requests: float | None = Field(None, ge=0)
    error: str | None = Field(None, description="Why data is missing or partial.")

    def to_autoscaling(self) -> MetricsSample | None:
        """The autoscaler's input, or None when there is nothing to decide on (no data, stale, or no pod)."""
        if self.observed_at is None or self.stale or self.ready_pods == 0:
            return None
        return MetricsSample(
            observed_at=self.observed_at,
            ready_pods=self.ready_pods,
            queue_depth_per_replica=self.queue_depth_per_replica,
            kv_cache_utilization=self.kv_cache_utilization,
            ttft_p95_seconds=self.ttft_p95_seconds,
            running_requests=self.running_requests,
            waiting_requests=self.waiting_requests,
        )


@runtime_checkable
class MetricsSource(Protocol):
    """Fetches samples for the autoscaler and the canary analysis; never raises on I/O or data errors.

    `targets` are the deployment's ready pods as the operator sees them (`scrape_targets`); sources that discover
    pods themselves (Prometheus) may ignore them.
    """

    async def load(self, selector: Selector, targets: Sequence[ScrapeTarget]) -> LoadSample: ...

    async def revision(
        self, selector: Selector, targets: Sequence[ScrapeTarget], window_s: float
    ) -> RevisionSample: ...

    async def aclose(self) -> None: ...


# ----------------------------------------------------------------------------------------- targets and file_sd


def _port(pod: Mapping[str, Any]) -> int:
    """The container port named `http`, else the `prometheus.io/port` annotation, else the worker's port."""
    named = named_port(pod)
    if named is not None:
        return named
    annotated = ((pod.get("metadata") or {}).get("annotations") or {}).get("prometheus.io/port")
    return int(str(annotated)) if str(annotated or "").isdigit() else WORKER_PORT


def scrape_targets(pods: Iterable[Mapping[str, Any]]) -> list[ScrapeTarget]:
    """The pods whose metrics count: Running, Ready, with an IP and llmfleet labels, not being deleted and not
    marked draining (leaving pods are neither capacity nor demand). Sorted by namespace and name."""
    targets = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        status = pod.get("status") or {}
        wanted = (
            is_ready(pod)
            and status.get("phase") == "Running"
            and status.get("podIP")
            and not meta.get("deletionTimestamp")
            and not is_draining(pod)
            and all(labels.get(k) for k in (LABEL_DEPLOYMENT, LABEL_VARIANT, LABEL_REVISION))
        )
        if not wanted:
            continue
        targets.append(
            ScrapeTarget(
                namespace=meta.get("namespace") or "default",
                pod=meta["name"],
                address=host_port(status["podIP"], _port(pod)),
                deployment=labels[LABEL_DEPLOYMENT],
                variant=labels[LABEL_VARIANT],
                revision=labels[LABEL_REVISION],
            )
        )
    return sorted(targets, key=lambda t: (t.namespace, t.pod))


def file_sd_targets(targets: Iterable[ScrapeTarget]) -> list[dict[str, Any]]:
    """Prometheus file_sd JSON: one group per pod, carrying the labels the PromQL above selects on."""
    return [
        {
            "targets": [t.address],
            "labels": {
                "namespace": t.namespace,
                "pod": t.pod,
                "deployment": t.deployment,
                "variant": t.variant,
                "revision": t.revision,
            },
        }
        for t in sorted(targets, key=lambda t: (t.namespace, t.pod))
    ]


def write_file_sd(path: Path, targets: Iterable[ScrapeTarget]) -> bool:
    """Write the file_sd JSON atomically (Prometheus must never read half a file); True when it changed."""
    text = json.dumps(file_sd_targets(targets), indent=1, sort_keys=True) + "\n"
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".file-sd-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def local_prometheus_config(
    file_sd_path: Path | str, *, scrape_interval_s: float = 5, rule_files: Sequence[str] = ()
) -> dict[str, Any]:
    """prometheus.yml for the local fleet: scrape the pods listed in the file_sd JSON (see `write_file_sd`)."""
    interval = f"{scrape_interval_s:g}s"
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": "llmfleet-workers",
                "metrics_path": "/metrics",
                "scrape_timeout": interval,
                "file_sd_configs": [{"files": [str(file_sd_path)], "refresh_interval": interval}],
            }
        ],
    }
    if rule_files:
        config["rule_files"] = list(rule_files)
    return config


# ------------------------------------------------------------------------------------------------- Prometheus


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def promql_selector(labels: Mapping[str, str], extra: str = "") -> str:
    """`{k="v",...}` with values escaped; `extra` is appended verbatim (e.g. a regex matcher)."""
    parts = [f'{key}="{_escape(value)}"' for key, value in labels.items()]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}"


def _window(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds))}s"


def load_queries(selector: Selector, ttft_window_s: float) -> dict[str, str]:
    """The PromQL of each autoscaling signal (see the module docstring)."""
    s = promql_selector(selector.labels())
    serving = f"unless on(instance) ({DRAINING_GAUGE}{s} == 1)"
    return {
        "ready_pods": f"count({WAITING}{s} {serving})",
        "waiting": f"sum({WAITING}{s} {serving})",
        "running": f"sum({RUNNING}{s} {serving})",
        "kv": f"avg({KV_USAGE}{s} {serving})",
        "ttft_p95": f"histogram_quantile({QUANTILE}, sum by (le) (rate({TTFT}_bucket{s}[{_window(ttft_window_s)}])))",
        "observed_at": f"min(timestamp({WAITING}{s} {serving}))",
    }


def window_count(series: str, w: str) -> str:
    """PromQL for how much the counters `series` grew over the window `w`, counting series born inside it whole.

    A labelled counter is born at its first event (an error code, a new pod's first requests), and `increase`
    needs two samples, so it would miss what came before a series' first scrape: a fresh canary's first errors,
    or its first requests. Series that existed a window ago count by `increase`; younger ones with their value.
    """
    return (
        f"(sum(increase({series}[{w}]) and {series} offset {w}) or vector(0))"
        f" + (sum({series} unless {series} offset {w}) or vector(0))"
    )


def revision_queries(selector: Selector, window_s: float) -> dict[str, str]:
    """The PromQL of each canary-analysis value (see the module docstring)."""
    labels = selector.labels()
    s = promql_selector(labels)
    errors = promql_selector(labels, f'code=~"{ERROR_CODES}"')
    w = _window(window_s)
    return {
        "ttft_p95": f"histogram_quantile({QUANTILE}, sum by (le) (rate({TTFT}_bucket{s}[{w}])))",
        "itl_p95": f"histogram_quantile({QUANTILE}, sum by (le) (rate({ITL}_bucket{s}[{w}])))",
        # Requests and errors are counted the same way, so their ratio is not skewed on a fresh canary.
        "requests": f"({window_count(f'{REQUESTS}{s}', w)}) and on() count({REQUESTS}{s})",
        "errors": window_count(f"{ERRORS}{errors}", w),
        "pods": f"count({REQUESTS}{s})",
        "observed_at": f"min(timestamp({REQUESTS}{s}))",
    }


def _scalar(result: Any) -> float | None:
    """The value of an aggregated instant-vector result: None for no series or NaN/Inf."""
    if not isinstance(result, list) or not result:
        return None
    value = float(result[0]["value"][1])
    return value if math.isfinite(value) else None


def _nonneg(value: float | None) -> float | None:
    """Clamp tiny negative float noise (e.g. from `increase`) to 0; keep None."""
    return None if value is None else max(value, 0.0)


class PrometheusSource:
    """Samples from Prometheus via `prometheus-api-client` (blocking; run in a worker thread)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        max_age_s: float = 60.0,
        ttft_window_s: float = 60.0,
        min_window_s: float = 20.0,
        clock: Callable[[], float] = time.time,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._session = requests.Session()
        # No retries inside one tick: a failed query is missing data now and is asked again on the next tick.
        self._client = PrometheusConnect(
            url=url.rstrip("/"),
            headers=dict(headers or {}) or None,
            retry=Retry(total=0),
            timeout=timeout_s,
            session=self._session,
        )
        self._timeout_s = timeout_s
        self.max_age_s = max_age_s
        self.ttft_window_s = ttft_window_s
        self.min_window_s = min_window_s
        self._clock = clock

    def _query_all(self, queries: Mapping[str, str]) -> tuple[dict[str, float | None], list[str]]:
        values: dict[str, float | None] = {}
        errors: list[str] = []
        for name, query in queries.items():
            try:
                values[name] = _scalar(self._client.custom_query(query, timeout=self._timeout_s))
            except Exception as error:  # noqa: BLE001 - any failure is missing data, never an exception upstream
                values[name] = None
                errors.append(f"{name}: {type(error).__name__}: {str(error)[:200]}")
        return values, errors

    async def _run(self, queries: Mapping[str, str]) -> tuple[dict[str, float | None], str | None, float]:
        values, errors = await asyncio.to_thread(self._query_all, queries)
        if errors:
            log.warning("Prometheus queries failed: %s", "; ".join(errors))
        return values, ("Prometheus: " + "; ".join(errors)) if errors else None, self._clock()

    def _freshness(self, observed_at: float | None, now: float) -> tuple[bool, str | None]:
        if observed_at is None:
            return True, "no series"
        age = now - observed_at
        if age > self.max_age_s:
            return True, f"newest complete data is {age:.0f}s old (max {self.max_age_s:g}s)"
        return False, None

    async def load(self, selector: Selector, targets: Sequence[ScrapeTarget]) -> LoadSample:
        values, error, now = await self._run(load_queries(selector, self.ttft_window_s))
        pods = int(values["ready_pods"] or 0)
        stale, why = self._freshness(values["observed_at"], now)
        waiting = _nonneg(values["waiting"])
        return LoadSample(
            observed_at=values["observed_at"],
            stale=stale,
            ready_pods=pods,
            queue_depth_per_replica=waiting / pods if waiting is not None and pods else None,
            kv_cache_utilization=min(values["kv"], 1.0) if values["kv"] is not None else None,
            ttft_p95_seconds=_nonneg(values["ttft_p95"]),
            running_requests=_nonneg(values["running"]),
            waiting_requests=waiting,
            error=_join(error, why if stale else None),
        )

    async def revision(self, selector: Selector, targets: Sequence[ScrapeTarget], window_s: float) -> RevisionSample:
        window = max(window_s, self.min_window_s)
        values, error, now = await self._run(revision_queries(selector, window))
        stale, why = self._freshness(values["observed_at"], now)
        return RevisionSample(
            ttft_p95_seconds=_nonneg(values["ttft_p95"]),
            itl_p95_seconds=_nonneg(values["itl_p95"]),
            requests=_nonneg(values["requests"]),
            errors=_nonneg(values["errors"]),
            pods=int(values["pods"]) if values["pods"] is not None else None,
            observed_at=values["observed_at"],
            stale=stale,
            error=_join(error, why if stale else None),
        )

    async def aclose(self) -> None:
        await asyncio.to_thread(self._session.close)


def _join(*parts: str | None) -> str | None:
    text = "; ".join(p for p in parts if p)
    return text[:2000] or None


# ------------------------------------------------------------------------------------------------ pod scraping


@dataclass(frozen=True)
class PodScrape:
    """What one scrape of a worker's /metrics holds for the fleet (summed over label sets such as model_name)."""

    at: float
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    draining: bool = False
    requests: float | None = None
    errors: float = 0.0
    ttft_buckets: dict[float, float] = field(default_factory=dict)
    itl_buckets: dict[float, float] = field(default_factory=dict)


def _add(current: float | None, value: float) -> float:
    return value if current is None else current + value


def parse_scrape(text: str, at: float) -> PodScrape:
    """The fleet's series from a Prometheus text exposition (raises ValueError on text that does not parse)."""
    waiting = running = requests = None
    kv_values: list[float] = []
    errors = 0.0
    draining = False
    ttft: dict[float, float] = {}
    itl: dict[float, float] = {}
    error_code = re.compile(ERROR_CODES)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == WAITING:
                waiting = _add(waiting, value)
            elif name == RUNNING:
                running = _add(running, value)
            elif name == KV_USAGE:
                kv_values.append(value)
            elif name == DRAINING_GAUGE:
                draining = draining or value >= 1
            elif name == REQUESTS:
                requests = _add(requests, value)
            elif name == ERRORS and error_code.fullmatch(labels.get("code", "")):
                errors += value
            elif name in (f"{TTFT}_bucket", f"{ITL}_bucket") and "le" in labels:
                buckets = ttft if name.startswith(TTFT) else itl
                upper = float(labels["le"])
                buckets[upper] = buckets.get(upper, 0.0) + value
    return PodScrape(
        at=at,
        waiting=waiting,
        running=running,
        kv_usage=sum(kv_values) / len(kv_values) if kv_values else None,
        draining=draining,
        requests=requests,
        errors=errors,
        ttft_buckets=ttft,
        itl_buckets=itl,
    )


class ScrapeSource:
    """Samples from the pods' own /metrics (no Prometheus). Keeps the previous scrape of each pod, per purpose,
    to turn cumulative counters and histograms into increases over the interval between two calls."""

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        max_age_s: float = 60.0,
        max_interval_s: float = 900.0,
        clock: Callable[[], float] = time.time,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._owns_client = client is None
        self._timeout_s = timeout_s
        self.max_age_s = max_age_s
        self.max_interval_s = max_interval_s
        self._clock = clock
        # (purpose, pod key) -> the scrape the next interval starts from.
        self._baselines: dict[tuple[str, str], PodScrape] = {}

    async def _scrape_one(self, target: ScrapeTarget) -> PodScrape | str:
        try:
            response = await self._client.get(f"http://{target.address}/metrics", timeout=self._timeout_s)
            response.raise_for_status()
            return parse_scrape(response.text, self._clock())
        except Exception as error:  # noqa: BLE001 - a failed pod is missing data, never an exception upstream
            return f"{target.pod}: {type(error).__name__}: {str(error)[:200]}"

    async def _scrape(
        self, selector: Selector, targets: Sequence[ScrapeTarget]
    ) -> tuple[list[tuple[ScrapeTarget, PodScrape]], list[str]]:
        chosen = [t for t in targets if selector.matches(t)]
        results = await asyncio.gather(*(self._scrape_one(t) for t in chosen))
        scrapes = [(t, r) for t, r in zip(chosen, results, strict=True) if isinstance(r, PodScrape)]
        failures = [r for r in results if isinstance(r, str)]
        if failures:
            log.warning("scraping %s: %s", selector.describe(), "; ".join(failures))
        return scrapes, failures

    def _advance(self, purpose: str, target: ScrapeTarget, scrape: PodScrape) -> PodScrape | None:
        """The baseline this interval starts from (None: first scrape or too old), then record `scrape`."""
        key = (purpose, target.key)
        previous = self._baselines.get(key)
        self._baselines[key] = scrape
        horizon = scrape.at - self.max_interval_s
        for old in [k for k, v in self._baselines.items() if v.at < horizon]:
            del self._baselines[old]
        if previous is None or previous.at < horizon or previous.at >= scrape.at:
            return None
        return previous

    def _summary(
        self, scrapes: list[tuple[ScrapeTarget, PodScrape]], failures: list[str], wanted: int, extra: str | None = None
    ) -> tuple[float | None, bool, str | None]:
        observed_at = min((s.at for _, s in scrapes), default=None)
        stale = observed_at is None or self._clock() - observed_at > self.max_age_s
        notes = []
        if wanted == 0:
            notes.append("no ready pods to scrape")
        if failures:
            notes.append(f"{len(failures)} of {wanted} pods did not answer: " + "; ".join(failures))
        if extra:
            notes.append(extra)
        return observed_at, stale, _join(*notes)

    async def load(self, selector: Selector, targets: Sequence[ScrapeTarget]) -> LoadSample:
        scrapes, failures = await self._scrape(selector, targets)
        serving = [(t, s) for t, s in scrapes if not s.draining]
        ttft_deltas = []
        for target, scrape in serving:
            previous = self._advance("load", target, scrape)
            if previous is not None:
                ttft_deltas.append(bucket_deltas(previous.ttft_buckets, scrape.ttft_buckets))
        wanted = sum(1 for t in targets if selector.matches(t))
        observed_at, stale, error = self._summary(serving, failures, wanted)
        waiting = [s.waiting for _, s in serving if s.waiting is not None]
        running = [s.running for _, s in serving if s.running is not None]
        kv = [s.kv_usage for _, s in serving if s.kv_usage is not None]
        return LoadSample(
            observed_at=observed_at,
            stale=stale,
            ready_pods=len(waiting),
            queue_depth_per_replica=sum(waiting) / len(waiting) if waiting else None,
            kv_cache_utilization=min(sum(kv) / len(kv), 1.0) if kv else None,
            ttft_p95_seconds=histogram_quantile(QUANTILE, merge_buckets(ttft_deltas)) if ttft_deltas else None,
            running_requests=sum(running) if running else None,
            waiting_requests=sum(waiting) if waiting else None,
            error=error,
        )

    async def revision(self, selector: Selector, targets: Sequence[ScrapeTarget], window_s: float) -> RevisionSample:
        """Increases since the previous `revision` call for each pod (`window_s` is not used: the interval is the
        time between calls, which the operator makes every `intervalSeconds`)."""
        scrapes, failures = await self._scrape(selector, targets)
        measured: list[tuple[PodScrape, PodScrape]] = []
        for target, scrape in scrapes:
            previous = self._advance("revision", target, scrape)
            if previous is not None:
                measured.append((previous, scrape))
        wanted = sum(1 for t in targets if selector.matches(t))
        first = "first scrape of every pod: the interval starts now" if scrapes and not measured else None
        observed_at, stale, error = self._summary([(t, s) for t, s in scrapes], failures, wanted, first)
        if not measured:
            return RevisionSample(observed_at=observed_at, stale=True, pods=0, error=error)
        counted = [(p, s) for p, s in measured if s.requests is not None]
        ttft = merge_buckets(bucket_deltas(p.ttft_buckets, s.ttft_buckets) for p, s in measured)
        itl = merge_buckets(bucket_deltas(p.itl_buckets, s.itl_buckets) for p, s in measured)
        return RevisionSample(
            ttft_p95_seconds=histogram_quantile(QUANTILE, ttft),
            itl_p95_seconds=histogram_quantile(QUANTILE, itl),
            requests=sum(counter_delta(p.requests, s.requests or 0.0) for p, s in counted) if counted else None,
            errors=sum(counter_delta(p.errors, s.errors) for p, s in counted) if counted else None,
            pods=len(measured),
            observed_at=observed_at,
            stale=stale,
            error=error,
        )

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
