"""LoRA adapters through the planner (`reconcile`): loads go to the ready pods of a LoRA revision only, the status
reports them (status.adapters, the AdaptersReady condition), adapter edits never roll pods, a deleting deployment
sends no adapter calls."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from controllers import (
    AdapterProbe,
    AdapterResult,
    CreatePod,
    DeletePod,
    EmitEvent,
    LoadAdapter,
    Observed,
    PatchStatus,
    ProbeState,
    StartDrain,
    UnloadAdapter,
)
from controllers.adapters import CONFIRM_AFTER_S

A1 = {"name": "a1", "source": "/adapters/a1"}
A2 = {"name": "a2", "source": "hf://org/a2"}


def _lora(replicas: int) -> dict:
    """A spec with LoRA on and one adapter (a fresh dict: tests edit it)."""
    return {"replicas": replicas, "engine": {"lora": {}}, "adapters": [dict(A1)]}


def _serves(*names: str) -> AdapterProbe:
    return AdapterProbe(ProbeState.ANSWERED, adapters=frozenset(names))


def _cluster(kit, spec):
    """A converged fleet whose pods have their own IPs (10.0.0.10, .11, ... by name)."""
    c = kit.cluster(spec)
    c.converge()
    for i, name in enumerate(sorted(c.pods)):
        c.pods[name]["status"]["podIP"] = f"10.0.0.{10 + i}"
    return c


def _observed(c, probes=None, results=()) -> Observed:
    """The cluster's observation plus adapter probes (every pod answered serving nothing, unless given)."""
    probes = {name: _serves() for name in c.pods} if probes is None else probes
    return replace(c.observed(), adapter_probes=probes, adapter_results=tuple(results))


def _plan(kit, c, probes=None, results=()):
    return kit.reconcile(c.resource, _observed(c, probes, results), c.now, c.policy)


def _revision(c, name):
    return c.pods[name]["metadata"]["labels"]["llmfleet.io/revision"]


def _conditions(status):
    return {x["type"]: x for x in status.get("conditions") or []}


def _pod_changes(plan):
    return plan.of_type(CreatePod) + plan.of_type(DeletePod) + plan.of_type(StartDrain)


# ------------------------------------------------------------------------------------------------------- loads


def test_loads_go_to_every_ready_pod_of_a_lora_revision(kit):
    c = _cluster(kit, _lora(2))
    port = c.policy.defaults.port
    plan = _plan(kit, c)
    assert plan.of_type(LoadAdapter) == [
        LoadAdapter(name, f"{c.pods[name]['status']['podIP']}:{port}", "a1", A1["source"]) for name in sorted(c.pods)
    ]
    assert plan.of_type(UnloadAdapter) == [] and _pod_changes(plan) == []
    assert plan.requeue_after is not None and plan.requeue_after <= CONFIRM_AFTER_S


def test_a_load_is_recorded_as_loading_then_confirmed_as_loaded(kit):
    c = _cluster(kit, _lora(2))
    first = _plan(kit, c)
    c.apply(first)
    (a1,) = c.resource["status"]["adapters"]
    assert (a1["readyReplicas"], {p["state"] for p in a1["pods"]}) == (0, {"Loading"})
    c.now += timedelta(seconds=1)
    accepted = [AdapterResult(load.pod, load.adapter, load.source) for load in first.of_type(LoadAdapter)]
    second = _plan(kit, c, probes={name: _serves("a1") for name in c.pods}, results=accepted)
    assert second.of_type(LoadAdapter) == [] and second.requeue_after is None
    c.apply(second)
    (a1,) = c.resource["status"]["adapters"]
    assert a1["readyReplicas"] == 2
    assert {(p["pod"], p["state"], p["source"]) for p in a1["pods"]} == {(n, "Loaded", A1["source"]) for n in c.pods}
    adapters_ready = _conditions(c.resource["status"])["AdaptersReady"]
    assert (adapters_ready["status"], adapters_ready["reason"]) == ("True", "AdaptersLoaded")


def test_unready_and_draining_pods_get_no_loads(kit):
    c = _cluster(kit, _lora(3))
    unready, draining, ready = sorted(c.pods)
    c.set_ready(unready, False)
    c.pods[draining]["metadata"]["labels"]["llmfleet.io/draining"] = "true"
    plan = _plan(kit, c)
    assert [load.pod for load in plan.of_type(LoadAdapter)] == [ready]


def test_the_adapters_ready_condition_follows_the_pods(kit):
    c = _cluster(kit, _lora(2))
    adapters_ready = _conditions(c.resource["status"])["AdaptersReady"]  # no probes yet: nothing known loaded
    assert (adapters_ready["status"], adapters_ready["reason"]) == ("False", "AdaptersLoading")
    plan = _plan(kit, c, probes={name: _serves("a1") for name in c.pods})
    assert plan.of_type(LoadAdapter) == []
    (patch,) = plan.of_type(PatchStatus)
    adapters_ready = _conditions(patch.status)["AdaptersReady"]
    assert (adapters_ready["status"], adapters_ready["reason"]) == ("True", "AdaptersLoaded")
    assert adapters_ready["observedGeneration"] == c.resource["metadata"]["generation"]


def test_the_status_patch_carries_status_adapters(kit):
    c = _cluster(kit, _lora(2))
    plan = _plan(kit, c, probes={name: _serves("a1") for name in c.pods})
    (patch,) = plan.of_type(PatchStatus)
    (a1,) = patch.status["adapters"]
    assert (a1["name"], a1["source"], a1["readyReplicas"]) == ("a1", A1["source"], 2)
    assert {(p["pod"], p["state"]) for p in a1["pods"]} == {(name, "Loaded") for name in c.pods}


def test_a_failed_load_is_recorded_and_retried_only_after_its_back_off(kit):
    c = _cluster(kit, _lora(1))
    (name,) = c.pods
    first = _plan(kit, c)
    assert [load.pod for load in first.of_type(LoadAdapter)] == [name]
    c.apply(first)
    c.now += timedelta(seconds=1)
    refused = AdapterResult(name, "a1", A1["source"], error="adapter rank 64 exceeds --max-lora-rank 16")
    second = _plan(kit, c, results=[refused])
    assert second.of_type(LoadAdapter) == []
    assert [e.reason for e in second.of_type(EmitEvent)] == ["AdapterLoadFailed"]
    c.apply(second)
    c.now += timedelta(seconds=1)
    (a1,) = c.resource["status"]["adapters"]  # the failure is durable: the next pass reads it back
    assert [(p["state"], p["attempts"], p["message"]) for p in a1["pods"]] == [("Failed", 1, refused.error)]
    assert _conditions(c.resource["status"])["AdaptersReady"]["reason"] == "AdapterLoadFailed"
    third = _plan(kit, c)  # 2 s after the failed attempt: its 10 s back-off has not run out
    assert third.of_type(LoadAdapter) == [] and third.of_type(EmitEvent) == []
    assert third.requeue_after == pytest.approx(8.0)
    c.apply(third)
    c.now += timedelta(seconds=8)
    fourth = _plan(kit, c)
    assert [(load.pod, load.adapter) for load in fourth.of_type(LoadAdapter)] == [(name, "a1")]
    c.apply(fourth)
    (a1,) = c.resource["status"]["adapters"]
    assert [(p["state"], p["attempts"]) for p in a1["pods"]] == [("Loading", 2)]


# --------------------------------------------------------------------------------------------- LoRA revisions


@pytest.mark.parametrize(
    "spec",
    [{"replicas": 2}, {"replicas": 2, "engine": {"maxNumSeqs": 8}}],
    ids=["plain", "engine-without-lora"],
)
def test_a_spec_without_lora_sends_no_adapter_calls(kit, spec):
    c = _cluster(kit, spec)
    plan = _plan(kit, c, probes={name: _serves("stray") for name in c.pods})
    assert plan.of_type(LoadAdapter) == [] and plan.of_type(UnloadAdapter) == []
    assert "AdaptersReady" not in _conditions(c.resource["status"])
    assert not c.resource["status"].get("adapters")


@pytest.mark.parametrize(
    "rollout",
    [{"canary": {"steps": [{"weight": 50, "pauseSeconds": 60}]}}, None],
    ids=["canary", "direct-replace"],
)
def test_a_rollout_that_turns_lora_on_loads_only_into_pods_of_the_lora_revision(kit, rollout):
    spec = {"replicas": 2} | ({"rollout": rollout} if rollout else {})
    c = _cluster(kit, spec)
    old = set(c.pods)
    c.resource["spec"].update(engine={"lora": {}}, adapters=[dict(A1)])
    c.resource["metadata"]["generation"] = 2
    plan = _plan(kit, c)
    created = {create.name for create in plan.of_type(CreatePod)}
    assert created, "turning LoRA on is a pod change: it rolls"
    assert plan.of_type(LoadAdapter) == []  # the new pods do not exist yet; the old ones serve no adapters
    c.apply(plan)
    new = set(c.pods) - old
    assert new and {_revision(c, n) for n in new}.isdisjoint({_revision(c, n) for n in old})
    plan = _plan(kit, c)  # every pod, old and new, answers its probe
    loaded = {load.pod for load in plan.of_type(LoadAdapter)}
    assert loaded == new & set(c.pods)
    assert plan.of_type(UnloadAdapter) == []


# ------------------------------------------------------------------------------------------ adapter edits, no roll


@pytest.mark.parametrize(
    ("edit", "loads", "unloads", "replace", "pods_loaded"),
    [
        (lambda s: s["adapters"].append(dict(A2)), {"a2"}, set(), False, 2),
        (lambda s: s["adapters"].clear(), set(), {"a1"}, False, 2),
        # a changed source is a rolling reload: one pod per pass, the other keeps serving the old copy
        (lambda s: s["adapters"][0].update(source="/adapters/a1-v2"), {"a1"}, set(), True, 1),
        (lambda s: s["adapters"].__setitem__(0, dict(A2)), {"a2"}, {"a1"}, False, 2),
    ],
    ids=["add", "remove", "change-source", "swap"],
)
def test_adapter_edits_load_and_unload_without_rolling_pods(kit, edit, loads, unloads, replace, pods_loaded):
    c = _cluster(kit, _lora(2))
    c.apply(_plan(kit, c, probes={name: _serves("a1") for name in c.pods}))  # a1 is loaded everywhere, recorded
    (a1,) = c.resource["status"]["adapters"]
    assert {(p["pod"], p["state"]) for p in a1["pods"]} == {(name, "Loaded") for name in c.pods}
    revisions = c.pods_by_revision()
    edit(c.resource["spec"])
    c.resource["metadata"]["generation"] = 2
    served = {name: _serves("a1") for name in c.pods}
    plan = _plan(kit, c, probes=served)
    assert _pod_changes(plan) == []  # adapters are not a pod field: no new revision, no roll
    first = sorted(c.pods)[:pods_loaded]
    assert {(a.pod, a.adapter) for a in plan.of_type(LoadAdapter)} == {(p, a) for p in first for a in loads}
    assert {a.replace for a in plan.of_type(LoadAdapter)} <= {replace}
    assert {(a.pod, a.adapter) for a in plan.of_type(UnloadAdapter)} == {(p, a) for p in c.pods for a in unloads}
    c.apply(plan)
    assert c.converge() == 1 and c.pods_by_revision() == revisions


# ---------------------------------------------------------------------------------------------------- deletion


def test_a_deleting_deployment_sends_no_adapter_calls(kit):
    c = _cluster(kit, _lora(2))
    c.resource["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    plan = _plan(kit, c, probes={name: _serves("stray") for name in c.pods})
    assert {d.name for d in plan.of_type(StartDrain)} == set(c.pods)
    assert plan.of_type(LoadAdapter) == [] and plan.of_type(UnloadAdapter) == []
    assert [e for e in plan.of_type(EmitEvent) if e.reason == "AdapterLoadFailed"] == []
