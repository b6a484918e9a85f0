"""GitOps health on the real operator (localkube, fake-engine worker pods): the status objects it writes at each
phase of a deployment's life, judged by a port of kstatus' rules (Flux, kubectl wait) and by the Argo CD Lua
health check, the way a GitOps tool sees them when it applies whole manifests:

first rollout -> ready -> canary running -> promoted (annotation) -> canary rolled back (annotation) -> spec
reverted -> invalid edit -> fixed and scaled to zero on purpose.

The objects seen are the fixtures of tests/gitops (tests/gitops/fixtures/*.yaml): run this test with
LLMFLEET_CAPTURE_GITOPS=1 to write them again; without it, the test checks that the live objects get the verdicts
the fixtures record. Slow: real processes.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

HEALTH = Path(__file__).resolve().parents[1] / "gitops" / "health.py"
CAPTURE = os.environ.get("LLMFLEET_CAPTURE_GITOPS") == "1"
STEPS = [{"weight": 50, "pauseSeconds": 600}]  # the canary waits at its step until a command moves it
ANALYSIS = {"intervalSeconds": 5, "failureLimit": 2, "minRequests": 3}
# phase -> (kstatus, Argo CD health, kubectl wait --for=condition=Ready returns)
EXPECTED = {
    "01-first-rollout": ("InProgress", "Progressing", False),
    "02-ready": ("Current", "Healthy", True),
    "03-canary-progressing": ("InProgress", "Progressing", False),
    "04-promoted": ("Current", "Healthy", True),
    "05-rolled-back": ("Failed", "Degraded", False),
    "06-invalid-spec": ("Failed", "Degraded", False),
    "07-scaled-to-zero": ("Current", "Healthy", True),
}


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def _is(obj: dict[str, Any] | None, kind: str, status: str = "True") -> bool:
    return bool(obj) and _condition(obj, kind).get("status") == status  # type: ignore[arg-type]


def _current(obj: dict[str, Any] | None) -> bool:
    return bool(obj) and (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]  # type: ignore[index,union-attr]


def test_status_at_each_phase_is_judged_like_gitops_tools_judge_it(fleet: Any, kit: Any) -> None:
    health = _load_health()
    kube = fleet.kube
    manifest = kit.deployment("gitops", 2, rollout={"canary": {"steps": STEPS, "analysis": ANALYSIS}})
    seen: dict[str, dict[str, Any]] = {}

    def get() -> dict[str, Any] | None:
        return kube.get("infd", "gitops")

    def capture(phase: str, until: Any, what: str, timeout_s: float = 90) -> dict[str, Any]:
        obj = kit.wait_until(lambda: (o := get()) is not None and _current(o) and until(o) and o, what, timeout_s)
        seen[phase] = obj
        verdict = (health.kstatus(obj), health.argocd_health(obj)["status"], health.kubectl_wait_ready(obj))
        assert verdict == EXPECTED[phase], f"{phase}: {verdict} for {obj.get('status')}"
        return obj

    def apply(spec_changes: dict[str, Any]) -> None:
        doc = copy.deepcopy(manifest)
        doc["spec"].update(spec_changes)
        kube.apply(doc)

    kube.apply(manifest)
    capture("01-first-rollout", lambda o: _is(o, "Reconciling"), "the first rollout under way", 30)
    capture("02-ready", lambda o: _is(o, "Ready"), "Ready", 90)

    apply({"template": {"env": [{"name": "RELEASE", "value": "2"}]}})
    capture(
        "03-canary-progressing",
        lambda o: o["status"]["rollout"].get("phase") == "Progressing" and _canary_ready(kit, kube, o),
        "a ready canary pod at step 1",
    )
    kube.run("annotate", "infd", "gitops", "llmfleet.io/promote=true")
    capture(
        "04-promoted", lambda o: _is(o, "Ready") and o["status"]["rollout"].get("phase") == "Stable", "the promotion"
    )

    apply({"template": {"env": [{"name": "RELEASE", "value": "3"}]}})
    kit.wait_until(
        lambda: (get() or {}).get("status", {}).get("rollout", {}).get("phase") == "Progressing", "the second canary"
    )
    kube.run("annotate", "infd", "gitops", "llmfleet.io/abort=true")
    capture("05-rolled-back", lambda o: o["status"]["rollout"].get("phase") == "RolledBack", "the rollback")

    apply({"template": {"env": [{"name": "RELEASE", "value": "2"}]}})  # Git reverted: back to the stable revision
    kit.wait_until(lambda: _current(o := get()) and _is(o, "Ready"), "Ready after the revert")

    apply(
        {
            "template": {"env": [{"name": "RELEASE", "value": "2"}]},
            "variants": [{"name": "default", "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}],
        }
    )
    capture(
        "06-invalid-spec",
        lambda o: _is(o, "Stalled") and _condition(o, "Stalled")["reason"] == "InvalidSpec",
        "Stalled with InvalidSpec",
        30,
    )

    apply({"template": {"env": [{"name": "RELEASE", "value": "2"}]}, "replicas": 0})
    capture("07-scaled-to-zero", lambda o: _is(o, "Ready") and not kube.pods("gitops"), "scaled to zero", 60)

    fixtures = {f["name"]: f for f in health.load_fixtures()}
    for phase, obj in seen.items():
        kstatus, argocd, ready = EXPECTED[phase]
        expected = {"kstatus": kstatus, "argocd": argocd, "kubectlWaitReady": ready}
        if CAPTURE:
            note = phase.split("-", 1)[1].replace("-", " ")
            (health.FIXTURES / f"{phase}.yaml").write_text(health.fixture_document(phase, note, expected, obj))
        else:
            assert phase in fixtures, f"no fixture {phase}: capture them with LLMFLEET_CAPTURE_GITOPS=1"
            assert fixtures[phase]["expected"] == expected, phase


def _canary_ready(kit: Any, kube: Any, obj: dict[str, Any]) -> bool:
    canary = obj["status"]["rollout"].get("canaryRevision")
    pods = kit.ready_pods(kube.pods("gitops"))
    return bool(canary) and any(p["metadata"]["labels"].get("llmfleet.io/revision") == canary for p in pods)


def _load_health() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gitops_health", HEALTH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
