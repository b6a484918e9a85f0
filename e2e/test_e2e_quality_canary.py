"""Quantization canaries on the real bundled model, judged by the teacher-forced quality probe.

Two deployments of SmolLM2-135M (fp32, builtin engine) switch their variant to fp8 through a canary at the same
time; they differ only in `qualityMinAgreement`:
- `q-ok` asks 0.9: fp8 picks fp32's next token ~94% of the time on the probe prompts, so it is promoted.
- `q-strict` asks 0.999: the same canary falls short, the analysis fails on quality and the rollout rolls back,
  with the measured agreement in status and the Warning Event.
So the probe measures something real in both directions, over HTTP, between real pods. Latency ratios are set
loose (that is not what this test is about). Not int4, as until stop 34: on CPUs where the fp32 panels run, an int4
SmolLM2 computes with exactly its fp32 weights (they were 4-bit, groups of 32, before they were fp32; quant.py), so
its agreement is 1.0 and no threshold under it can fail.
"""

from __future__ import annotations

import time

import pytest

from llmfleet.scenario import missing_features
from llmfleet.traffic import StreamLoad

_missing = missing_features(["canary"])
pytestmark = pytest.mark.skipif(bool(_missing), reason="; ".join(f.missing_hint for f in _missing))

REAL_ENGINE = {
    "type": "builtin",
    "dtype": "float32",
    "maxNumSeqs": 4,
    "maxNumBatchedTokens": 256,
    "kvCacheBytes": "24Mi",
}


def _deployment(scene, name: str, min_agreement: float) -> dict:
    analysis = {
        "intervalSeconds": 5,
        "failureLimit": 1,
        "minRequests": 1,
        "ttftP95MaxRatio": 50,
        "itlP95MaxRatio": 50,
        "errorRateMax": 0.2,
        "qualityMinAgreement": min_agreement,
    }
    steps = [{"weight": 50, "pauseSeconds": 5}]
    return scene.deployment(
        name, replicas=1, engine=REAL_ENGINE, rollout={"canary": {"steps": steps, "analysis": analysis}}
    )


def _quality(rollout: dict) -> list[float]:
    return [a["qualityAgreement"] for a in rollout.get("analysis") or [] if a.get("qualityAgreement") is not None]


def test_fp8_canary_is_promoted_or_rolled_back_by_measured_quality(scene, fleet, figures) -> None:
    scene.apply(_deployment(scene, "q-ok", 0.9))
    scene.apply(_deployment(scene, "q-strict", 0.999))
    stable = {
        n: scene.wait_until(lambda n=n: scene.settled(n, 1), f"{n}: one ready fp32 pod", timeout_s=120)
        for n in ("q-ok", "q-strict")
    }
    loads = {
        n: StreamLoad(fleet.gateway_url, fleet.api_key, n, workers=1, deadline_s=240, max_tokens=8).start()
        for n in stable
    }
    try:
        started = time.monotonic()
        for name in stable:
            scene.patch(name, {"spec": {"variants": [{"name": "default", "quantization": "fp8"}]}})
        promoted = scene.wait_until(
            lambda: scene.settled("q-ok", 1) not in (None, stable["q-ok"]) and scene.rollout("q-ok"),
            "q-ok: the fp8 canary promoted",
            timeout_s=200,
        )
        promoted_s = time.monotonic() - started
        rolled = scene.wait_until(
            lambda: (r := scene.rollout("q-strict")).get("phase") == "RolledBack" and r,
            "q-strict: the fp8 canary rolled back",
            timeout_s=200,
        )
    finally:
        for load in loads.values():
            load.stop()
    ok_quality, strict_quality = _quality(promoted), _quality(rolled)
    assert ok_quality and all(q >= 0.9 for q in ok_quality), promoted.get("analysis")
    assert promoted["stableRevision"] != stable["q-ok"] and not promoted.get("canaryRevision")
    assert rolled["reason"] == "AnalysisFailed" and "quality agreement" in rolled["message"], rolled
    assert strict_quality and all(0.9 <= q < 0.999 for q in strict_quality), rolled.get("analysis")
    assert rolled["stableRevision"] == stable["q-strict"]
    warnings = [e for e in scene.events("q-strict") if e["reason"] == "CanaryRolledBack"]
    assert warnings and "quality agreement" in warnings[0]["message"]
    for name, load in loads.items():
        assert load.failures == [], f"{name}: {len(load.failures)} streams failed: {load.failures[:3]}"
    figures(
        f"fp8 vs fp32 teacher-forced agreement {ok_quality[0]:.3f} / {strict_quality[0]:.3f}; promoted at "
        f"0.9 after {promoted_s:.0f} s, rolled back at 0.999: {rolled['message'][:120]}"
    )
