"""Canary rollouts and lame-duck draining with the real operator, real `llmfleet worker` pods (fake engine) and
the real gateway (Kubernetes mode) on localkube, with analysis from scraping the pods (no Prometheus).

- a canary to int4 (so the quality probe runs too) promotes through all its steps while a bounded load generator
  streams through the gateway, then the fleet scales down: not one stream fails or ends early;
- a canary with injected errors (LLMFLEET_FAULT_ERROR_RATE via spec.template.env) is rolled back automatically,
  with the reason in status and a Warning Event;
- every pod drained on the way (scale-down, promotion, rollback) is deleted as drained ("drained: 0 in flight")
  and never restarted: its restartCount, watched until the pod is gone, stays 0;
- the operator killed mid-step resumes at the same step (same step start, same pods), then a manual promote by
  annotation finishes the rollout and the annotation is removed.

Short pauses and 5 s analysis intervals (the minimum) keep each test to a few dozen seconds. Slow: processes.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fleet_operator.drain_watch import DrainedPodRestarts

from llmfleet.traffic import classify_stream

pytestmark = pytest.mark.slow

LLMFLEET = str(Path(sys.executable).parent / "llmfleet")
# Fake engine: 50 ms to the first token, then 20 ms per token: a 24-token stream lasts about half a second.
ENGINE = {"extraArgs": {"fake-ttft-ms": 50, "fake-itl-ms": 20}}
MAX_TOKENS = 24
# Latency ratios are generous: two fake-engine pods on a busy 2-core machine are not always equally fast, and
# these tests are about the machinery, not about telling 50 ms from 60 ms.
ANALYSIS = {
    "intervalSeconds": 5,
    "failureLimit": 2,
    "minRequests": 3,
    "ttftP95MaxRatio": 5,
    "itlP95MaxRatio": 5,
    "errorRateMax": 0.05,
}


class StreamLoad:
    """A bounded load generator: `workers` threads stream chat completions through the gateway, one after the
    other, until stopped, `max_requests` in all, or `deadline_s`. A stream counts as complete only when it ends
    with `[DONE]` after a finish reason of `length` or `stop`; anything else is a failure, with why."""

    def __init__(self, url: str, model: str, workers: int = 3, max_requests: int = 3000, deadline_s: float = 240):
        self.url, self.model, self.workers = url, model, workers
        self.max_requests, self.deadline = max_requests, time.monotonic() + deadline_s
        self.completed = 0
        self.failures: list[str] = []
        self.revisions: Counter[str] = Counter()
        self._sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def __enter__(self) -> StreamLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _take(self) -> bool:
        with self._lock:
            if self._stop.is_set() or self._sent >= self.max_requests or time.monotonic() > self.deadline:
                return False
            self._sent += 1
            return True

    def _run(self) -> None:
        body = {
            "model": self.model,
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "Tell me a story."}],
        }
        with httpx.Client(timeout=30) as client:
            while self._take():
                outcome, revision = self._one(client, body)
                with self._lock:
                    if outcome is None:
                        self.completed += 1
                        self.revisions[revision] += 1
                    else:
                        self.failures.append(outcome)

    def _one(self, client: httpx.Client, body: dict[str, Any]) -> tuple[str | None, str]:
        try:
            with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
                revision = response.headers.get("x-llmfleet-revision", "?")
                if response.status_code != 200:
                    return f"HTTP {response.status_code}: {response.read()[:200]!r}", revision
                kind, detail, _ = classify_stream(response.iter_lines())
                return (None if kind == "ok" else f"{detail} on {revision}"), revision
        except (httpx.HTTPError, ValueError) as error:
            return f"{type(error).__name__}: {error}", "?"


def _canary_deployment(kit: Any, name: str, replicas: int, steps: list[dict[str, int]], **spec: Any) -> dict:
    return kit.deployment(
        name,
        replicas=replicas,
        engine=ENGINE,
        rollout={"canary": {"steps": steps, "analysis": ANALYSIS}},
        drain={"timeoutSeconds": 10, "terminationGracePeriodSeconds": 15},
        **spec,
    )


def _rollout(kube: Any, name: str) -> dict[str, Any]:
    return ((kube.get("infd", name) or {}).get("status") or {}).get("rollout") or {}


def _revisions(pods: list[dict[str, Any]]) -> Counter[str]:
    return Counter(p["metadata"]["labels"]["llmfleet.io/revision"] for p in pods)


def _watch_drains(fleet: Any, name: str) -> DrainedPodRestarts:
    return DrainedPodRestarts(fleet.kube.env["KUBECONFIG"], fleet.namespace, name)


def _assert_drained_without_restarts(kube: Any, name: str, watch: DrainedPodRestarts, at_least: int) -> None:
    """Every pod marked draining kept restartCount 0 until it was deleted, and its DeletedPod Event says it drained
    (a worker that exited after draining would be restarted and then deleted as unreachable)."""
    restarts = watch.drained()
    assert len(restarts) >= at_least, restarts
    assert {pod: count for pod, count in restarts.items() if count} == {}, f"drained pods restarted: {restarts}"
    deleted = {e["message"].split()[2]: e["message"] for e in kube.events(name) if e["reason"] == "DeletedPod"}
    for pod in restarts:
        assert "drained: 0 in flight after" in deleted.get(pod, ""), (pod, deleted.get(pod))


def _settled(kit: Any, kube: Any, name: str, replicas: int) -> Any:
    """Available, every pod ready and of one revision, no drain left: returns that revision."""
    resource = kube.get("infd", name)
    pods = kube.pods(name)
    revisions = _revisions(pods)
    ok = (
        kit.condition(resource, "Available").get("status") == "True"
        and len(kit.ready_pods(pods)) == replicas == len(pods)
        and len(revisions) == 1
        and not (resource.get("status") or {}).get("drains")
        and _rollout(kube, name).get("phase") == "Stable"
    )
    return ok and next(iter(revisions))


def test_canary_promotes_through_all_steps_and_no_stream_breaks_through_rollout_and_scale_down(
    fleet: Any, kit: Any, gateway: str
) -> None:
    kube = fleet.kube
    steps = [{"weight": 34, "pauseSeconds": 2}, {"weight": 67, "pauseSeconds": 2}]
    kube.apply(_canary_deployment(kit, "promo", 3, steps))
    stable = kit.wait_until(lambda: _settled(kit, kube, "promo", 3), "3 ready pods of one revision", timeout_s=90)
    with _watch_drains(fleet, "promo") as watch, StreamLoad(gateway, "promo") as load:
        kit.wait_until(lambda: load.completed >= 6, "streams through the gateway", timeout_s=30)
        # the canary changes the quantization: the quality probe joins latency and errors in the analysis
        kube.run(
            "patch",
            "infd",
            "promo",
            "--type",
            "merge",
            "-p",
            json.dumps({"spec": {"variants": [{"name": "default", "quantization": "int4"}]}}),
        )
        started = kit.wait_until(
            lambda: (r := _rollout(kube, "promo")).get("phase") == "Progressing" and r, "the canary to start"
        )
        canary = started["canaryRevision"]
        assert canary != stable and started["stableRevision"] == stable and started["canaryWeight"] == 34
        kit.wait_until(lambda: _rollout(kube, "promo").get("step") == 1, "step 2", timeout_s=90)
        endpoints = kube.get("infd", "promo")["status"]["endpoints"]
        weights = {(e["revision"], e.get("canary", False), e["quantization"]): e["weight"] for e in endpoints}
        assert weights == {(canary, True, "int4"): 67, (stable, False, "none"): 33}
        kit.wait_until(lambda: _settled(kit, kube, "promo", 3) == canary, "the canary promoted", timeout_s=90)
        kit.wait_until(lambda: load.revisions[canary] >= 6, "streams served by the promoted revision")

        # scale down while streaming: the leaving pods drain
        kube.run("scale", "infd", "promo", "--replicas", "1")
        kit.wait_until(lambda: _settled(kit, kube, "promo", 1) == canary, "one pod left", timeout_s=60)
        done = load.completed
        kit.wait_until(lambda: load.completed >= done + 6, "streams after the scale-down")
    assert load.failures == [], f"{len(load.failures)} of {load.completed + len(load.failures)} streams broke"
    assert load.revisions[stable] > 0 and load.revisions[canary] > 0

    rollout = _rollout(kube, "promo")
    assert rollout["stableRevision"] == canary and not rollout.get("canaryRevision")
    assert not rollout.get("rejectedRevision")
    verdicts = [a["verdict"] for a in rollout["analysis"]]
    assert verdicts.count("Pass") >= 2 and "Fail" not in verdicts
    passes = [a for a in rollout["analysis"] if a["verdict"] == "Pass"]
    assert {a["step"] for a in passes} == {0, 1}  # each step passed its own check
    assert all(a["qualityAgreement"] == 1.0 for a in passes)  # the fake engine ignores quantization
    reasons = Counter(e["reason"] for e in kube.events("promo"))
    assert reasons["CanaryStarted"] == 1 and reasons["CanaryStep"] == 1 and reasons["CanaryPromoted"] == 1
    assert reasons["DrainingPod"] >= 5  # 3 old stable pods after promotion, 2 on the scale-down (+ canary steps)
    drained = {e["message"].split()[2] for e in kube.events("promo") if e["reason"] == "DrainingPod"}
    deleted = {e["message"].split()[2]: e["message"] for e in kube.events("promo") if e["reason"] == "DeletedPod"}
    assert drained <= set(deleted)  # every drained pod was deleted by the operator, once its drain ended
    assert drained <= set(watch.drained())  # the watch saw every one of them
    _assert_drained_without_restarts(kube, "promo", watch, at_least=5)
    assert reasons["AnalysisPass"] >= 2
    pdbs = kube.get("poddisruptionbudgets")
    assert [(p["metadata"]["name"], p["spec"]["maxUnavailable"]) for p in pdbs] == [("promo-default", 1)]


def test_faulty_canary_rolls_back_with_the_reason_in_status(fleet: Any, kit: Any, gateway: str) -> None:
    kube = fleet.kube
    steps = [{"weight": 50, "pauseSeconds": 2}]
    kube.apply(_canary_deployment(kit, "faulty", 2, steps))
    stable = kit.wait_until(lambda: _settled(kit, kube, "faulty", 2), "2 ready pods", timeout_s=90)
    faults = [{"name": "LLMFLEET_FAULT_ERROR_RATE", "value": "0.6"}, {"name": "LLMFLEET_FAULT_SEED", "value": "7"}]
    with _watch_drains(fleet, "faulty") as watch, StreamLoad(gateway, "faulty") as load:
        kube.run(
            "patch", "infd", "faulty", "--type", "merge", "-p", json.dumps({"spec": {"template": {"env": faults}}})
        )
        canary = kit.wait_until(lambda: _rollout(kube, "faulty").get("canaryRevision"), "the canary to start")
        rolled = kit.wait_until(
            lambda: (r := _rollout(kube, "faulty")).get("phase") == "RolledBack" and r, "the rollback", timeout_s=90
        )
        kit.wait_until(lambda: load.completed >= 10, "streams after the rollback")
        kit.wait_until(lambda: set(_revisions(kube.pods("faulty"))) == {stable}, "the canary pods gone", timeout_s=60)
    assert any("HTTP 500" in f for f in load.failures)  # clients saw the canary's injected errors (not retried)
    assert rolled["rejectedRevision"] == canary and rolled["stableRevision"] == stable
    assert rolled["reason"] == "AnalysisFailed" and "error rate" in rolled["message"]
    assert rolled["canaryWeight"] == 0 and not rolled.get("canaryRevision")
    # failureLimit 2 failures in a row; an Inconclusive check (too few canary requests in its window) between them
    # neither counts nor breaks the run (controllers.rollout), so it may stand between the two Fails
    decisive = [a["verdict"] for a in rolled["analysis"] if a["verdict"] != "Inconclusive"]
    assert decisive[-2:] == ["Fail", "Fail"] and rolled["analysis"][-1]["verdict"] == "Fail", rolled["analysis"]
    resource = kube.get("infd", "faulty")
    progressing = kit.condition(resource, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "CanaryRolledBack")
    assert set(_revisions(kube.pods("faulty"))) == {stable}  # canary pods drained away
    _assert_drained_without_restarts(kube, "faulty", watch, at_least=1)
    assert all(e["weight"] == 0 for e in resource["status"]["endpoints"] if e["revision"] == canary)
    warnings = [e for e in kube.events("faulty") if e["reason"] == "CanaryRolledBack"]
    assert warnings and warnings[0]["type"] == "Warning" and "error rate" in warnings[0]["message"]

    # the rejected revision is not tried again; the stable pods stay
    time.sleep(1)
    assert _rollout(kube, "faulty").get("phase") == "RolledBack"
    assert set(_revisions(kube.pods("faulty"))) == {stable}


def test_operator_killed_mid_step_resumes_at_the_same_step_then_manual_promote(fleet: Any, kit: Any) -> None:
    kube = fleet.kube
    steps = [{"weight": 20, "pauseSeconds": 600}, {"weight": 60, "pauseSeconds": 600}]
    kube.apply(_canary_deployment(kit, "resume", 2, steps))
    stable = kit.wait_until(lambda: _settled(kit, kube, "resume", 2), "2 ready pods", timeout_s=90)
    kube.run(
        "patch",
        "infd",
        "resume",
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"engine": {**ENGINE, "maxNumSeqs": 16}}}),
    )
    before = kit.wait_until(
        lambda: (r := _rollout(kube, "resume")).get("phase") == "Progressing" and r, "the canary to start"
    )
    canary = before["canaryRevision"]
    kit.wait_until(
        lambda: _revisions(kit.ready_pods(kube.pods("resume"))) == Counter({stable: 2, canary: 1}),
        "a ready canary pod beside 2 stable ones",
    )
    uids = sorted(p["metadata"]["uid"] for p in kube.pods("resume"))

    fleet.operator.kill()
    restarted = datetime.now(UTC)
    fleet.operator.start()
    # the restarted operator goes on analysing the same step (a check later than the restart)
    check = kit.wait_until(
        lambda: next(
            (
                a
                for a in _rollout(kube, "resume").get("analysis") or []
                if datetime.fromisoformat(a["time"].replace("Z", "+00:00")) > restarted
            ),
            None,
        ),
        "an analysis check by the restarted operator",
        timeout_s=60,
    )
    assert check["step"] == 0
    after = _rollout(kube, "resume")
    assert (after["phase"], after["step"], after["canaryRevision"]) == ("Progressing", 0, canary)
    assert after["stepStartedAt"] == before["stepStartedAt"] and after["startedAt"] == before["startedAt"]
    assert sorted(p["metadata"]["uid"] for p in kube.pods("resume")) == uids
    assert Counter(e["reason"] for e in kube.events("resume"))["CanaryStarted"] == 1

    kube.run("annotate", "infd", "resume", "llmfleet.io/promote=true")
    kit.wait_until(lambda: _settled(kit, kube, "resume", 2) == canary, "the manual promotion", timeout_s=60)
    annotations = kube.get("infd", "resume")["metadata"].get("annotations") or {}
    assert "llmfleet.io/promote" not in annotations  # one-shot: removed once acted on
    assert _rollout(kube, "resume")["reason"] == "ManualPromote"
