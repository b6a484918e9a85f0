"""Metrics sources: pod scraping against stub workers that export the real worker metrics, target and file_sd
rendering, PromQL rendering and error handling (fast); the Prometheus-backed source against a real Prometheus
process scraping the same stub workers (slow)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fleet_operator.metrics_source import (
    LoadSample,
    MetricsSource,
    PrometheusSource,
    ScrapeSource,
    ScrapeTarget,
    Selector,
    file_sd_targets,
    load_queries,
    local_prometheus_config,
    promql_selector,
    revision_queries,
    scrape_targets,
    write_file_sd,
)
from worker.core.request import FinishReason
from worker.engine.protocol import EngineStats
from worker.metrics import TTFT_BUCKETS, ServerGauges, WorkerMetrics

from controllers.analysis import RevisionSample, analyse, histogram_quantile
from controllers.autoscaling import MetricsSample
from crds.models import AnalysisSpec, Verdict
from llmfleet.processes import free_port


class StubWorker:
    """A /metrics server on its own loopback IP exporting the real `WorkerMetrics` with settable engine stats."""

    def __init__(self, ip: str, pod: str, variant: str = "default", revision: str = "r1") -> None:
        self.stats = EngineStats()
        self.draining = False
        self.mode = "ok"  # ok | error | garbage
        self.pod, self.variant, self.revision = pod, variant, revision
        self.metrics = self._fresh_metrics()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if stub.mode == "error":
                    self.send_response(500)
                    self.end_headers()
                    return
                body = b"this is {not a metric\n" if stub.mode == "garbage" else stub.metrics.render()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((ip, 0), Handler)
        self.address = f"{ip}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def _fresh_metrics(self) -> WorkerMetrics:
        return WorkerMetrics("smol", lambda: self.stats, lambda: ServerGauges(self.draining, 0, 0))

    def restart(self) -> None:
        """The worker process restarted: every counter starts from zero again."""
        self.metrics = self._fresh_metrics()

    def serve(self, n: int, ttft_s: float, itl_s: float = 0.01, errors: tuple[int | str, ...] = ()) -> None:
        """Record `n` requests as the server would (plus the given error codes, each also a request)."""
        for _ in range(n):
            self.metrics.request_received()
            self.metrics.first_token(ttft_s, 4)
            self.metrics.token_gap(itl_s)
            self.metrics.finished(FinishReason.STOP, ttft_s + itl_s)
        for code in errors:
            self.metrics.request_received()
            self.metrics.error(code)

    def target(self, namespace: str = "ns", deployment: str = "smol") -> ScrapeTarget:
        return ScrapeTarget(
            namespace=namespace,
            pod=self.pod,
            address=self.address,
            deployment=deployment,
            variant=self.variant,
            revision=self.revision,
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs() -> Iterator[Callable[..., StubWorker]]:
    made: list[StubWorker] = []

    def make(pod: str, **kwargs: Any) -> StubWorker:
        worker = StubWorker(f"127.0.0.{20 + len(made)}", pod, **kwargs)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


@pytest.fixture
async def source() -> Any:
    src = ScrapeSource(timeout_s=5.0)
    yield src
    await src.aclose()


VARIANT = Selector("ns", "smol", variant="default")


def test_sources_satisfy_the_protocol() -> None:
    assert isinstance(ScrapeSource(), MetricsSource)
    assert isinstance(PrometheusSource("http://127.0.0.1:1"), MetricsSource)


async def test_scrape_load_means_over_serving_pods_of_the_variant(
    stubs: Callable[..., StubWorker], source: ScrapeSource
) -> None:
    a, b = stubs("a"), stubs("b")
    other = stubs("other", variant="int4")
    leaving = stubs("leaving")
    a.stats = EngineStats(num_waiting=2, num_running=1, kv_cache_usage=0.2)
    b.stats = EngineStats(num_waiting=4, num_running=3, kv_cache_usage=0.6)
    other.stats = EngineStats(num_waiting=100, num_running=100, kv_cache_usage=1.0)
    leaving.stats = EngineStats(num_waiting=50, num_running=50, kv_cache_usage=0.9)
    leaving.draining = True  # the worker reports llmfleet:draining 1: leaving pods are not capacity
    targets = [w.target() for w in (a, b, other, leaving)]

    sample = await source.load(VARIANT, targets)

    assert sample.ready_pods == 2
    assert sample.queue_depth_per_replica == pytest.approx(3.0)
    assert sample.kv_cache_utilization == pytest.approx(0.4)
    assert sample.waiting_requests == 6 and sample.running_requests == 4
    assert sample.ttft_p95_seconds is None  # first scrape: no interval yet
    assert not sample.stale and sample.observed_at is not None and sample.error is None
    auto = sample.to_autoscaling()
    assert isinstance(auto, MetricsSample)
    assert (auto.ready_pods, auto.queue_depth_per_replica, auto.waiting_requests) == (2, 3.0, 6.0)


async def test_scrape_ttft_p95_counts_only_requests_since_the_previous_scrape(
    stubs: Callable[..., StubWorker], source: ScrapeSource
) -> None:
    a, b = stubs("a"), stubs("b")
    a.serve(100, ttft_s=5.0)  # before the first scrape: must not count
    targets = [a.target(), b.target()]
    await source.load(VARIANT, targets)
    a.serve(20, ttft_s=0.03)
    b.serve(20, ttft_s=0.3)

    sample = await source.load(VARIANT, targets)

    # 40 observations: 20 in (0.02, 0.04], 20 in (0.25, 0.5]; rank 38 -> 0.25 + 0.25 * 18 / 20.
    assert sample.ttft_p95_seconds == pytest.approx(0.475)


async def test_scrape_revision_sample_feeds_the_analysis(
    stubs: Callable[..., StubWorker], source: ScrapeSource
) -> None:
    stable = [stubs("s1", revision="old"), stubs("s2", revision="old")]
    canary = stubs("c1", revision="new")
    targets = [w.target() for w in (*stable, canary)]
    stable_sel = Selector("ns", "smol", revision="old")
    canary_sel = Selector("ns", "smol", revision="new")

    first = await source.revision(canary_sel, targets, 30)
    assert first.stale and "first scrape" in (first.error or "")
    await source.revision(stable_sel, targets, 30)

    for worker in stable:
        worker.serve(30, ttft_s=0.1, itl_s=0.02)
    # 503 and aborted/failed streams count against the canary; 400 and client disconnects do not.
    canary.serve(30, ttft_s=0.7, itl_s=0.02, errors=(503, "stream_aborted", "stream_error", 400, "client_disconnect"))

    s = await source.revision(stable_sel, targets, 30)
    c = await source.revision(canary_sel, targets, 30)

    assert (s.requests, s.errors, s.pods) == (60, 0, 2)
    assert (c.requests, c.errors, c.pods) == (35, 3, 1)
    assert not s.stale and not c.stale
    assert s.ttft_p95_seconds == pytest.approx(histogram_quantile(0.95, _cumulative(TTFT_BUCKETS, 0.1, 60)))
    assert c.ttft_p95_seconds == pytest.approx(histogram_quantile(0.95, _cumulative(TTFT_BUCKETS, 0.7, 30)))
    result = analyse(AnalysisSpec(min_requests=10), s, c, step=0, now=datetime(2025, 1, 1, tzinfo=UTC))
    assert result.verdict == Verdict.FAIL
    assert "error rate" in result.message and "TTFT p95 ratio" in result.message


def _cumulative(bounds: tuple[float, ...], value: float, n: int) -> dict[float, float]:
    out = {b: float(n if value <= b else 0) for b in bounds}
    out[float("inf")] = float(n)
    return out


async def test_load_and_revision_keep_separate_baselines(
    stubs: Callable[..., StubWorker], source: ScrapeSource
) -> None:
    worker = stubs("a")
    targets = [worker.target()]
    selector = Selector("ns", "smol", revision="r1")
    await source.revision(selector, targets, 30)
    worker.serve(12, ttft_s=0.1)
    await source.load(VARIANT, targets)  # an autoscaler tick in between must not shorten the analysis interval
    worker.serve(8, ttft_s=0.1)
    sample = await source.revision(selector, targets, 30)
    assert sample.requests == 20


async def test_counter_reset_counts_the_new_values(stubs: Callable[..., StubWorker], source: ScrapeSource) -> None:
    worker = stubs("a")
    targets = [worker.target()]
    selector = Selector("ns", "smol", revision="r1")
    worker.serve(50, ttft_s=0.1)
    await source.revision(selector, targets, 30)
    worker.restart()
    worker.serve(7, ttft_s=0.1, errors=(500,))
    sample = await source.revision(selector, targets, 30)
    assert (sample.requests, sample.errors) == (8, 1)


async def test_failed_pods_are_missing_data_never_exceptions(
    stubs: Callable[..., StubWorker], source: ScrapeSource
) -> None:
    good, failing, garbage = stubs("good"), stubs("failing"), stubs("garbage")
    failing.mode, garbage.mode = "error", "garbage"
    good.stats = EngineStats(num_waiting=3)
    unreachable = ScrapeTarget("ns", "gone", "127.0.0.1:1", "smol", "default", "r1")
    targets = [good.target(), failing.target(), garbage.target(), unreachable]

    sample = await source.load(VARIANT, targets)

    assert sample.ready_pods == 1 and sample.queue_depth_per_replica == 3
    assert sample.error is not None and "3 of 4 pods did not answer" in sample.error
    for pod in ("failing", "garbage", "gone"):
        assert pod in sample.error

    good.mode = "error"
    nothing = await source.load(VARIANT, targets)
    assert nothing.ready_pods == 0 and nothing.stale and nothing.observed_at is None
    assert nothing.queue_depth_per_replica is None and nothing.to_autoscaling() is None
    revision = await source.revision(Selector("ns", "smol", revision="r1"), targets, 30)
    assert revision.stale and revision.requests is None


async def test_no_targets_is_missing_data(source: ScrapeSource) -> None:
    sample = await source.load(VARIANT, [])
    assert sample.stale and sample.ready_pods == 0 and "no ready pods" in (sample.error or "")


async def test_old_data_is_stale(stubs: Callable[..., StubWorker]) -> None:
    worker = stubs("a")
    ticks = iter(range(1000, 100_000, 61))  # each reading of the clock is 61 s after the last
    src = ScrapeSource(max_age_s=60, clock=lambda: float(next(ticks)))
    try:
        sample = await src.load(VARIANT, [worker.target()])
    finally:
        await src.aclose()
    assert sample.stale and sample.ready_pods == 1 and sample.to_autoscaling() is None


async def test_prometheus_unreachable_is_missing_data() -> None:
    src = PrometheusSource("http://127.0.0.1:1", timeout_s=2)
    try:
        load = await src.load(VARIANT, [])
        revision = await src.revision(Selector("ns", "smol", revision="r1"), [], 30)
    finally:
        await src.aclose()
    assert load.stale and load.ready_pods == 0 and "Prometheus" in (load.error or "")
    assert revision.stale and revision.requests is None and "ConnectionError" in (revision.error or "")


# ------------------------------------------------------------------------------------------ targets and file_sd


def pod(
    name: str = "p",
    *,
    ready: bool = True,
    phase: str = "Running",
    ip: str | None = "127.0.0.9",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
    port: int | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "labels": {
            "llmfleet.io/deployment": "smol",
            "llmfleet.io/variant": "default",
            "llmfleet.io/revision": "r1",
            **(labels or {}),
        },
        "annotations": annotations or {},
    }
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    containers = [{"name": "worker", "ports": [{"name": "http", "containerPort": port}]}] if port else []
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": containers}, "status": status}


TARGET_CASES = [
    ("ready pod, default port", pod(), "127.0.0.9:8000"),
    ("container port named http", pod(port=9000), "127.0.0.9:9000"),
    ("prometheus.io/port annotation", pod(annotations={"prometheus.io/port": "8081"}), "127.0.0.9:8081"),
    ("IPv6", pod(ip="fd00::1"), "[fd00::1]:8000"),
    ("not ready", pod(ready=False), None),
    ("pending", pod(phase="Pending"), None),
    ("no IP yet", pod(ip=None), None),
    ("being deleted", pod(deleting=True), None),
    ("draining label", pod(labels={"llmfleet.io/draining": "true"}), None),
    ("draining annotation", pod(annotations={"llmfleet.io/draining": "2025-01-01T00:00:00Z"}), None),
    ("draining false is not draining", pod(labels={"llmfleet.io/draining": "false"}), "127.0.0.9:8000"),
    ("no revision label", pod(labels={"llmfleet.io/revision": ""}), None),
]


@pytest.mark.parametrize(("manifest", "address"), [pytest.param(*c[1:], id=c[0]) for c in TARGET_CASES])
def test_scrape_targets(manifest: dict[str, Any], address: str | None) -> None:
    targets = scrape_targets([manifest])
    assert [t.address for t in targets] == ([address] if address else [])
    if address:
        assert targets[0] == ScrapeTarget("ns", "p", address, "smol", "default", "r1")


def test_file_sd_renders_one_group_per_pod_with_selectable_labels(tmp_path: Path) -> None:
    targets = scrape_targets([pod("b", ip="127.0.0.3"), pod("a", ip="127.0.0.2", labels={"llmfleet.io/variant": "q"})])
    groups = file_sd_targets(targets)
    assert groups == [
        {
            "targets": ["127.0.0.2:8000"],
            "labels": {"namespace": "ns", "pod": "a", "deployment": "smol", "variant": "q", "revision": "r1"},
        },
        {
            "targets": ["127.0.0.3:8000"],
            "labels": {"namespace": "ns", "pod": "b", "deployment": "smol", "variant": "default", "revision": "r1"},
        },
    ]
    path = tmp_path / "sd" / "workers.json"
    assert write_file_sd(path, targets) is True
    assert json.loads(path.read_text()) == groups
    assert write_file_sd(path, targets) is False  # unchanged: not rewritten
    assert write_file_sd(path, targets[:1]) is True
    assert len(json.loads(path.read_text())) == 1
    assert [p.name for p in path.parent.iterdir()] == ["workers.json"]  # no temporary files left behind


def test_local_prometheus_config_points_at_the_file_sd() -> None:
    config = local_prometheus_config("/tmp/x.json", scrape_interval_s=2, rule_files=["rules.yaml"])
    job = config["scrape_configs"][0]
    assert job["file_sd_configs"] == [{"files": ["/tmp/x.json"], "refresh_interval": "2s"}]
    assert config["global"]["scrape_interval"] == "2s" and config["rule_files"] == ["rules.yaml"]


def test_promql_selectors_escape_values() -> None:
    assert promql_selector({"a": 'x"y\\z'}, 'code=~"5.."') == '{a="x\\"y\\\\z",code=~"5.."}'


def test_queries_select_the_variant_or_revision() -> None:
    load = load_queries(VARIANT, 60)
    selector = '{namespace="ns",deployment="smol",variant="default"}'
    assert load["ttft_p95"] == (
        f"histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{selector}[60s])))"
    )
    assert load["waiting"] == (
        f"sum(vllm:num_requests_waiting{selector} unless on(instance) (llmfleet:draining{selector} == 1))"
    )
    rev = revision_queries(Selector("ns", "smol", revision="abc"), 29.5)
    assert 'revision="abc"' in rev["itl_p95"] and "[30s]" in rev["itl_p95"]
    assert 'code=~"5..|stream_aborted|stream_error"' in rev["errors"]


def test_load_sample_rejects_impossible_values() -> None:
    with pytest.raises(ValueError):
        LoadSample(kv_cache_utilization=1.5)
    assert RevisionSample().stale is False  # the analysis sample's own default: judged by its values


# ------------------------------------------------------------------------------------------- real Prometheus


def _poll(predicate: Callable[[], Any], what: str, timeout_s: float, poll_s: float = 0.25) -> Any:
    last = None
    for _ in range(int(timeout_s / poll_s) + 1):
        last = predicate()
        if last:
            return last
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}; last: {last!r}")


async def _apoll(predicate: Callable[[], Any], what: str, timeout_s: float, poll_s: float = 0.25) -> Any:
    last = None
    for _ in range(int(timeout_s / poll_s) + 1):
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}; last: {last!r}")


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real Prometheus (Debian package) on a free loopback port, scraping the file_sd targets every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is missing: install Debian `prometheus` (scripts/setup-system.sh does it)")
    sd_path = tmp_path / "workers.json"
    write_file_sd(sd_path, [])
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(local_prometheus_config(sd_path, scrape_interval_s=1)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {log_path.read_text()[-2000:]}")
            try:
                return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _poll(ready, "prometheus to be ready", 30)
        yield url, sd_path
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


WINDOW_S = 110  # longer than this test can take: every series is born inside it


@pytest.mark.slow
@pytest.mark.timeout(100)
async def test_prometheus_source_against_a_real_prometheus(
    stubs: Callable[..., StubWorker], prometheus: tuple[str, Path]
) -> None:
    url, sd_path = prometheus
    stable, canary = stubs("s1", revision="old"), stubs("c1", revision="new")
    stable.stats = EngineStats(num_waiting=2, num_running=1, kv_cache_usage=0.5)
    canary.stats = EngineStats(num_waiting=4, num_running=2, kv_cache_usage=0.3)
    write_file_sd(sd_path, [stable.target(), canary.target()])
    src = PrometheusSource(url, timeout_s=5, max_age_s=30, ttft_window_s=20, min_window_s=10)
    try:

        async def both_scraped() -> LoadSample | None:
            sample = await src.load(VARIANT, [])
            return sample if sample.ready_pods == 2 else None

        load = await _apoll(both_scraped, "both pods scraped", 40)
        assert load.queue_depth_per_replica == pytest.approx(3.0)
        assert load.kv_cache_utilization == pytest.approx(0.4)
        assert (load.waiting_requests, load.running_requests) == (6.0, 3.0)
        assert not load.stale and load.to_autoscaling() is not None

        stable.serve(40, ttft_s=0.1, itl_s=0.01)
        canary.serve(20, ttft_s=0.7, itl_s=0.01, errors=(503, 404, *["stream_aborted"] * 10))
        stable_sel, canary_sel = Selector("ns", "smol", revision="old"), Selector("ns", "smol", revision="new")

        async def canary_counted() -> RevisionSample | None:
            sample = await src.revision(canary_sel, [], WINDOW_S)
            # the request counters and the TTFT histogram are separate series, scraped apart: wait for both
            done = (sample.requests or 0) >= 32 * 0.99 and sample.ttft_p95_seconds is not None
            return sample if done else None

        c = await _apoll(canary_counted, "canary requests in Prometheus", 30)

        async def stable_counted() -> RevisionSample | None:
            sample = await src.revision(stable_sel, [], WINDOW_S)
            done = (sample.requests or 0) >= 40 * 0.99 and sample.ttft_p95_seconds is not None
            return sample if done else None

        s = await _apoll(stable_counted, "stable requests in Prometheus", 30)

    finally:
        await src.aclose()

    # The pods are younger than the window, so their counters count whole, requests and errors alike (increase()
    # alone would extrapolate a short history upwards and miss an error series' first value): the error rate is
    # exact. 503 and stream_aborted count as errors, 404 does not.
    assert (c.requests, s.requests) == (32, 40)
    assert c.errors == pytest.approx(11)
    assert s.errors == 0 and (s.pods, c.pods) == (1, 1) and not c.stale
    # Prometheus's histogram_quantile over rates agrees with ours over the same increases.
    assert c.ttft_p95_seconds == pytest.approx(histogram_quantile(0.95, _cumulative(TTFT_BUCKETS, 0.7, 20)))
    assert s.ttft_p95_seconds == pytest.approx(histogram_quantile(0.95, _cumulative(TTFT_BUCKETS, 0.1, 40)))
    assert s.itl_p95_seconds == pytest.approx(c.itl_p95_seconds)
    result = analyse(AnalysisSpec(min_requests=10), s, c, step=0, now=datetime(2025, 1, 1, tzinfo=UTC))
    assert result.verdict == Verdict.FAIL and "TTFT p95 ratio" in result.message


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule), so a typo fails here, not at run time."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: install Debian `prometheus` (scripts/setup-system.sh does it)")
    queries = [*load_queries(VARIANT, 60).values(), *revision_queries(Selector("n", 'd"x', revision="r"), 30).values()]
    rules = {"groups": [{"name": "q", "rules": [{"record": f"q:{i}", "expr": q} for i, q in enumerate(queries)]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout
