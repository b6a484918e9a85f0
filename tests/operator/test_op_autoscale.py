"""Autoscaling with the real operator on localkube, real `llmfleet worker` pods (fake engine) scraped directly
(no Prometheus: `ScrapeSource`), and a real gateway: a bounded load step scales a variant up within a few ticks
and, once the load stops, back down after the stabilisation window without a failed stream; an
Alertmanager-format POST scales up at once and shows in status, in Events and in the operator's /metrics.

The load step is made deterministic with the fake engine's gate: each pod runs one request at a time
(`maxNumSeqs: 1`) and a request pauses after its first token until the gate file exists, so the other requests
wait in the pod's queue, which is what the autoscaler measures. Slow (processes start), so marked `slow`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmfleet.processes import free_ports
from llmfleet.traffic import classify_stream

pytestmark = pytest.mark.slow

LLMFLEET = str(Path(sys.executable).parent / "llmfleet")
TOKEN = "test-alerts-token"
MAX_TOKENS = 8


@pytest.fixture
def operator_http(monkeypatch: pytest.MonkeyPatch) -> str:
    """Settings for the operator the `fleet` fixture starts (it passes the environment through): a 1 s
    autoscaling tick, short start-up expectations, and the HTTP server on a free port with an alerts token."""
    port, metrics_port = free_ports(2)
    monkeypatch.setenv("LLMFLEET_OPERATOR_AUTOSCALE_INTERVAL_SECONDS", "1")
    monkeypatch.setenv("LLMFLEET_OPERATOR_EXPECTED_STARTUP_SECONDS", "30")
    monkeypatch.setenv("LLMFLEET_OPERATOR_HTTP_PORT", str(port))
    monkeypatch.setenv("LLMFLEET_OPERATOR_METRICS_PORT", str(metrics_port))  # /metrics is on its own internal port
    monkeypatch.setenv("LLMFLEET_OPERATOR_ALERTS_TOKEN", TOKEN)
    return f"http://127.0.0.1:{port}"


def _autoscaled(name: str, gate: Path, *, max_replicas: int = 3, window_s: int = 4) -> dict[str, Any]:
    return {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "source": "bundled://smollm2-135m-instruct"},
            "engine": {"maxNumSeqs": 1, "extraArgs": {"fake-gate-file": str(gate)}},
            "variants": [
                {
                    "name": "default",
                    "autoscaling": {
                        "minReplicas": 1,
                        "maxReplicas": max_replicas,
                        "targets": {"queueDepthPerReplica": 1},
                        "scaleDownStabilizationSeconds": window_s,
                    },
                }
            ],
            "drain": {"timeoutSeconds": 10, "terminationGracePeriodSeconds": 15},
        },
    }


def _entry(kube: Any, name: str) -> dict[str, Any]:
    status = (kube.get("infd", name) or {}).get("status") or {}
    variants = (status.get("autoscaling") or {}).get("variants") or [{}]
    return variants[0]


def _stream(client: httpx.Client, url: str, model: str) -> str | None:
    """One streamed chat completion; None when it ends properly, else why it failed."""
    body = {
        "model": model,
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    }
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.read()[:200]!r}"
            kind, detail, _ = classify_stream(response.iter_lines())
            return None if kind == "ok" else detail
    except (httpx.HTTPError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


class Streams:
    """Bounded streaming load through the gateway: `burst` concurrent streams at once, then (with `steady`)
    one thread streaming back to back until stopped, `max_requests` in all, or `deadline_s`."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        burst: int,
        steady: bool = False,
        max_requests: int = 500,
        deadline_s: float = 90.0,
    ) -> None:
        self.url, self.model = url, model
        self.completed = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._left = max_requests
        self._deadline = time.monotonic() + deadline_s
        self._threads = [threading.Thread(target=self._once, daemon=True) for _ in range(burst)]
        if steady:
            self._threads.append(threading.Thread(target=self._loop, daemon=True))

    def __enter__(self) -> Streams:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _take(self) -> bool:
        with self._lock:
            if self._left <= 0 or time.monotonic() > self._deadline:
                return False
            self._left -= 1
            return True

    def _record(self, outcome: str | None) -> None:
        with self._lock:
            if outcome is None:
                self.completed += 1
            else:
                self.failures.append(outcome)

    def _once(self) -> None:
        if self._take():
            with httpx.Client(timeout=90) as client:
                self._record(_stream(client, self.url, self.model))

    def _loop(self) -> None:
        with httpx.Client(timeout=90) as client:
            while not self._stop.is_set() and self._take():
                self._record(_stream(client, self.url, self.model))


def test_load_step_scales_up_within_ticks_and_back_down_after_the_window_without_failed_streams(
    operator_http: str, fleet: Any, kit: Any, gateway: str, tmp_path: Path
) -> None:
    kube, name, gate = fleet.kube, "steps", tmp_path / "gate"
    kube.apply(_autoscaled(name, gate))
    kit.wait_until(lambda: len(kit.ready_pods(kube.pods(name))) == 1, "the first ready pod", timeout_s=60)
    kit.wait_until(lambda: _entry(kube, name).get("desiredReplicas") == 1, "the autoscaler's first decision")

    with Streams(gateway, name, burst=6) as burst:
        # 1 request runs (paused by the gate), 5 wait in the pod: 5 per replica against a target of 1.
        entry = kit.wait_until(
            lambda: (e := _entry(kube, name)).get("desiredReplicas") == 3 and e,
            "a scale-up to maxReplicas 3",
            timeout_s=30,
        )
        up = next(d for d in entry["lastDecisions"] if d["desiredReplicas"] == 3)
        assert up["trigger"] == "Timer" and up["currentReplicas"] == 1
        assert up["inputs"]["queueDepthPerReplica"] >= 1 and "queue depth" in up["reason"]
        kit.wait_until(lambda: len(kit.ready_pods(kube.pods(name))) == 3, "3 ready pods", timeout_s=60)
        gate.touch()  # the load step ends: every paused and waiting request completes
        kit.wait_until(lambda: burst.completed + len(burst.failures) == 6, "the burst to finish", timeout_s=60)
    assert burst.failures == [] and burst.completed == 6

    events = kit.wait_until(lambda: [e for e in kube.events(name) if e["reason"] == "Autoscaled"], "an Event")
    assert any("1 -> 3 replicas" in e["message"] and "queue depth" in e["message"] for e in events)

    # Light traffic goes on through the scale-down: the drained pods finish what they hold, none breaks.
    with Streams(gateway, name, burst=0, steady=True) as steady:
        entry = kit.wait_until(
            lambda: (e := _entry(kube, name)).get("desiredReplicas") == 1 and e, "a scale-down to 1", timeout_s=60
        )
        down = next(d for d in reversed(entry["lastDecisions"]) if d["desiredReplicas"] == 1)
        assert down["currentReplicas"] == 3
        history = [r["replicas"] for r in entry["recommendations"]]
        assert max(history) == 1 or history[0] == 1, history  # nothing higher left in the window
        kit.wait_until(lambda: len(kube.pods(name)) == 1, "the extra pods drained and gone", timeout_s=60)
    assert steady.completed > 0 and steady.failures == []
    described = kube.run("describe", "infd", name).stdout
    assert "Autoscaled" in described and "3 -> 1 replicas" in described


def test_alert_scales_up_at_once_and_shows_in_status_events_and_metrics(
    operator_http: str, fleet: Any, kit: Any, tmp_path: Path
) -> None:
    kube, name, gate = fleet.kube, "alerted", tmp_path / "gate"
    gate.touch()
    kube.apply(_autoscaled(name, gate, max_replicas=4, window_s=600))
    kit.wait_until(lambda: len(kit.ready_pods(kube.pods(name))) == 1, "the first ready pod", timeout_s=60)
    kit.wait_until(lambda: _entry(kube, name).get("desiredReplicas") == 1, "the autoscaler's first decision")
    for _ in range(120):  # the operator's HTTP server comes up with kopf
        try:
            httpx.get(f"{operator_http}/healthz", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.25)

    alert = {
        "status": "firing",
        "labels": {
            "alertname": "LlmfleetQueueDepthHigh",
            "llmfleet_scale": "up",
            "llmfleet_scale_step": "2",
            "namespace": fleet.namespace,
            "deployment": name,
            "variant": "default",
        },
        "annotations": {"summary": "queue depth above target for 2m"},
        "fingerprint": "abc123",
    }
    payload = {"version": "4", "status": "firing", "receiver": "llmfleet-operator", "alerts": [alert]}
    refused = httpx.post(f"{operator_http}/alerts", json=payload, headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401
    answer = httpx.post(
        f"{operator_http}/alerts", json=payload, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    )
    assert answer.status_code == 200 and answer.json()["accepted"] == 1

    # The answer comes after the decision is persisted: status shows it at once, no tick needed.
    entry = _entry(kube, name)
    assert entry["desiredReplicas"] == 3
    (intent,) = entry["alertIntents"]
    assert intent["alert"] == "LlmfleetQueueDepthHigh" and intent["replicas"] == 3
    assert intent["fingerprint"] == "abc123" and intent["reason"] == "queue depth above target for 2m"
    decision = next(d for d in entry["lastDecisions"] if d["trigger"] == "Alert")
    assert decision["currentReplicas"] == 1 and decision["desiredReplicas"] == 3
    assert "alert LlmfleetQueueDepthHigh holds at least 3" in decision["reason"]
    kit.wait_until(lambda: len(kit.ready_pods(kube.pods(name))) == 3, "3 ready pods", timeout_s=60)
    events = [e for e in kube.events(name) if e["reason"] == "Autoscaled"]
    assert any("1 -> 3 replicas (alert)" in e["message"] for e in events)

    metrics = kit.wait_until(
        lambda: (
            (text := httpx.get(f"http://127.0.0.1:{os.environ['LLMFLEET_OPERATOR_METRICS_PORT']}/metrics").text)
            and 'llmfleet_operator_ready_replicas{deployment="alerted"' in text
            and _sample(text, "llmfleet_operator_ready_replicas", deployment=name) == 3
            and text
        ),
        "the replica gauges at 3",
    )
    assert _sample(metrics, "llmfleet_operator_alerts_received_total", result="accepted") == 1
    assert _sample(metrics, "llmfleet_operator_alerts_received_total", result="unauthorized") == 1
    assert (
        _sample(metrics, "llmfleet_operator_scale_decisions_total", deployment=name, direction="up", source="alert")
        == 1
    )
    assert _sample(metrics, "llmfleet_operator_desired_replicas", deployment=name, variant="default") == 3

    # Resolved: the intent ends (the size then follows the usual stabilised scale-down).
    resolved = {**payload, "status": "resolved", "alerts": [{**alert, "status": "resolved"}]}
    answer = httpx.post(
        f"{operator_http}/alerts", json=resolved, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    )
    assert answer.status_code == 200
    assert _entry(kube, name).get("alertIntents") in (None, [])


def _sample(text: str, metric: str, **labels: str) -> float | None:
    """The value of the first sample of `metric` whose labels include `labels` in a text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None
