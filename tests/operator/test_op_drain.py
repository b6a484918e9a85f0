"""The operator's I/O around draining and canary analysis, without a cluster: the drain client against a stub
worker over real HTTP, the executor's drain/budget/annotation calls against a scripted API, and the analysis
runner with a scripted metrics source."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fleet_operator import analysis_runner
from fleet_operator.analysis_runner import AnalysisObservation, AnalysisRunner
from fleet_operator.drain_client import WorkerDrains
from fleet_operator.execute import execute
from fleet_operator.kube import ApiError
from fleet_operator.quality_probe import ProbeResult
from fleet_operator.testing import DEPLOYMENT as RESOURCE
from fleet_operator.testing import ScriptedApi

from controllers import (
    CreatePod,
    DeletePdb,
    EnsurePdb,
    Observed,
    Plan,
    PodDefaults,
    Policy,
    ProbeState,
    RemoveAnnotations,
    StartDrain,
    reconcile,
)
from controllers.analysis import RevisionSample
from controllers.drain_token import drain_token
from controllers.observed import PodInfo, PodPhase
from crds.models import Verdict

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


class _Worker(BaseHTTPRequestHandler):
    """A worker's drain API: `answers` is what GET /drain returns next (status, body); POSTs are recorded."""

    answers: list[tuple[int, bytes]]
    posts: list[str | None]

    def do_GET(self):
        code, body = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        self._send(code, body)

    def do_POST(self):
        self.posts.append(self.headers.get("Authorization"))
        self._send(202, b'{"draining": true, "inflight": 1}')

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def worker() -> Iterator[Any]:
    handler = type("Handler", (_Worker,), {"answers": [(200, b"{}")], "posts": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield handler, f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    ("answer", "state", "in_flight"),
    [
        ((200, b'{"draining": true, "inflight": 3}'), ProbeState.ANSWERED, 3),
        ((200, b'{"draining": false, "inflight": 0}'), ProbeState.ANSWERED, 0),
        ((500, b"oops"), ProbeState.FAILED, None),
        ((200, b"not json"), ProbeState.FAILED, None),
        ((200, b'{"draining": true}'), ProbeState.FAILED, None),
    ],
)
async def test_probe_reads_the_workers_drain_state(worker, answer, state, in_flight):
    handler, address = worker
    handler.answers = [answer]
    drains = WorkerDrains(timeout_s=5)
    try:
        probe = await drains.probe(address)
    finally:
        await drains.aclose()
    assert (probe.state, probe.in_flight) == (state, in_flight)


async def test_nothing_listening_or_no_ip_is_unreachable():
    drains = WorkerDrains(timeout_s=5)
    try:
        refused = await drains.probe(_closed_port())
        no_ip = await drains.probe(None)
    finally:
        await drains.aclose()
    assert refused.state == no_ip.state == ProbeState.UNREACHABLE


async def test_probe_all_asks_only_draining_pods_that_are_not_deleted(worker):
    handler, address = worker
    host, port = address.split(":")
    handler.answers = [(200, b'{"draining": true, "inflight": 2}')]
    pods = [
        PodInfo(name="serving", ip=host, phase=PodPhase.RUNNING, ready=True),
        PodInfo(name="draining", ip=host, draining=True),
        PodInfo(name="gone", ip=host, draining=True, deleting=True),
    ]
    drains = WorkerDrains(timeout_s=5)
    try:
        probes = await drains.probe_all(pods, int(port))
    finally:
        await drains.aclose()
    assert list(probes) == ["draining"] and probes["draining"].in_flight == 2


KEY = b"operator-drain-key-for-tests-0123456789"


def _start(address: str | None, *, mark: bool = True, name: str = "m-default-r-0") -> StartDrain:
    return StartDrain(
        name=name,
        uid="uid",
        address=address,
        variant="default",
        revision="r",
        reason="ScaleDown",
        message="scale down",
        started_at=NOW,
        deadline=NOW + timedelta(seconds=30),
        mark=mark,
    )


async def test_start_drain_marks_the_pod_then_posts_with_the_token(worker):
    handler, address = worker
    api = ScriptedApi()
    drains = WorkerDrains(timeout_s=5, key=KEY)
    try:
        errors = await execute(api, Plan(actions=(_start(address),)), RESOURCE, drains)  # type: ignore[arg-type]
    finally:
        await drains.aclose()
    assert errors == [] and handler.posts == [f"Bearer {drain_token(KEY, 'ns', 'm', 'u')}"]
    assert not [c for c in api.calls if "/secrets" in c[1]]  # derived, never read from a Secret
    (patch,) = [c for c in api.calls if c[0] == "patch"]
    assert patch[1] == "/api/v1/namespaces/ns/pods/m-default-r-0"
    assert patch[2]["metadata"]["labels"] == {"llmfleet.io/draining": "true"}
    assert patch[2]["metadata"]["annotations"]["llmfleet.io/drain-reason"] == "ScaleDown"
    events = [c[2] for c in api.calls if c[0] == "create" and c[1].endswith("/events")]
    assert [e["reason"] for e in events] == ["DrainingPod"]


def test_a_restarted_operator_derives_the_token_its_pods_hold():
    resource = {**RESOURCE, "spec": {"model": {"name": "m", "source": "bundled://x"}, "variants": [{"name": "a"}]}}
    plan = reconcile(resource, Observed(), NOW, Policy(drain_key=KEY))
    (container,) = plan.of_type(CreatePod)[0].manifest["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    restarted = WorkerDrains(key=bytes(KEY))  # a new process reading the same key file
    assert env["LLMFLEET_DRAIN_TOKEN"] == restarted.token(RESOURCE["metadata"]) is not None
    assert (
        WorkerDrains(key=b"another-key-after-rotation-0123456789").token(RESOURCE["metadata"])
        != env["LLMFLEET_DRAIN_TOKEN"]
    )
    assert "operator-drain-key" not in repr(restarted)


async def test_a_failed_post_or_a_vanished_pod_is_not_an_api_error():
    api = ScriptedApi(failures={("patch", "/api/v1/namespaces/ns/pods/gone"): [ApiError(404, "NotFound", "", "x")]})
    drains = WorkerDrains(timeout_s=5)
    try:
        plan = Plan(actions=(_start(_closed_port()), _start("127.0.0.1:9", name="gone"), _start(None, mark=False)))
        errors = await execute(api, plan, RESOURCE, drains)  # type: ignore[arg-type]
    finally:
        await drains.aclose()
    assert errors == []
    assert [c[1] for c in api.calls if c[0] == "patch"] == [
        "/api/v1/namespaces/ns/pods/m-default-r-0",
        "/api/v1/namespaces/ns/pods/gone",
    ]


async def test_budgets_and_annotation_removal():
    pdb = {"metadata": {"name": "m-a"}, "spec": {"maxUnavailable": 1}}
    path = "/apis/policy/v1/namespaces/ns/poddisruptionbudgets"
    api = ScriptedApi(failures={("create", path): [ApiError(409, "AlreadyExists", "", "x")]})
    plan = Plan(actions=(EnsurePdb(pdb), DeletePdb("m-b"), RemoveAnnotations(("llmfleet.io/promote",))))
    assert await execute(api, plan, RESOURCE) == []  # type: ignore[arg-type]
    calls = [(verb, p, body) for verb, p, body in api.calls if not p.endswith("/events")]
    assert ("patch", f"{path}/m-a", {"spec": {"maxUnavailable": 1}}) in calls  # existed: updated in place
    assert ("delete", f"{path}/m-b", None) in calls
    assert (
        "patch",
        "/apis/llmfleet.io/v1alpha1/namespaces/ns/inferencedeployments/m",
        {"metadata": {"annotations": {"llmfleet.io/promote": None}}},
    ) in calls


# ----------------------------------------------------------------------------------------------- analysis runner


class ScriptedSource:
    """A metrics source answering per revision from `samples`, recording what it was asked."""

    def __init__(self, samples: dict[str, RevisionSample]) -> None:
        self.samples = samples
        self.asked: list[tuple[str | None, float]] = []

    async def load(self, selector, targets):  # pragma: no cover - not used by canary analysis
        raise NotImplementedError

    async def revision(self, selector, targets, window_s):
        self.asked.append((selector.revision, window_s))
        return self.samples[selector.revision]

    async def aclose(self) -> None:
        pass


def _canary_resource(
    quantization: str = "none", metrics_since: datetime | None = NOW
) -> tuple[dict[str, Any], list[dict[str, Any]], str, str]:
    """A deployment whose canary started at NOW (its metrics series appeared at `metrics_since`; None: not yet),
    and its ready pods (2 stable, 1 canary, ready since NOW)."""
    spec = {
        "model": {"name": "smol", "source": "/m"},
        "replicas": 2,
        "variants": [{"name": "default"}],
        "rollout": {"canary": {"steps": [{"weight": 50}], "analysis": {"intervalSeconds": 10, "minRequests": 2}}},
    }
    resource = {**RESOURCE, "metadata": {**RESOURCE["metadata"], "generation": 1}, "spec": spec}
    plan = reconcile(resource, Observed(), NOW)
    resource["status"] = next(a.status for a in plan.actions if hasattr(a, "status"))
    changed = json.loads(json.dumps(resource))
    changed["spec"]["variants"][0]["quantization"] = quantization
    changed["spec"]["engine"] = {"maxNumSeqs": 8}
    stable_rev = resource["status"]["rollout"]["stableRevision"]
    plan = reconcile(changed, Observed(), NOW)
    status = next(a.status for a in plan.actions if hasattr(a, "status"))
    changed["status"] = {**resource["status"], **status}
    if metrics_since is not None:
        changed["status"]["rollout"]["canaryMetricsSince"] = metrics_since.isoformat()
    canary_rev = changed["status"]["rollout"]["canaryRevision"]

    def pod(name: str, revision: str, ip: str) -> dict[str, Any]:
        return {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "labels": {
                    "llmfleet.io/deployment": "m",
                    "llmfleet.io/variant": "default",
                    "llmfleet.io/revision": revision,
                },
            },
            "status": {
                "phase": "Running",
                "podIP": ip,
                "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": NOW.strftime("%Y-%m-%dT%H:%M:%SZ")}
                ],
            },
        }

    pods = [pod("s0", stable_rev, "10.0.0.1"), pod("s1", stable_rev, "10.0.0.2"), pod("c0", canary_rev, "10.0.0.3")]
    return changed, pods, stable_rev, canary_rev


async def test_runner_checks_when_due_and_judges_canary_against_stable():
    resource, pods, stable, canary = _canary_resource()
    good = RevisionSample(ttft_p95_seconds=0.1, itl_p95_seconds=0.02, requests=50, errors=0, observed_at=1.0)
    bad = RevisionSample(ttft_p95_seconds=0.1, itl_p95_seconds=0.02, requests=50, errors=10, observed_at=1.0)
    source = ScriptedSource({stable: good, canary: bad})
    runner = AnalysisRunner(source, PodDefaults())  # type: ignore[arg-type]
    assert await runner.check(resource, pods, NOW + timedelta(seconds=9)) == AnalysisObservation()  # not due yet
    assert source.asked == []
    result = (await runner.check(resource, pods, NOW + timedelta(seconds=10))).result
    assert result is not None and result.verdict == Verdict.FAIL and "error rate" in result.message
    assert sorted(source.asked) == sorted([(stable, 10.0), (canary, 10.0)])
    assert await runner.check(resource, pods[:2], NOW + timedelta(seconds=10)) == AnalysisObservation()  # no canary


@pytest.mark.parametrize(
    ("observed_at", "after_s", "metrics_since", "failed"),
    [
        (None, 5, None, False),  # no canary series yet: keep looking, no check
        (1.0, 5, 5, False),  # they appeared: the clock starts now
        (None, 20, None, True),  # none 2 x intervalSeconds (10 s) after the canary pod was ready: a failed check
    ],
)
async def test_runner_looks_for_the_canary_series_before_any_check(observed_at, after_s, metrics_since, failed):
    resource, pods, stable, canary = _canary_resource(metrics_since=None)
    good = RevisionSample(ttft_p95_seconds=0.1, itl_p95_seconds=0.02, requests=50, errors=0, observed_at=1.0)
    source = ScriptedSource({stable: good, canary: RevisionSample(stale=True, observed_at=observed_at)})
    runner = AnalysisRunner(source, PodDefaults())  # type: ignore[arg-type]
    found = await runner.check(resource, pods, NOW + timedelta(seconds=after_s))
    assert found.metrics_since == (NOW + timedelta(seconds=metrics_since) if metrics_since is not None else None)
    assert (found.result is not None) == failed
    if failed:
        assert found.result.verdict == Verdict.FAIL and "no canary metrics after 20 s" in found.result.message
    assert sorted(r for r, _ in source.asked) == sorted([stable, canary])  # both sampled: the baselines start


async def test_runner_probes_quality_once_per_revision_pair_when_quantization_changes(monkeypatch):
    resource, pods, stable, canary = _canary_resource("int4")
    sample = RevisionSample(ttft_p95_seconds=0.1, itl_p95_seconds=0.02, requests=50, errors=0, observed_at=1.0)
    calls: list[tuple[str, str]] = []

    async def probe(stable_url: str, canary_url: str, **_: Any) -> ProbeResult:
        calls.append((stable_url, canary_url))
        return ProbeResult(0.5, "quality probe: agreement 0.500")

    monkeypatch.setattr(analysis_runner, "run_probe", probe)
    runner = AnalysisRunner(ScriptedSource({stable: sample, canary: sample}), PodDefaults())  # type: ignore[arg-type]
    first = (await runner.check(resource, pods, NOW + timedelta(seconds=10))).result
    second = (await runner.check(resource, pods, NOW + timedelta(seconds=10))).result
    assert first.verdict == second.verdict == Verdict.FAIL and first.quality_agreement == 0.5
    assert "quality agreement 0.500 < 0.9" in first.message
    assert calls == [("http://10.0.0.1:8000", "http://10.0.0.3:8000")]  # remembered after the first probe


def test_runner_never_raises_on_a_broken_source():
    resource, pods, _, _ = _canary_resource()

    class Broken(ScriptedSource):
        async def revision(self, selector, targets, window_s):
            raise RuntimeError("boom")

    runner = AnalysisRunner(Broken({}), PodDefaults())  # type: ignore[arg-type]
    result = asyncio.run(runner.check(resource, pods, NOW + timedelta(seconds=10))).result
    assert result.verdict == Verdict.INCONCLUSIVE and "boom" in result.message
