"""GitOps health on the whole fleet, through the real `kubectl wait` (what CI scripts and Flux-like tools do):

- `kubectl wait --for=condition=Ready infd/NAME`, started right after a spec change, returns only once the canary
  (judged on live traffic through the gateway, analysis from Prometheus) has been promoted and the old pods
  drained; while the canary runs it keeps waiting;
- after a rollback (`llmfleet.io/abort`) `kubectl wait --for=condition=Stalled` returns with the reason, and
  `--for=condition=Ready` times out.

Skipped with the reason when the rollout is not wired.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmfleet.scenario import missing_features
from llmfleet.traffic import StreamLoad

_missing = missing_features(["canary"])
pytestmark = pytest.mark.skipif(bool(_missing), reason="; ".join(f.missing_hint for f in _missing))

KUBECTL = str(Path(sys.executable).parent / "kubectl")
ANALYSIS = {
    "intervalSeconds": 5,
    "failureLimit": 2,
    "minRequests": 3,
    "ttftP95MaxRatio": 3,
    "itlP95MaxRatio": 3,
    "errorRateMax": 0.05,
}


def _kubectl(fleet, ns: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KUBECTL, "--kubeconfig", str(fleet.kubeconfig), "-n", ns, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _wait(fleet, ns: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [KUBECTL, "--kubeconfig", str(fleet.kubeconfig), "-n", ns, "wait", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _condition(resource: dict, kind: str) -> dict:
    return next((c for c in (resource.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def test_kubectl_wait_ready_returns_only_after_the_canary_is_promoted(scene, fleet, figures) -> None:
    steps = [{"weight": 50, "pauseSeconds": 2}]
    scene.apply(scene.deployment("waited", replicas=2, rollout={"canary": {"steps": steps, "analysis": ANALYSIS}}))
    stable = scene.wait_until(lambda: scene.settled("waited", 2), "2 ready pods of one revision", timeout_s=90)
    first = _kubectl(fleet, scene.ns, "wait", "--for=condition=Ready", "infd/waited", "--timeout=30s")
    assert first.returncode == 0, first.stderr
    with StreamLoad(fleet.gateway_url, fleet.api_key, "waited", workers=2, deadline_s=200) as load:
        scene.wait_until(lambda: load.completed >= 4, "streams through the gateway", timeout_s=30)
        scene.patch("waited", {"spec": {"template": {"env": [{"name": "RELEASE", "value": "2"}]}}})
        started = time.monotonic()
        waiter = _wait(fleet, scene.ns, "--for=condition=Ready", "infd/waited", "--timeout=180s")
        try:
            canary = scene.wait_until(lambda: scene.rollout("waited").get("canaryRevision"), "the canary")
            scene.wait_until(lambda: scene.rollout("waited").get("analysis"), "a first analysis check", 60)
            assert waiter.poll() is None, "kubectl wait returned while the canary was running"
            _, err = waiter.communicate(timeout=190)
        finally:
            if waiter.poll() is None:
                waiter.kill()
        waited_s = time.monotonic() - started
    assert waiter.returncode == 0, err
    resource = scene.infd("waited") or {}
    rollout = resource["status"]["rollout"]
    assert rollout["stableRevision"] == canary != stable and not rollout.get("canaryRevision")
    assert _condition(resource, "Ready")["status"] == "True"
    assert {p["metadata"]["labels"]["llmfleet.io/revision"] for p in scene.pods("waited")} == {canary}
    assert load.failures == [], load.failures[:3]
    figures(
        f"kubectl wait --for=condition=Ready returned {waited_s:.1f} s after the spec change, once canary "
        f"{canary} was promoted ({rollout.get('reason')}) and stable {stable} drained"
    )


def test_a_rollback_is_stalled_and_never_ready(scene, fleet, figures) -> None:
    steps = [{"weight": 50, "pauseSeconds": 600}]
    scene.apply(scene.deployment("aborted", replicas=2, rollout={"canary": {"steps": steps, "analysis": ANALYSIS}}))
    scene.wait_until(lambda: scene.settled("aborted", 2), "2 ready pods", timeout_s=90)
    scene.patch("aborted", {"spec": {"template": {"env": [{"name": "RELEASE", "value": "2"}]}}})
    scene.wait_until(lambda: scene.rollout("aborted").get("phase") == "Progressing", "the canary")
    started = time.monotonic()
    assert _kubectl(fleet, scene.ns, "annotate", "infd/aborted", "llmfleet.io/abort=true").returncode == 0
    stalled = _kubectl(fleet, scene.ns, "wait", "--for=condition=Stalled", "infd/aborted", "--timeout=60s", timeout=70)
    assert stalled.returncode == 0, stalled.stderr
    stalled_s = time.monotonic() - started
    condition = _condition(scene.infd("aborted") or {}, "Stalled")
    assert condition["reason"] == "CanaryRolledBack" and "llmfleet.io/promote=true" in condition["message"]
    ready = _kubectl(fleet, scene.ns, "wait", "--for=condition=Ready", "infd/aborted", "--timeout=5s", timeout=20)
    assert ready.returncode != 0  # never Ready while the spec asks for the rejected revision
    figures(f"Stalled ({condition['reason']}) {stalled_s:.1f} s after llmfleet.io/abort; Ready does not come")
