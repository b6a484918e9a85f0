"""Upgrading the operator over a running fleet does not restart model servers (real operator, localkube, real
fake-engine worker pods).

The "upgrade" is a second operator configuration that renders worker pods differently (an extra env var through
LLMFLEET_OPERATOR_WORKER_ENV, the way a new operator version adds a flag or a variable): running pods keep
serving (same uids, restartCount 0, same processes) after it has reconciled the deployment, and pods created
afterwards (a scale-up) carry the new rendering. Raising LLMFLEET_OPERATOR_WORKER_RENDER_EPOCH (the administrator's
equivalent of the project's RENDER_VERSION bump) then rolls every pod the normal way: drained, replaced.
Slow: real processes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytestmark = pytest.mark.slow

NEW_ENV = "LLMFLEET_UPGRADE_MARK"


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env") or []}


def _snapshot(kit: Any, kube: Any) -> dict[str, tuple[str, int]]:
    """Ready pods: name -> (uid, restartCount)."""
    return {
        p["metadata"]["name"]: (p["metadata"]["uid"], p["status"]["containerStatuses"][0].get("restartCount", 0))
        for p in kit.ready_pods(kube.pods("up"))
    }


def _reconciled(kube: Any, generation: int) -> bool:
    resource = kube.get("infd", "up") or {}
    return (resource.get("status") or {}).get("observedGeneration") == generation


def _restart(fleet: Any, **env: str) -> None:
    fleet.operator.stop()
    fleet.operator.extra_env.update(env)
    fleet.operator.start()


def test_an_operator_upgrade_keeps_running_pods_and_new_pods_get_the_new_rendering(fleet: Any, kit: Any) -> None:
    kube = fleet.kube
    kube.apply(kit.deployment("up", 2))
    kit.wait_until(lambda: len(_snapshot(kit, kube)) == 2 and len(kube.pods("up")) == 2, "2 ready pods", 90)
    before = _snapshot(kit, kube)
    pids = kit.container_pids(kube.pods("up"))

    _restart(fleet, LLMFLEET_OPERATOR_WORKER_ENV=f"{NEW_ENV}=1")
    # A change that reaches no pod, so we know when the upgraded operator has reconciled the deployment.
    kube.run("patch", "infd", "up", "--type=merge", "-p", '{"spec":{"variants":[{"name":"default","weight":2}]}}')
    generation = kube.get("infd", "up")["metadata"]["generation"]
    kit.wait_until(lambda: _reconciled(kube, generation), "the upgraded operator to reconcile", 60)
    assert _snapshot(kit, kube) == before  # same pods, same uids, no restart
    assert all(count == 0 for _, count in before.values())
    assert kit.container_pids(kube.pods("up")) == pids and all(kit.alive(pid) for pid in pids)
    assert not any(NEW_ENV in _env(p) for p in kube.pods("up"))

    kube.run("scale", "infd", "up", "--replicas", "3")
    kit.wait_until(lambda: len(_snapshot(kit, kube)) == 3, "3 ready pods", 60)
    after = _snapshot(kit, kube)
    assert {name: after[name] for name in before} == before
    (new,) = [p for p in kube.pods("up") if p["metadata"]["name"] not in before]
    assert _env(new)[NEW_ENV] == "1"
    revisions = Counter(p["metadata"]["labels"]["llmfleet.io/revision"] for p in kube.pods("up"))
    assert len(revisions) == 1  # one revision: the new pod is no canary of anything

    # The rendering epoch is raised: a normal rollout, every old pod drained and replaced.
    _restart(fleet, LLMFLEET_OPERATOR_WORKER_RENDER_EPOCH="1")

    def rolled() -> bool:
        pods = kube.pods("up")
        return (
            len(pods) == 3 and len(kit.ready_pods(pods)) == 3 and not {p["metadata"]["name"] for p in pods} & set(after)
        )

    kit.wait_until(rolled, "every pod replaced", 120)
    assert all(_env(p)[NEW_ENV] == "1" for p in kube.pods("up"))
    drains = [e.get("message", "") for e in kube.events("up") if e.get("reason") == "DrainingPod"]
    undrained = [name for name in after if not any(f"draining pod {name} " in m for m in drains)]
    assert undrained == [], f"replaced without a drain: {undrained}"
