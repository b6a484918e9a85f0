"""Table-driven tests of the planner: scale up/down, failed pods, revision changes, invalid specs, deletion."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest

from controllers import (
    CreatePod,
    DeletePod,
    EmitEvent,
    EnsureNetworkPolicy,
    EnsureService,
    Observed,
    PatchStatus,
    StartDrain,
)
from controllers.network import NetworkPolicySettings, Peer
from controllers.pods import PodDefaults
from controllers.reconcile import Policy


def _conditions(plan):
    (patch,) = plan.of_type(PatchStatus)
    return {c["type"]: c for c in patch.status["conditions"]}


def _revision(plan) -> str:
    return plan.of_type(CreatePod)[0].revision


def _removals(plan):
    """Pods the plan removes, in order: drained (ready ones) or deleted at once (ones serving nothing)."""
    return [a for a in plan.actions if isinstance(a, (StartDrain, DeletePod))]


# ---------------------------------------------------------------------------------------------------- scaling


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, {"default": 1}),
        ({"replicas": 3}, {"default": 3}),
        ({"replicas": 0}, {"default": 0}),
        ({"variants": [{"name": "a", "replicas": 2}, {"name": "b"}]}, {"a": 2, "b": 1}),
        ({"replicas": 5, "variants": [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}]}, {"a": 4, "b": 1}),
        (
            {
                "variants": [
                    {
                        "name": "a",
                        "autoscaling": {"minReplicas": 2, "maxReplicas": 4, "targets": {"queueDepthPerReplica": 4}},
                    }
                ]
            },
            {"a": 2},
        ),
    ],
)
def test_fresh_deployment_creates_the_desired_pods(kit, spec, expected):
    plan = kit.reconcile(kit.resource(spec), Observed(), kit.now)
    creates = plan.of_type(CreatePod)
    counts: dict[str, int] = {}
    for create in creates:
        counts[create.variant] = counts.get(create.variant, 0) + 1
    assert {k: v for k, v in expected.items() if v} == counts
    assert len({c.name for c in creates}) == len(creates)
    assert plan.of_type(EnsureNetworkPolicy) and plan.of_type(EnsureService)
    scaled = [e for e in plan.of_type(EmitEvent) if e.reason == "Scaled"]
    assert len(scaled) == len(expected)


@pytest.mark.parametrize(
    ("existing", "replicas", "creates", "deletes"),
    [
        (1, 3, 2, 0),
        (3, 3, 0, 0),
        (3, 1, 0, 2),
        (2, 0, 0, 2),
        (0, 2, 2, 0),
    ],
)
def test_scale_to_spec_replicas(kit, existing, replicas, creates, deletes):
    c = kit.cluster({"replicas": existing})
    c.converge()
    assert len(c.pods) == existing
    c.resource["spec"]["replicas"] = replicas
    plan = c.plan()
    assert len(plan.of_type(CreatePod)) == creates
    assert len(_removals(plan)) == deletes
    assert plan.of_type(DeletePod) == []  # the pods are ready: they are drained first
    assert {d.reason for d in _removals(plan)} <= {"ScaleDown"}
    c.converge()
    assert len(c.pods) == replicas


def test_scale_down_removes_unready_then_youngest(kit):
    c = kit.cluster({"replicas": 4})
    c.converge()
    names = sorted(c.pods, key=lambda n: c.pods[n]["metadata"]["creationTimestamp"])  # oldest first
    c.set_ready(names[0], False)  # the oldest pod is unready: it goes first despite its age
    c.resource["spec"]["replicas"] = 2
    removals = _removals(c.plan())
    assert [d.name for d in removals] == [names[0], names[3]]
    assert [type(d) for d in removals] == [DeletePod, StartDrain]  # the unready one serves nothing: no drain


def test_steady_state_plans_nothing(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    plan = c.plan()
    assert plan.actions == ()
    assert c.resource["status"]["phase"] == "Available"


def test_same_observation_gives_the_same_plan(kit):
    c = kit.cluster({"replicas": 3})
    first, second = c.plan(), c.plan()
    assert first == second


def test_restart_mid_scale_up_fills_gaps_without_duplicates(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    # The operator died after creating slot 2 of 4 but before slot 3; slot 1 was deleted by hand meanwhile.
    c.resource["spec"]["replicas"] = 4
    plan = c.plan()
    c.apply(plan)
    del c.pods[sorted(c.pods)[1]]
    plan = c.plan()
    created = [a.name for a in plan.of_type(CreatePod)]
    assert len(created) == 1 and created[0] not in c.pods
    c.apply(plan)  # FakeCluster.apply asserts no duplicate name
    assert len(c.pods) == 4
    assert c.plan().of_type(CreatePod) == []


# --------------------------------------------------------------------------------------------------- failures


def test_failed_pod_is_deleted_and_replaced_under_a_new_name(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    victim = sorted(c.pods)[0]
    c.pods[victim]["status"]["phase"] = "Failed"
    c.pods[victim]["status"]["message"] = "OOMKilled"
    plan = c.plan()
    (delete,) = plan.of_type(DeletePod)
    (create,) = plan.of_type(CreatePod)
    assert (delete.name, delete.reason) == (victim, "Failed") and "OOMKilled" in delete.message
    assert create.name not in c.pods
    degraded = _conditions(plan)["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "PodsFailed"


def test_crash_looping_pod_marks_degraded_and_is_left_to_the_kubelet(kit):
    c = kit.cluster({"replicas": 1})
    c.converge()
    (name,) = c.pods
    c.pods[name] = kit.pod(c.pods[name], ready=False, waiting="CrashLoopBackOff")
    plan = c.plan()
    assert plan.of_type(DeletePod) == [] and plan.of_type(CreatePod) == []
    conditions = _conditions(plan)
    assert conditions["Degraded"]["reason"] == "PodsStuck" and name in conditions["Degraded"]["message"]
    assert conditions["Available"]["status"] == "False"
    assert plan.of_type(PatchStatus)[0].status["phase"] == "Degraded"


def test_api_errors_of_the_last_pass_show_as_degraded(kit):
    c = kit.cluster()
    c.converge()
    observed = Observed(
        pods=c.observed().pods, service=c.service, network_policy=c.network_policy, errors=("create pod: 500",)
    )
    plan = kit.reconcile(c.resource, observed, kit.now)
    degraded = _conditions(plan)["Degraded"]
    assert degraded["reason"] == "ApiError" and "500" in degraded["message"]


def test_network_policy_is_kept_and_put_back_when_deleted_or_changed(kit):
    c = kit.cluster()
    c.converge()
    assert c.network_policy is not None
    assert c.network_policy["metadata"]["ownerReferences"][0]["uid"] == kit.uid
    assert c.network_policy["spec"]["podSelector"] == {"matchLabels": {"llmfleet.io/deployment": "smollm2"}}
    assert not c.plan().of_type(EnsureNetworkPolicy)  # in place: nothing to do
    c.network_policy["spec"]["ingress"] = [{}]  # opened to everyone by hand
    (fix,) = c.plan().of_type(EnsureNetworkPolicy)
    assert fix.manifest["spec"]["ingress"][0]["from"]
    c.network_policy = None  # deleted
    assert c.plan().of_type(EnsureNetworkPolicy)


@pytest.mark.parametrize(
    ("network", "ensured"),
    [
        (NetworkPolicySettings(), True),
        (NetworkPolicySettings(enabled=False), False),  # a CNI without NetworkPolicy: the operator leaves them be
    ],
)
def test_network_policy_follows_the_operator_setting(kit, network, ensured):
    plan = kit.reconcile(kit.resource(), Observed(), kit.now, Policy(network=network))
    assert bool(plan.of_type(EnsureNetworkPolicy)) is ensured


def test_network_policy_admits_the_configured_peers_on_the_configured_port(kit):
    peers = (Peer({"app": "gw"}, {"kubernetes.io/metadata.name": "llm"}),)
    policy = Policy(network=NetworkPolicySettings(peers=peers), defaults=PodDefaults(port=9000))
    (ensure,) = kit.reconcile(kit.resource(), Observed(), kit.now, policy).of_type(EnsureNetworkPolicy)
    assert ensure.manifest["spec"]["ingress"] == [
        {"from": [peers[0].rule()], "ports": [{"protocol": "TCP", "port": 9000}]}
    ]


# -------------------------------------------------------------------------------------------------- revisions


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.update(replicas=5),
        lambda s: s["variants"][0].update(weight=7),
        lambda s: s["variants"][0].update(tiers=["premium"]),
        lambda s: s.update(rollout={"canary": {"steps": [{"weight": 10}]}}),
        lambda s: s["variants"].append({"name": "other"}),
    ],
    ids=["replicas", "weight", "tiers", "rollout", "another-variant"],
)
def test_unrelated_edits_keep_the_revision(kit, edit):
    resource = kit.resource({"replicas": 1})
    before = _revision(kit.reconcile(resource, Observed(), kit.now))
    edited = copy.deepcopy(resource)
    edit(edited["spec"])
    creates = kit.reconcile(edited, Observed(), kit.now).of_type(CreatePod)
    after = [c.revision for c in creates if c.variant == "default"]
    assert after and set(after) == {before}


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.update(engine={"maxNumSeqs": 8}),
        lambda s: s["variants"][0].update(quantization="int4"),
        lambda s: s["variants"][0].update(resources={"cpu": "2"}),
        lambda s: s.update(template={"image": "example.com/worker:2"}),
        lambda s: s.update(template={"env": [{"name": "X", "value": "1"}]}),
        lambda s: s["model"].update(source="/models/other"),
        lambda s: s.update(drain={"timeoutSeconds": 10, "terminationGracePeriodSeconds": 20}),
    ],
    ids=["engine", "quantization", "resources", "image", "env", "source", "drain"],
)
def test_pod_relevant_edits_change_the_revision(kit, edit):
    resource = kit.resource({"replicas": 1})
    before = _revision(kit.reconcile(resource, Observed(), kit.now))
    edited = copy.deepcopy(resource)
    edit(edited["spec"])
    assert _revision(kit.reconcile(edited, Observed(), kit.now)) != before


@pytest.mark.parametrize(("replicas", "surge", "unavailable"), [(3, 1, 0), (4, 2, 1), (1, 1, 0), (2, 1, 1)])
def test_revision_change_replaces_pods_within_surge_and_availability(kit, replicas, surge, unavailable):
    c = kit.cluster({"replicas": replicas}, Policy(max_surge=surge, max_unavailable=unavailable))
    c.converge()
    old = set(c.pods_by_revision())
    c.resource["spec"]["engine"] = {"maxNumSeqs": 8}

    def check(cluster):
        ready = sum(p["status"]["conditions"][0]["status"] == "True" for p in cluster.pods.values())
        assert len(cluster.pods) <= replicas + surge
        assert ready >= replicas - unavailable

    c.converge(check=check)
    revisions = c.pods_by_revision()
    assert len(revisions) == 1 and set(revisions) != old and sum(revisions.values()) == replicas


def test_unready_old_pods_are_replaced_at_once(kit):
    c = kit.cluster({"replicas": 2})
    c.converge(ready=False)
    c.resource["spec"]["engine"] = {"maxNumSeqs": 8}
    plan = c.plan()
    assert len(plan.of_type(DeletePod)) == 2 and {d.reason for d in plan.of_type(DeletePod)} == {"Rollout"}
    assert len(plan.of_type(CreatePod)) == 2


def test_endpoints_split_variant_weight_by_ready_pods_during_a_rollout(kit):
    c = kit.cluster({"replicas": 2, "variants": [{"name": "default", "weight": 2, "tiers": ["gold"]}]})
    c.converge()
    (old_rev,) = c.pods_by_revision()
    c.resource["spec"]["engine"] = {"maxNumSeqs": 8}
    plan = c.plan()
    new_rev = _revision(plan)
    c.apply(plan)  # one new pod (surge 1), ready at once in the fake; two old ones still ready
    endpoints = c.plan().of_type(PatchStatus)[0].status["endpoints"]
    assert [(e["revision"], e["weight"]) for e in endpoints] == [(new_rev, 66), (old_rev, 134)]
    assert all(e["tiers"] == ["gold"] and e["variant"] == "default" for e in endpoints)


# ---------------------------------------------------------------------------------------------- variants, owners


def test_pods_of_a_removed_variant_are_deleted(kit):
    c = kit.cluster({"variants": [{"name": "a"}, {"name": "b"}]})
    c.converge()
    c.resource["spec"]["variants"] = [{"name": "a"}]
    plan = c.plan()
    (drain,) = _removals(plan)
    assert isinstance(drain, StartDrain) and drain.variant == "b" and "no longer in the spec" in drain.message
    assert plan.of_type(CreatePod) == []
    c.converge()
    assert {p["metadata"]["labels"]["llmfleet.io/variant"] for p in c.pods.values()} == {"a"}


def test_pods_of_another_owner_are_ignored(kit):
    c = kit.cluster({"replicas": 1})
    c.converge()
    (name,) = c.pods
    stranger = copy.deepcopy(c.pods[name])
    stranger["metadata"]["name"] = "someone-elses"
    stranger["metadata"]["ownerReferences"][0]["uid"] = "other-uid"
    c.pods["someone-elses"] = stranger
    plan = c.plan()
    assert plan.of_type(DeletePod) == [] and plan.of_type(CreatePod) == []


def test_autoscaled_variant_follows_status_within_bounds(kit):
    spec = {
        "variants": [
            {"name": "a", "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "targets": {"queueDepthPerReplica": 2}}}
        ]
    }
    c = kit.cluster(spec)
    c.converge()
    assert len(c.pods) == 1
    c.resource["status"]["autoscaling"] = {"variants": [{"name": "a", "desiredReplicas": 9}]}
    c.converge()
    assert len(c.pods) == 3  # clamped to maxReplicas
    c.resource["spec"]["replicas"] = 1  # kubectl scale does not fight the autoscaler
    assert c.plan().of_type(DeletePod) == []


# ----------------------------------------------------------------------------------------------------- status


def test_status_describes_the_fleet(kit):
    c = kit.cluster({"replicas": 2, "variants": [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}]})
    c.converge(ready=False)
    status = c.resource["status"]
    assert status["phase"] == "Pending"
    assert status["labelSelector"] == "llmfleet.io/deployment=smollm2"
    assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (2, 0, 2)
    conditions = {x["type"]: x for x in status["conditions"]}
    assert conditions["Available"]["status"] == "False"
    assert conditions["Progressing"]["status"] == "True"
    for name in c.pods:
        c.set_ready(name)
    c.converge()
    status = c.resource["status"]
    conditions = {x["type"]: x for x in status["conditions"]}
    assert status["phase"] == "Available" and status["observedGeneration"] == 1
    assert [(v["name"], v["readyReplicas"], v["desiredReplicas"]) for v in status["variants"]] == [
        ("a", 1, 1),
        ("b", 1, 1),
    ]
    assert (conditions["Available"]["status"], conditions["Progressing"]["status"]) == ("True", "False")
    assert conditions["InvalidSpec"]["status"] == "False"
    assert [(e["variant"], e["weight"]) for e in status["endpoints"]] == [("a", 100), ("b", 100)]


def test_unchanged_condition_keeps_its_transition_time(kit):
    c = kit.cluster()
    c.converge()
    first = {x["type"]: x["lastTransitionTime"] for x in c.resource["status"]["conditions"]}
    later = kit.now + timedelta(minutes=5)
    c.resource["spec"]["replicas"] = 2
    plan = kit.reconcile(c.resource, c.observed(), later)
    conditions = _conditions(plan)
    assert conditions["Available"]["lastTransitionTime"] == first["Available"]  # still True
    assert conditions["Progressing"]["lastTransitionTime"] != first["Progressing"]  # False -> True


def test_spec_replicas_ignored_is_reported_once_per_generation(kit):
    c = kit.cluster({"replicas": 4, "variants": [{"name": "a", "replicas": 1}]})
    warnings = [e for e in c.plan().of_type(EmitEvent) if e.reason == "ReplicasIgnored"]
    assert len(warnings) == 1
    c.converge()
    assert [e for e in c.plan().of_type(EmitEvent) if e.reason == "ReplicasIgnored"] == []


# ----------------------------------------------------------------------------------------------- invalid spec


def test_invalid_spec_changes_nothing_running_and_warns_once(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    pods_before = copy.deepcopy(c.pods)
    c.resource["spec"]["variants"][0]["autoscaling"] = {
        "minReplicas": 4,
        "maxReplicas": 2,
        "targets": {"queueDepthPerReplica": 1},
    }
    c.resource["metadata"]["generation"] = 2
    plan = c.plan()
    assert plan.of_type(CreatePod) == [] and plan.of_type(DeletePod) == []
    (warning,) = plan.of_type(EmitEvent)
    assert warning.type == "Warning" and warning.reason == "InvalidSpec" and "minReplicas" in warning.message
    conditions = _conditions(plan)
    assert conditions["InvalidSpec"]["status"] == "True" and "minReplicas" in conditions["InvalidSpec"]["message"]
    assert conditions["Available"]["status"] == "True"  # still serving the last valid revision
    c.converge()
    assert c.pods == pods_before
    assert c.resource["status"]["phase"] == "InvalidSpec" and c.resource["status"]["observedGeneration"] == 2
    assert c.plan().actions == ()  # reported once, not on every pass


def _break(c, generation=2):
    """An edit the schema accepts but validation refuses (minReplicas above maxReplicas), also pod-relevant."""
    c.resource["spec"]["variants"][0]["autoscaling"] = {
        "minReplicas": 4,
        "maxReplicas": 2,
        "targets": {"queueDepthPerReplica": 1},
    }
    c.resource["spec"]["engine"] = {"maxNumSeqs": 3}  # would be a new revision, were the spec valid
    c.resource["metadata"]["generation"] = generation


def test_while_invalid_the_last_valid_spec_keeps_running_and_failed_pods_are_replaced(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    last_valid = copy.deepcopy(c.resource["spec"])
    assert c.resource["status"]["lastValidSpec"] == last_valid
    revisions = {p["metadata"]["labels"]["llmfleet.io/revision"] for p in c.pods.values()}
    _break(c)
    c.converge()
    victim = sorted(c.pods)[0]
    c.pods[victim]["status"]["phase"] = "Failed"
    plan = c.plan()
    (delete,) = plan.of_type(DeletePod)
    (create,) = plan.of_type(CreatePod)
    assert delete.name == victim and delete.reason == "Failed"
    assert create.manifest["metadata"]["labels"]["llmfleet.io/revision"] in revisions  # the last valid revision
    assert "--max-num-seqs" in create.manifest["spec"]["containers"][0]["args"]
    args = create.manifest["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] != "3"  # nothing of the invalid edit leaks into pods
    c.converge()
    assert len(c.pods) == 2
    status = c.resource["status"]
    assert status["phase"] == "InvalidSpec" and status["lastValidSpec"] == last_valid
    invalid = {x["type"]: x for x in status["conditions"]}["InvalidSpec"]
    assert invalid["status"] == "True" and "last valid spec keeps running" in invalid["message"]


def test_a_new_invalid_generation_is_reported_again(kit):
    c = kit.cluster({"replicas": 1})
    c.converge()
    _break(c, generation=2)
    assert [e.reason for e in c.plan().of_type(EmitEvent)] == ["InvalidSpec"]
    c.converge()
    _break(c, generation=3)
    (warning,) = c.plan().of_type(EmitEvent)
    assert warning.reason == "InvalidSpec" and "generation 3" in warning.message


def test_schema_violations_are_reported_not_raised(kit):
    resource = kit.resource({"variants": [{"name": "Bad Name!"}], "engine": {"nope": 1}})
    plan = kit.reconcile(resource, Observed(), kit.now)
    assert plan.of_type(CreatePod) == []
    message = _conditions(plan)["InvalidSpec"]["message"]
    assert "variants[0].name" in message and "nope" in message


@pytest.mark.parametrize(
    ("template", "field"),
    [
        ({"podSpec": {"hostNetwork": True}}, "spec.template.podSpec.hostNetwork"),
        ({"podSpec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}, "podSpec.volumes[0].hostPath"),
        (
            {
                "podSpec": {
                    "initContainers": [{"name": "x", "image": "busybox", "securityContext": {"privileged": True}}]
                }
            },
            "spec.template.podSpec.initContainers",
        ),
        ({"labels": {"llmfleet.io/draining": "true"}}, 'spec.template.labels["llmfleet.io/draining"]'),
    ],
)
def test_a_pod_spec_outside_the_allow_list_is_invalid_and_creates_no_pod(kit, template, field):
    plan = kit.reconcile(kit.resource({"template": template}), Observed(), kit.now)
    assert plan.of_type(CreatePod) == []
    invalid = _conditions(plan)["InvalidSpec"]
    assert invalid["status"] == "True" and field in invalid["message"] and "Fix:" in invalid["message"]
    (warning,) = plan.of_type(EmitEvent)
    assert (warning.type, warning.reason) == ("Warning", "InvalidSpec") and field in warning.message


def test_an_edit_to_a_privileged_pod_spec_keeps_the_last_valid_pods(kit):
    c = kit.cluster({"replicas": 1})
    c.converge()
    pods_before = copy.deepcopy(c.pods)
    c.resource["spec"]["template"] = {"podSpec": {"hostPID": True, "nodeName": "node-1"}}
    c.resource["metadata"]["generation"] = 2
    c.converge()
    assert c.pods == pods_before
    assert not any("hostPID" in p["spec"] or "nodeName" in p["spec"] for p in c.pods.values())
    assert c.resource["status"]["phase"] == "InvalidSpec"


def test_fixing_the_spec_resumes_and_says_so(kit):
    c = kit.cluster({"replicas": 1})
    c.converge()
    c.resource["spec"]["drain"] = {"timeoutSeconds": 60, "terminationGracePeriodSeconds": 30}
    c.converge()
    c.resource["spec"]["drain"] = {"timeoutSeconds": 20, "terminationGracePeriodSeconds": 30}
    plan = c.plan()
    assert any(e.reason == "SpecValid" for e in plan.of_type(EmitEvent))
    assert plan.of_type(CreatePod)  # the drain settings are pod-relevant: a new revision rolls out
    assert _conditions(plan)["InvalidSpec"]["status"] == "False"


# -------------------------------------------------------------------------------------------------- deletion


def test_deletion_removes_every_pod_then_finishes(kit):
    c = kit.cluster({"replicas": 3})
    c.converge()
    c.resource["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    plan = c.plan()
    assert {d.name for d in plan.of_type(StartDrain)} == set(c.pods)  # ready pods are drained first
    assert {d.reason for d in plan.of_type(StartDrain)} == {"Deletion"}
    assert not plan.finished and plan.of_type(CreatePod) == []
    assert plan.of_type(PatchStatus)[0].status["phase"] == "Terminating"
    for name in list(c.pods):  # deletes take a while: the pods are terminating
        c.pods[name]["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    plan = c.plan()
    assert plan.of_type(DeletePod) == [] and not plan.finished
    c.pods.clear()
    assert c.plan().finished


def test_scaled_to_zero_is_available_and_keeps_an_endpoint(kit):
    c = kit.cluster({"replicas": 1, "variants": [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}]})
    c.converge()
    c.resource["spec"]["replicas"] = 0
    c.converge()
    status = c.resource["status"]
    assert c.pods == {} and status["phase"] == "ScaledToZero"
    available = {x["type"]: x for x in status["conditions"]}["Available"]
    assert (available["status"], available["reason"]) == ("True", "ScaledToZero")
    assert [(e["variant"], e["weight"]) for e in status["endpoints"]] == [("a", 300), ("b", 100)]


def test_pods_without_a_revision_label_are_replaced_like_old_ones(kit):
    c = kit.cluster({"replicas": 1})
    c.converge()
    (name,) = c.pods
    del c.pods[name]["metadata"]["labels"]["llmfleet.io/revision"]
    plan = c.plan()
    assert len(plan.of_type(CreatePod)) == 1  # surge first: the unlabelled pod is ready, so it stays for now
    c.converge()
    assert name not in c.pods and len(c.pods) == 1
