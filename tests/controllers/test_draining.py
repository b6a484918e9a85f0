"""The drain state machine: tables for one pod's next step, and multi-pass drains through the planner (scale
down, restart mid-drain, timeouts, unreachable workers, deletion, invalid specs, surge accounting, budgets)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controllers import DeletePdb, DeletePod, DrainProbe, EnsurePdb, PatchStatus, PodInfo, ProbeState, StartDrain
from controllers.draining import advance, mark_patch, remove
from controllers.observed import PodPhase
from crds.models import DrainReason


def _marked(kit, *, since_s: float = 5, timeout_s: float = 30, ip: str | None = "10.0.0.7", **fields) -> PodInfo:
    start = kit.now - timedelta(seconds=since_s)
    return PodInfo(
        name="p",
        uid="u",
        variant="default",
        revision="r1",
        phase=fields.pop("phase", PodPhase.RUNNING),
        ready=False,
        draining=True,
        ip=ip,
        draining_since=start,
        drain_deadline=start + timedelta(seconds=timeout_s),
        drain_reason=fields.pop("reason", "ScaleDown"),
        **fields,
    )


@pytest.mark.parametrize(
    ("pod", "probe", "expected", "needle"),
    [
        (
            {"since_s": 3.2},
            DrainProbe(ProbeState.ANSWERED, draining=True, in_flight=0),
            DeletePod,
            "drained: 0 in flight after 3.2 s",
        ),
        (
            {},
            DrainProbe(ProbeState.ANSWERED, draining=False, in_flight=0),
            DeletePod,
            "not drained: 0 in flight but the worker was not draining (it restarted, or never got POST /drain) "
            "after 5.0 s",
        ),
        ({}, DrainProbe(ProbeState.ANSWERED, draining=True, in_flight=3), None, ""),
        ({}, DrainProbe(ProbeState.ANSWERED, draining=False, in_flight=2), StartDrain, "not draining yet"),
        (
            {},
            DrainProbe(ProbeState.UNREACHABLE, detail="refused"),
            DeletePod,
            "not drained: the worker no longer answers",
        ),
        ({}, DrainProbe(ProbeState.FAILED, detail="timeout"), None, ""),
        ({}, None, None, ""),
        ({"since_s": 40}, DrainProbe(ProbeState.ANSWERED, draining=True, in_flight=3), DeletePod, "timeout"),
        ({"since_s": 40}, DrainProbe(ProbeState.FAILED), DeletePod, "unknown request(s) in flight"),
        ({"ip": None}, None, DeletePod, "no IP"),
        ({"phase": PodPhase.FAILED}, None, DeletePod, "ended"),
    ],
    ids=[
        "drained",
        "idle-not-draining",
        "in-flight",
        "post-lost",
        "exited",
        "probe-failed",
        "not-probed",
        "timeout",
        "timeout-unknown",
        "no-ip",
        "ended",
    ],
)
def test_one_drain_step(kit, pod, probe, expected, needle):
    marked = _marked(kit, **pod)
    progress = advance([marked], {"p": probe} if probe else {}, kit.now, timeout_s=30, port=8000)
    if expected is None:
        assert progress.actions == ()
        (entry,) = progress.drains
        assert entry.pod == "p" and entry.reason == DrainReason.SCALE_DOWN
        assert entry.deadline == marked.drain_deadline  # a pass never moves the deadline
        assert 0 < progress.requeue_after <= 1.0
    else:
        (action,) = progress.actions
        assert isinstance(action, expected) and needle in action.message
        if expected is DeletePod:
            assert action.uid == "u" and action.reason == "ScaleDown" and progress.drains == ()
        else:
            assert not action.mark and action.address == "10.0.0.7:8000"  # only the POST again


def test_a_pod_marked_without_annotations_is_marked_again_with_a_fresh_deadline(kit):
    pod = PodInfo(name="p", uid="u", phase=PodPhase.RUNNING, ready=True, draining=True, ip="10.0.0.7")
    (action,) = advance([pod], {}, kit.now, timeout_s=30, port=8000).actions
    assert isinstance(action, StartDrain) and action.mark
    assert action.deadline - action.started_at == timedelta(seconds=30)


def test_pods_not_draining_or_already_deleting_are_left_alone(kit):
    serving = PodInfo(name="a", phase=PodPhase.RUNNING, ready=True, ip="10.0.0.1")
    deleting = _marked(kit, deleting=True)
    assert advance([serving, deleting], {}, kit.now, timeout_s=30, port=8000) == advance(
        [], {}, kit.now, timeout_s=30, port=8000
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"phase": PodPhase.RUNNING, "ready": True, "ip": "10.0.0.1"}, StartDrain),
        ({"phase": PodPhase.RUNNING, "ready": False, "ip": "10.0.0.1"}, DeletePod),
        ({"phase": PodPhase.PENDING, "ready": False}, DeletePod),
    ],
    ids=["serving", "unready", "pending"],
)
def test_remove_drains_only_what_may_serve(kit, fields, expected):
    action = remove(PodInfo(name="p", uid="u", **fields), DrainReason.ROLLOUT, "replaced", kit.now, 20, 8000)
    assert isinstance(action, expected) and action.reason == "Rollout"
    if expected is StartDrain:
        assert action.mark and action.address == "10.0.0.1:8000"
        assert action.deadline == kit.now + timedelta(seconds=20)


def test_the_mark_round_trips_through_the_pod(kit):
    action = remove(
        PodInfo(name="p", uid="u", phase=PodPhase.RUNNING, ready=True, ip="::1"),
        DrainReason.DELETION,
        "bye",
        kit.now,
        20,
        8000,
    )
    assert action.address == "[::1]:8000"
    pod = kit.merge_patch(
        {"metadata": {"name": "p", "labels": {"x": "y"}}, "status": {"phase": "Running"}}, mark_patch(action)
    )
    info = PodInfo.from_pod(pod)
    assert info.draining and not info.live and pod["metadata"]["labels"] == {"x": "y", "llmfleet.io/draining": "true"}
    assert (info.draining_since, info.drain_deadline, info.drain_reason) == (
        action.started_at,
        action.deadline,
        "Deletion",
    )


@pytest.mark.parametrize(
    ("value", "draining"), [("true", True), ("2025-01-01T00:00:00Z", True), ("false", False), ("0", False), ("", False)]
)
def test_draining_label_values(value, draining):
    pod = {"metadata": {"name": "p", "labels": {"llmfleet.io/draining": value}}}
    assert PodInfo.from_pod(pod).draining is draining


# ------------------------------------------------------------------------------------------ through the planner


def _drains(cluster):
    return (cluster.resource.get("status") or {}).get("drains") or []


def test_scale_down_drains_then_deletes_once_nothing_is_in_flight(kit):
    c = kit.cluster({"replicas": 3})
    c.converge()
    c.resource["spec"]["replicas"] = 2
    plan = c.plan()
    (start,) = plan.of_type(StartDrain)
    assert start.reason == "ScaleDown" and start.mark
    c.apply(plan)
    assert [d["pod"] for d in _drains(c)] == [start.name]
    c.in_flight[start.name] = 2
    plan = c.plan()
    assert plan.of_type(DeletePod) == [] and plan.of_type(StartDrain) == []
    assert plan.requeue_after is not None and plan.requeue_after <= 1.0
    c.apply(plan)
    assert _drains(c)[0]["inFlight"] == 2
    status = c.resource["status"]
    assert status["replicas"] == 2 and status["variants"][0]["drainingReplicas"] == 1
    c.in_flight[start.name] = 0
    (delete,) = c.plan().of_type(DeletePod)
    assert delete.name == start.name and delete.message.startswith("drained: 0 in flight after ")
    c.converge()
    assert len(c.pods) == 2 and _drains(c) == []


def test_restart_mid_drain_resumes_with_the_same_deadline(kit):
    c = kit.cluster({"replicas": 2, "drain": {"timeoutSeconds": 30, "terminationGracePeriodSeconds": 40}})
    c.converge()
    c.resource["spec"]["replicas"] = 1
    c.apply(c.plan())
    (name,) = [n for n, p in c.pods.items() if "llmfleet.io/draining" in p["metadata"]["labels"]]
    c.in_flight[name] = 1
    c.resource["status"].pop("drains")  # a status write lost with the operator: the pod's annotations remain
    later = c.now + timedelta(seconds=20)
    plan = kit.reconcile(c.resource, c.observed(), later, c.policy)
    assert plan.of_type(DeletePod) == [] and plan.of_type(StartDrain) == []
    (patch,) = plan.of_type(PatchStatus)
    (entry,) = patch.status["drains"]
    assert entry["deadline"].startswith((c.now + timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%S"))
    (delete,) = kit.reconcile(c.resource, c.observed(), c.now + timedelta(seconds=31), c.policy).of_type(DeletePod)
    assert delete.name == name and "timeout" in delete.message and "1 request(s)" in delete.message


def test_draining_pods_are_not_capacity_but_count_against_the_surge(kit):
    c = kit.cluster({"replicas": 3})
    c.converge()
    c.resource["spec"]["engine"] = {"maxNumSeqs": 8}
    for _ in range(30):  # every drain takes two passes: one with a request still in flight
        plan = c.plan()
        c.apply(plan)
        for name, pod in c.pods.items():
            if "llmfleet.io/draining" in pod["metadata"]["labels"]:
                c.in_flight[name] = c.in_flight.get(name, 2) - 1
        ready = [p for p in c.pods.values() if "llmfleet.io/draining" not in p["metadata"]["labels"]]
        assert len(c.pods) <= 3 + 1  # surge 1, draining pods included
        assert len(ready) >= 3  # never below the desired size
        if len(c.pods_by_revision()) == 1 and not plan.actions:
            break
    else:
        raise AssertionError("the rolling replace did not finish")
    assert sum(c.pods_by_revision().values()) == 3


def test_unreachable_worker_is_deleted(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    c.resource["spec"]["replicas"] = 1
    c.apply(c.plan())
    (name,) = [n for n, p in c.pods.items() if "llmfleet.io/draining" in p["metadata"]["labels"]]
    observed = c.observed()
    probes = {name: DrainProbe(ProbeState.UNREACHABLE, detail="connection refused")}
    plan = kit.reconcile(c.resource, type(observed)(**{**observed.__dict__, "drain_probes": probes}), c.now)
    (delete,) = plan.of_type(DeletePod)
    assert delete.name == name and "connection refused" in delete.message


def test_deletion_drains_every_serving_pod_and_finishes_when_they_are_gone(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    (unready, ready) = sorted(c.pods)
    c.set_ready(unready, False)
    c.resource["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    plan = c.plan()
    assert [a.name for a in plan.of_type(StartDrain)] == [ready]
    assert [a.name for a in plan.of_type(DeletePod)] == [unready]
    c.apply(plan)
    assert [d["reason"] for d in _drains(c)] == ["Deletion"]
    plan = c.plan()
    (delete,) = plan.of_type(DeletePod)
    assert delete.name == ready and not plan.finished
    c.apply(plan)
    assert c.plan().finished


def test_an_invalid_spec_lets_drains_under_way_finish(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    c.resource["spec"]["replicas"] = 1
    c.apply(c.plan())
    c.resource["spec"]["variants"][0]["autoscaling"] = {
        "minReplicas": 3,
        "maxReplicas": 1,
        "targets": {"queueDepthPerReplica": 1},
    }
    plan = c.plan()
    assert [d.reason for d in plan.of_type(DeletePod)] == ["ScaleDown"]
    assert c.resource["status"]["drains"] and plan.of_type(PatchStatus)[0].status["drains"] == []


def test_each_variant_gets_a_disruption_budget_and_a_removed_variant_loses_it(kit):
    c = kit.cluster({"variants": [{"name": "a"}, {"name": "b"}]})
    plan = c.plan()
    budgets = {b.name: b.manifest for b in plan.of_type(EnsurePdb)}
    assert set(budgets) == {"smollm2-a", "smollm2-b"}
    spec = budgets["smollm2-b"]["spec"]
    assert spec["maxUnavailable"] == 1 and spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert spec["selector"]["matchLabels"] == {"llmfleet.io/deployment": "smollm2", "llmfleet.io/variant": "b"}
    c.converge()
    assert c.plan().of_type(EnsurePdb) == []  # in place and matching: nothing to do
    foreign = {"metadata": {"name": "smollm2-x", "ownerReferences": [{"controller": True, "uid": "someone"}]}}
    c.pdbs["smollm2-x"] = foreign
    c.resource["spec"]["variants"] = [{"name": "a"}]
    assert [d.name for d in c.plan().of_type(DeletePdb)] == ["smollm2-b"]  # ours only
