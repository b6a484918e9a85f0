"""The executor against a scripted in-memory API: idempotence, retries, error reporting, events."""

from __future__ import annotations

import asyncio

import pytest
from fleet_operator.execute import execute
from fleet_operator.kube import ApiError
from fleet_operator.testing import DEPLOYMENT as RESOURCE
from fleet_operator.testing import ScriptedApi

from controllers import (
    CreatePod,
    DeletePod,
    EmitEvent,
    EnsureNetworkPolicy,
    EventType,
    PatchStatus,
    Plan,
)


def _create(name: str) -> CreatePod:
    return CreatePod({"metadata": {"name": name}}, "v", "r", "ScaleUp", "wants more")


def _error(status: int, reason: str) -> ApiError:
    return ApiError(status, reason, "msg", "call")


def _run(api: ScriptedApi, plan: Plan) -> list[str]:
    return asyncio.run(execute(api, plan, RESOURCE))  # type: ignore[arg-type]


def test_already_exists_and_not_found_count_as_done():
    api = ScriptedApi(
        {
            ("create", "/api/v1/namespaces/ns/pods"): [_error(409, "AlreadyExists")],
            ("delete", "/api/v1/namespaces/ns/pods/gone"): [_error(404, "NotFound")],
        }
    )
    plan = Plan(actions=(_create("p0"), DeletePod("gone", "uid-gone", "v", "r", "ScaleDown", "fewer")))
    assert _run(api, plan) == []
    assert ("delete", "/api/v1/namespaces/ns/pods/gone", "uid-gone") in api.calls  # uid precondition sent


def test_conflicts_are_retried():
    api = ScriptedApi(
        {
            ("patch", "/apis/llmfleet.io/v1alpha1/namespaces/ns/inferencedeployments/m/status"): [
                _error(409, "Conflict"),
                _error(503, "ServiceUnavailable"),
            ]
        }
    )
    assert _run(api, Plan(actions=(PatchStatus({"phase": "Available"}),))) == []
    patches = [c for c in api.calls if c[0] == "patch"]
    assert len(patches) == 3 and patches[-1][2] == {"status": {"phase": "Available"}}


def test_failures_are_reported_not_raised_and_other_actions_still_run():
    api = ScriptedApi({("create", "/api/v1/namespaces/ns/pods"): [_error(403, "Forbidden")]})
    errors = _run(api, Plan(actions=(_create("p0"), EmitEvent(EventType.NORMAL, "Scaled", "1 -> 2"))))
    assert len(errors) == 1 and "403 Forbidden" in errors[0] and "create pod p0" in errors[0]
    reasons = {(e["type"], e["reason"]) for e in api.events()}
    assert reasons == {("Normal", "Scaled"), ("Warning", "ApiError")}


def test_successful_pod_changes_are_recorded_as_events():
    api = ScriptedApi()
    plan = Plan(actions=(_create("p0"), _create("p1"), DeletePod("p9", "u9", "v", "r", "ScaleDown", "fewer")))
    assert _run(api, plan) == []
    events = api.events()
    assert sorted(e["reason"] for e in events) == ["CreatedPod", "CreatedPod", "DeletedPod"]
    assert all(e["involvedObject"]["uid"] == "u" and e["source"]["component"] == "llmfleet-operator" for e in events)


NETPOLS = "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies"


def test_network_policy_is_created_and_an_existing_one_gets_its_spec_back():
    manifest = {"metadata": {"name": "m-workers"}, "spec": {"podSelector": {}, "ingress": [{"from": []}]}}
    fresh = ScriptedApi()
    assert _run(fresh, Plan(actions=(EnsureNetworkPolicy(manifest),))) == []
    assert fresh.calls[0] == ("create", NETPOLS, manifest)
    existing = ScriptedApi({("create", NETPOLS): [_error(409, "AlreadyExists")]})
    assert _run(existing, Plan(actions=(EnsureNetworkPolicy(manifest),))) == []
    assert ("patch", f"{NETPOLS}/m-workers", {"spec": manifest["spec"]}) in existing.calls


def test_no_secret_is_ever_read_or_written():
    api = ScriptedApi()
    manifest = {"metadata": {"name": "m-workers"}, "spec": {}}
    assert _run(api, Plan(actions=(_create("p0"), EnsureNetworkPolicy(manifest)))) == []
    assert not [c for c in api.calls if "/secrets" in c[1]]


@pytest.mark.parametrize("status", [400, 422])
def test_invalid_requests_are_not_retried(status):
    api = ScriptedApi({("create", "/api/v1/namespaces/ns/pods"): [_error(status, "Invalid")] * 4})
    assert len(_run(api, Plan(actions=(_create("p0"),)))) == 1
    assert len([c for c in api.calls if c[1].endswith("/pods")]) == 1
