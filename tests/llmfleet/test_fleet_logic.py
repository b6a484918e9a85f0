"""Pure pieces of the local fleet: manifest paths and updates, readiness rows, status narration, scenario
planning, SSE stream classification and settings validation (tables; no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from llmfleet.kube import collection_path, load_manifests, merged_for_update
from llmfleet.localfleet import FleetSettings, crd_manifest_path
from llmfleet.progress import deployment_ready, deployment_summary, pod_row, rollout_changes
from llmfleet.scenario import TOUR, plan_steps, rollout_settled
from llmfleet.traffic import classify_stream, sse_payloads

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("api_version", "kind", "namespace", "path"),
    [
        ("v1", "Namespace", "x", "/api/v1/namespaces"),
        ("v1", "Secret", "x", "/api/v1/namespaces/x/secrets"),
        ("v1", "Pod", None, "/api/v1/namespaces/default/pods"),
        (
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
            "x",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        ),
        (
            "llmfleet.io/v1alpha1",
            "InferenceDeployment",
            "ns",
            "/apis/llmfleet.io/v1alpha1/namespaces/ns/inferencedeployments",
        ),
    ],
)
def test_collection_path(api_version, kind, namespace, path):
    assert collection_path(api_version, kind, namespace) == path


def test_collection_path_names_the_known_kinds_for_an_unknown_one():
    with pytest.raises(ValueError, match=r"known kinds: .*InferenceDeployment"):
        collection_path("apps/v1", "Deployment", "x")


def test_merged_for_update_takes_the_desired_spec_and_keeps_server_fields():
    existing = {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {
            "name": "a",
            "resourceVersion": "7",
            "finalizers": ["llmfleet.io/finalizer"],
            "labels": {"keep": "1", "over": "old"},
            "annotations": {"llmfleet.io/x": "y"},
        },
        "spec": {"replicas": 1, "rollout": {"canary": {}}},
        "status": {"phase": "Available"},
    }
    desired = {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "a", "labels": {"over": "new"}},
        "spec": {"replicas": 2},
    }
    body = merged_for_update(existing, desired)
    assert body["spec"] == {"replicas": 2}  # removed fields go away, like kubectl apply
    assert body["status"] == {"phase": "Available"}
    assert body["metadata"]["resourceVersion"] == "7" and body["metadata"]["finalizers"] == ["llmfleet.io/finalizer"]
    assert body["metadata"]["labels"] == {"keep": "1", "over": "new"}
    assert body["metadata"]["annotations"] == {"llmfleet.io/x": "y"}


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")) + [crd_manifest_path()])
def test_every_example_and_the_crd_load(path):
    docs = load_manifests(path)
    assert docs and all(d["metadata"]["name"] for d in docs)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("kind: Pod\nmetadata: {name: a}\n", "apiVersion and kind"),
        ("apiVersion: v1\nkind: Pod\nmetadata: {}\n", "no metadata.name"),
    ],
)
def test_load_manifests_rejects_incomplete_documents(tmp_path, text, error):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_manifests(path)


def _pod(phase="Running", ready=True, waiting=None, deleting=False, restarts=0, scheduled=True):
    state = {"waiting": waiting} if waiting else {"running": {}}
    meta = {"name": "p", "labels": {"llmfleet.io/revision": "abc"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "status": {
            "phase": phase,
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"},
                {"type": "PodScheduled", "status": "True" if scheduled else "False", "message": "no node"},
            ],
            "containerStatuses": [{"restartCount": restarts, "state": state}],
        },
    }


@pytest.mark.parametrize(
    ("pod", "ready", "detail"),
    [
        (_pod(), True, "serving"),
        (_pod(ready=False), False, "loading the model (waiting for /ready)"),
        (
            _pod(ready=False, waiting={"reason": "CrashLoopBackOff", "message": "back-off 5s"}),
            False,
            "CrashLoopBackOff: back-off 5s",
        ),
        (_pod(deleting=True), False, "terminating (draining)"),
        (_pod(phase="Pending", ready=False, scheduled=False), False, "unschedulable: no node"),
    ],
)
def test_pod_row(pod, ready, detail):
    row = pod_row(pod)
    assert (row.ready, row.detail, row.revision) == (ready, detail, "abc")


def _infd(generation=2, observed=2, available="True", ready=1, **status):
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": observed,
            "readyReplicas": ready,
            "replicas": ready,
            "conditions": [{"type": "Available", "status": available}],
            **status,
        },
    }


@pytest.mark.parametrize(
    ("resource", "ready"),
    [
        (None, False),
        (_infd(), True),
        (_infd(observed=1), False),
        (_infd(available="False"), False),
        (_infd(ready=0), False),
    ],
)
def test_deployment_ready(resource, ready):
    assert deployment_ready(resource) is ready


def test_deployment_summary_mentions_canary_and_invalid_spec():
    resource = _infd(rollout={"canaryRevision": "c1", "canaryWeight": 20})
    resource["status"]["conditions"].append({"type": "InvalidSpec", "status": "True", "message": "min > max"})
    summary = deployment_summary(resource)
    assert "canary c1 at 20%" in summary and "InvalidSpec: min > max" in summary


def test_deployment_summary_says_why_it_is_stalled():
    resource = _infd()
    resource["status"]["conditions"].append(
        {"type": "Stalled", "status": "True", "reason": "CanaryRolledBack", "message": "canary c1 failed"}
    )
    assert "Stalled (CanaryRolledBack): canary c1 failed" in deployment_summary(resource)


@pytest.mark.parametrize(
    ("before", "after", "lines"),
    [
        ({}, {}, []),
        (
            {"variants": [{"name": "d", "desiredReplicas": 1, "readyReplicas": 1}]},
            {"variants": [{"name": "d", "desiredReplicas": 3, "readyReplicas": 1}]},
            ["variant d: desired pods 1 -> 3"],
        ),
        (
            {"rollout": {"phase": "Stable"}},
            {
                "rollout": {
                    "phase": "Progressing",
                    "reason": "CanaryStarted",
                    "message": "m",
                    "canaryRevision": "c",
                    "step": 0,
                    "canaryWeight": 20,
                }
            },
            ["rollout Stable -> Progressing (CanaryStarted: m)", "canary c: step 1, 20% of traffic"],
        ),
        (
            {
                "rollout": {
                    "phase": "Progressing",
                    "canaryRevision": "c",
                    "step": 0,
                    "canaryWeight": 20,
                    "analysis": [{"time": "t1", "step": 0, "verdict": "Pass", "message": "ok"}],
                }
            },
            {
                "rollout": {
                    "phase": "Progressing",
                    "canaryRevision": "c",
                    "step": 0,
                    "canaryWeight": 20,
                    "analysis": [
                        {"time": "t1", "step": 0, "verdict": "Pass", "message": "ok"},
                        {"time": "t2", "step": 0, "verdict": "Fail", "message": "errors"},
                    ],
                }
            },
            ["analysis (step 1): Fail - errors"],
        ),
        (
            {},
            {
                "autoscaling": {
                    "variants": [
                        {
                            "name": "d",
                            "lastDecisions": [
                                {"time": "t", "currentReplicas": 1, "desiredReplicas": 2, "reason": "queue"}
                            ],
                        }
                    ]
                }
            },
            ["autoscaler (d): 1 -> 2 pods: queue"],
        ),
    ],
)
def test_rollout_changes(before, after, lines):
    assert rollout_changes({"status": before}, {"status": after}) == lines


def test_plan_steps_skips_steps_whose_features_are_missing_and_says_why():
    planned = plan_steps(TOUR, present=lambda module: module != "fleet_operator.autoscaler")
    outcome = {step.needs: skip for step, skip in planned}
    assert "autoscaler.py" in outcome[("autoscaling",)]
    assert outcome[("canary",)] is None and outcome[("canary", "faults")] is None
    assert all(skip is None for _step, skip in plan_steps(TOUR, present=lambda _m: True))


@pytest.mark.parametrize(
    ("lines", "kind"),
    [
        (
            [
                'data: {"choices":[{"delta":{"content":"a"}}]}',
                'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}',
                "data: [DONE]",
            ],
            "ok",
        ),
        (['data: {"choices":[{"delta":{"content":"a"}}]}', "data: [DONE]"], "mid_stream"),  # no finish reason
        (['data: {"choices":[{"delta":{"content":"a"}}]}'], "mid_stream"),  # cut before [DONE]
        (['data: {"choices":[{"delta":{},"finish_reason":"length"}]}', ": keep-alive", "data: [DONE]"], "ok"),
        (["data: {not json"], "mid_stream"),
    ],
)
def test_classify_stream(lines, kind):
    assert classify_stream(iter(lines))[0] == kind


def test_sse_payloads_stop_at_done():
    assert list(sse_payloads(iter(["data: {}", "data: [DONE]", 'data: {"x": 1}']))) == [{}, None]


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"operator_env": {"PATH": "/x"}}, "LLMFLEET_OPERATOR_"),
        ({"namespace": "Bad_NS"}, "namespace"),
        ({"scrape_interval_s": 0}, "scrape_interval_s"),
        ({"log_level": "loud"}, "log_level"),
    ],
)
def test_fleet_settings_reject_bad_values(fields, error):
    with pytest.raises(ValidationError, match=error):
        FleetSettings(**fields)


@pytest.mark.parametrize(
    ("observed", "phase", "settled"),
    [
        (4, "RolledBack", False),  # the previous rollout's outcome, read before the operator saw the change
        (5, "Progressing", False),
        (5, "RolledBack", True),
        (6, "Stable", True),
    ],
)
def test_rollout_settled_needs_the_new_generation(observed, phase, settled):
    resource = {"status": {"observedGeneration": observed, "rollout": {"phase": phase}}}
    assert rollout_settled(resource, 5, ("RolledBack", "Stable")) is settled


def test_run_tour_reports_each_step_and_survives_a_failing_one():
    import io

    from rich.console import Console

    from llmfleet.scenario import Step, TourContext, run_tour

    def boom(_ctx):
        raise RuntimeError("no pods")

    steps = (
        Step("works", ("canary",), lambda _ctx: "Stable", "e1"),
        Step("breaks", ("canary",), boom, "e2"),
        Step("waits", ("autoscaling",), lambda _ctx: "never", "e3"),
    )
    out = io.StringIO()
    ctx = TourContext(
        Console(file=out, width=200),
        kube=None,
        gateway_url="",
        api_key="",
        namespace="default",
        name="d",
        model="d",
        examples=REPO / "examples",
    )
    results = run_tour(ctx, steps, present=lambda module: "autoscal" not in module)
    assert [r[1].split(":")[0] for r in results] == ["ran", "failed", "skipped"]
    assert results[0][1] == "ran: Stable" and "no pods" in results[1][1] and "autoscaler.py" in results[2][1]
    assert "skipped" in out.getvalue() and "scenario 3/3: waits" in out.getvalue()


def test_a_work_dir_serves_one_fleet_at_a_time_and_only_the_fleets_files_are_reset(tmp_path):
    from llmfleet.localfleet import LocalFleet
    from llmfleet.processes import ProcessError

    (tmp_path / "kubeconfig").write_text("old")
    (tmp_path / "prometheus-data").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    first = LocalFleet(FleetSettings(work_dir=tmp_path))
    first._prepare_work_dir()
    try:
        assert not (tmp_path / "kubeconfig").exists() and not (tmp_path / "prometheus-data").exists()
        assert (tmp_path / "notes.txt").read_text() == "mine"
        with pytest.raises(ProcessError, match="another local fleet is running"):
            LocalFleet(FleetSettings(work_dir=tmp_path))._prepare_work_dir()
    finally:
        first.stop()
    second = LocalFleet(FleetSettings(work_dir=tmp_path))
    second._prepare_work_dir()  # free again once the first stopped
    second.stop()
    assert tmp_path.is_dir()  # a given work dir is never removed
