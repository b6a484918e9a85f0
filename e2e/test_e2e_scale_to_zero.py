"""Scale to zero and back, end to end: an idle variant goes to zero pods; a request that arrives meanwhile is held
by the gateway, the operator sees it waiting (Prometheus scrapes the gateway's `llmfleet_gateway_queued_at_zero`),
wakes the variant, and the held request is answered once the new pod is ready: the client only sees latency.

Skipped with the reason while the operator's autoscaling timer (operator/fleet_operator/autoscaler.py) is missing.
"""

from __future__ import annotations

import time

import httpx
import pytest

from llmfleet.scenario import missing_features
from llmfleet.traffic import StreamLoad

_missing = missing_features(["autoscaling"])
pytestmark = pytest.mark.skipif(bool(_missing), reason="; ".join(f.missing_hint for f in _missing))

AUTOSCALING = {
    "minReplicas": 0,
    "maxReplicas": 2,
    "targets": {"queueDepthPerReplica": 2},
    "scaleToZeroAfterSeconds": 10,
    "scaleDownStabilizationSeconds": 5,
}
ENGINE = {"maxNumSeqs": 4, "extraArgs": {"engine": "fake", "fake-ttft-ms": 50, "fake-itl-ms": 20}}


def _phase(scene, name: str) -> str | None:
    return ((scene.infd(name) or {}).get("status") or {}).get("phase")


def test_idle_variant_scales_to_zero_and_a_held_request_wakes_it(scene, fleet, figures) -> None:
    doc = scene.deployment("sleepy", replicas=None, engine=ENGINE)
    doc["spec"]["variants"][0]["autoscaling"] = AUTOSCALING
    scene.apply(doc)
    scene.wait_until(lambda: scene.settled("sleepy", 1), "1 ready pod", timeout_s=90)
    with StreamLoad(fleet.gateway_url, fleet.api_key, "sleepy", workers=1, max_requests=3, deadline_s=30) as load:
        scene.wait_until(lambda: load.completed >= 3, "3 streams through the gateway", timeout_s=30)
    assert load.failures == [], load.failures[:3]

    idle = time.monotonic()
    scene.wait_until(
        lambda: _phase(scene, "sleepy") == "ScaledToZero" and not scene.pods("sleepy"),
        "the idle variant at zero pods",
        timeout_s=120,
    )
    to_zero_s = time.monotonic() - idle

    sent = time.monotonic()
    response = httpx.post(
        f"{fleet.gateway_url}/v1/completions",
        timeout=150,
        headers={"Authorization": f"Bearer {fleet.api_key}"},
        json={"model": "sleepy", "prompt": "wake up", "max_tokens": 4},
    )
    woke_s = time.monotonic() - sent
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert len(scene.ready_pods("sleepy")) == 1
    reasons = [e["reason"] for e in scene.events("sleepy")]
    decisions = [
        d
        for v in (((scene.infd("sleepy") or {}).get("status") or {}).get("autoscaling") or {}).get("variants") or []
        for d in v.get("lastDecisions") or []
    ]
    assert any(d["desiredReplicas"] == 0 for d in decisions) and decisions[-1]["desiredReplicas"] >= 1, decisions
    figures(
        f"idle -> 0 pods in {to_zero_s:.1f} s (scaleToZeroAfterSeconds 10); a request sent at zero was held and "
        f"answered {woke_s:.1f} s later by the woken pod; events: {sorted(set(reasons))}"
    )
