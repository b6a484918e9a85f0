"""Autoscaling up and down under a bounded load, on Prometheus metrics, with no stream failing on the way down.

A fake-engine deployment running 2 requests at a time per pod (`maxNumSeqs: 2`) gets 10 concurrent streams: the
queue builds up (target 2 waiting requests per pod), so the autoscaler adds pods up to `maxReplicas: 3`. When the
load stops, the short stabilisation window (5 s) lets it remove them again; the leaving pods drain. The figures
give the times to scale up and down and the decisions recorded in status.

Skipped with the reason while the operator's autoscaling timer (operator/fleet_operator/autoscaler.py) is missing.
"""

from __future__ import annotations

import time

import pytest

from llmfleet.scenario import missing_features
from llmfleet.traffic import StreamLoad

_missing = missing_features(["autoscaling"])
pytestmark = pytest.mark.skipif(bool(_missing), reason="; ".join(f.missing_hint for f in _missing))

AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "targets": {"queueDepthPerReplica": 2},
    "scaleUpMaxStep": 2,
    "scaleDownStabilizationSeconds": 5,
}
ENGINE = {"maxNumSeqs": 2, "extraArgs": {"engine": "fake", "fake-ttft-ms": 50, "fake-itl-ms": 30}}


def _decisions(resource: dict | None) -> list[dict]:
    variants = (((resource or {}).get("status") or {}).get("autoscaling") or {}).get("variants") or []
    return [d for v in variants for d in v.get("lastDecisions") or []]


def test_autoscales_up_under_load_and_back_down_when_idle(scene, fleet, figures) -> None:
    doc = scene.deployment("elastic", replicas=None, engine=ENGINE)
    doc["spec"]["variants"][0]["autoscaling"] = AUTOSCALING
    scene.apply(doc)
    scene.wait_until(lambda: scene.settled("elastic", 1), "1 ready pod", timeout_s=90)
    with StreamLoad(fleet.gateway_url, fleet.api_key, "elastic", workers=10, deadline_s=120) as load:
        started = time.monotonic()
        peak = scene.wait_until(
            lambda: (n := len(scene.ready_pods("elastic"))) >= 2 and n, "a scale-up under load", timeout_s=90
        )
        up_s = time.monotonic() - started
    assert load.failures == [], load.failures[:3]
    idle = time.monotonic()
    with scene.watch_drains("elastic") as watch:
        scene.wait_until(lambda: scene.settled("elastic", 1), "the scale-down to 1 pod once idle", timeout_s=90)
    down_s = time.monotonic() - idle
    scene.assert_drained_without_restarts("elastic", watch, at_least=1)  # the autoscaler's scale-down drains
    decisions = _decisions(scene.infd("elastic"))
    assert decisions, "the autoscaler recorded no decision in status.autoscaling"
    assert len(scene.pods("elastic")) == 1
    figures(
        f"scaled 1 -> {peak} ready pods {up_s:.1f} s after the load began, back to 1 {down_s:.1f} s after "
        f"it stopped; {load.summary()}; last decisions: "
        + "; ".join(
            f"{d['currentReplicas']}->{d['desiredReplicas']} ({d.get('reason', '')[:60]})" for d in decisions[-3:]
        )
    )
