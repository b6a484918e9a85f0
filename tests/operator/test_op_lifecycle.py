"""The real operator on localkube with real worker pods: apply, scale, unrelated edits, invalid specs, deletion,
and a crash mid-scale-up. Slow (processes start), so marked `slow`."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def _available(fleet, kit, name):
    resource = fleet.kube.get("infd", name)
    return kit.condition(resource, "Available").get("status") == "True" and resource


def test_apply_scale_edit_delete(fleet, kit):
    kube = fleet.kube
    kube.apply(kit.deployment("demo", replicas=2))
    kit.wait_until(lambda: len(kit.ready_pods(kube.pods("demo"))) == 2, "2 ready pods")
    resource = kit.wait_until(lambda: _available(fleet, kit, "demo"), "Available=True")
    assert resource["status"]["readyReplicas"] == 2 and resource["status"]["phase"] == "Available"
    assert resource["status"]["labelSelector"] == "llmfleet.io/deployment=demo"
    reasons = {e["reason"] for e in kube.events("demo")}
    assert {"CreatedPod", "Scaled"} <= reasons

    # kubectl scale goes through the scale subresource to spec.replicas
    kube.run("scale", "infd", "demo", "--replicas", "3")
    kit.wait_until(lambda: len(kit.ready_pods(kube.pods("demo"))) == 3, "3 ready pods after scaling up")
    kube.run("scale", "infd", "demo", "--replicas", "1")
    kit.wait_until(lambda: len(kube.pods("demo")) == 1, "1 pod after scaling down")
    assert any(e["reason"] == "DeletedPod" for e in kube.events("demo"))
    resource = kit.wait_until(
        lambda: (r := fleet.kube.get("infd", "demo"))["status"].get("replicas") == 1 and r, "status.replicas=1"
    )

    # an edit that does not reach the pods leaves them alone
    (pod,) = kube.pods("demo")
    kube.run(
        "patch",
        "infd",
        "demo",
        "--type",
        "merge",
        "-p",
        '{"spec": {"variants": [{"name": "default", "weight": 5, "tiers": ["gold"]}]}}',
    )
    generation = kube.get("infd", "demo")["metadata"]["generation"]
    kit.wait_until(
        lambda: kube.get("infd", "demo")["status"].get("observedGeneration") == generation, "the edit observed"
    )
    endpoints = kube.get("infd", "demo")["status"]["endpoints"]
    assert endpoints[0]["weight"] == 500 and endpoints[0]["tiers"] == ["gold"]
    (same,) = kube.pods("demo")
    assert same["metadata"]["uid"] == pod["metadata"]["uid"]
    assert same["status"]["containerStatuses"][0]["restartCount"] == 0

    # deletion removes the pods (and their processes) before the CR goes
    pids = kit.container_pids(kube.pods("demo"))
    assert pids
    kube.run("delete", "infd", "demo", "--timeout=90s")
    assert kube.get("infd", "demo") is None
    assert kube.pods("demo") == []
    kit.wait_until(lambda: not any(kit.alive(pid) for pid in pids), "worker processes to exit", timeout_s=30)


def test_invalid_spec_reports_and_leaves_pods_running(fleet, kit):
    kube = fleet.kube
    kube.apply(kit.deployment("bad", replicas=1))
    kit.wait_until(lambda: _available(fleet, kit, "bad"), "Available=True")
    (pod,) = kube.pods("bad")
    kube.run(
        "patch",
        "infd",
        "bad",
        "--type",
        "merge",
        "-p",
        '{"spec": {"drain": {"timeoutSeconds": 60, "terminationGracePeriodSeconds": 30}}}',
    )
    resource = kit.wait_until(
        lambda: (r := kube.get("infd", "bad")) and kit.condition(r, "InvalidSpec").get("status") == "True" and r,
        "InvalidSpec=True",
    )
    assert "timeoutSeconds" in kit.condition(resource, "InvalidSpec")["message"]
    assert resource["status"]["phase"] == "InvalidSpec"
    warnings = kit.wait_until(
        lambda: [e for e in kube.events("bad") if e["type"] == "Warning" and e["reason"] == "InvalidSpec"],
        "a Warning Event",
    )
    assert "timeoutSeconds" in warnings[0]["message"]
    (still,) = kit.ready_pods(kube.pods("bad"))
    assert still["metadata"]["uid"] == pod["metadata"]["uid"]


def test_operator_killed_mid_scale_up_converges_without_duplicates(fleet, kit):
    kube = fleet.kube
    kube.apply(kit.deployment("grow", replicas=1))
    kit.wait_until(lambda: _available(fleet, kit, "grow"), "Available=True")
    kube.run("scale", "infd", "grow", "--replicas", "5")
    kit.wait_until(lambda: len(kube.pods("grow")) > 1, "the scale-up to start")
    fleet.operator.kill()
    fleet.operator.start()
    kit.wait_until(lambda: len(kit.ready_pods(kube.pods("grow"))) == 5, "5 ready pods after the restart")
    kit.wait_until(lambda: kube.get("infd", "grow")["status"].get("readyReplicas") == 5, "status.readyReplicas=5")
    pods = kube.pods("grow")
    assert len(pods) == 5
    slots = sorted(int(p["metadata"]["name"].rsplit("-", 1)[1]) for p in pods)
    assert slots == [0, 1, 2, 3, 4]  # deterministic names: a re-created pod could only collide, never duplicate
    assert not [e for e in kube.events("grow") if e["reason"] == "DeletedPod"]  # nothing surplus to remove

    # a deletion while the operator is down waits for it (the finalizer holds the CR), then completes
    fleet.operator.kill()
    kube.run("delete", "infd", "grow", "--wait=false")
    resource = kube.get("infd", "grow")
    meta = resource["metadata"]
    assert meta.get("deletionTimestamp") and "llmfleet.io/finalizer" in meta["finalizers"]
    assert len(kube.pods("grow")) == 5
    fleet.operator.start()
    kit.wait_until(lambda: kube.get("infd", "grow") is None, "the CR to be removed after the restart")
    assert kube.pods("grow") == []


def _token(pod):
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}["LLMFLEET_DRAIN_TOKEN"]


def test_network_policy_and_drain_tokens_without_secrets(fleet, kit):
    kube = fleet.kube
    kube.apply(kit.deployment("guarded", replicas=1))
    kit.wait_until(lambda: _available(fleet, kit, "guarded"), "Available=True")
    resource = kube.get("infd", "guarded")
    policy = kit.wait_until(lambda: kube.get("networkpolicy", "guarded-workers"), "the workers' NetworkPolicy")
    (owner,) = policy["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "InferenceDeployment",
        "guarded",
        resource["metadata"]["uid"],
        True,
    )
    assert policy["spec"]["podSelector"] == {"matchLabels": {"llmfleet.io/deployment": "guarded"}}
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}] and len(rule["from"]) == 3

    # deleted by hand: the operator puts it back (at the latest on its next resync)
    kube.run("delete", "networkpolicy", "guarded-workers")
    again = kit.wait_until(lambda: kube.get("networkpolicy", "guarded-workers"), "the NetworkPolicy re-created")
    assert again["metadata"]["uid"] != policy["metadata"]["uid"]

    # the drain token is a literal value derived from the operator's key; no Secret exists, and a restarted
    # operator derives the same token for the pods it creates next
    (pod,) = kube.pods("guarded")
    token = _token(pod)
    assert set(token) == {"name", "value"} and len(token["value"]) == 43
    assert kube.get("secrets") == []
    fleet.operator.kill()
    fleet.operator.start()
    kube.run("scale", "infd", "guarded", "--replicas", "2")
    kit.wait_until(lambda: len(kit.ready_pods(kube.pods("guarded"))) == 2, "2 ready pods after the restart")
    assert {_token(p)["value"] for p in kube.pods("guarded")} == {token["value"]}

    # deleting the deployment takes its NetworkPolicy with it (owner garbage collection)
    kube.run("delete", "infd", "guarded", "--timeout=90s")
    kit.wait_until(lambda: kube.get("networkpolicy", "guarded-workers") is None, "the NetworkPolicy collected")
