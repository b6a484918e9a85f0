"""A pass's one read of an InferenceDeployment (`DeploymentView`): its status, whether it is being deleted, and
the spec it runs (its own when valid, else the last valid one), parsed once however many readers share it."""

from __future__ import annotations

from typing import Any

import pytest

from controllers.running_spec import DeploymentView

VALID: dict[str, Any] = {
    "model": {"name": "m", "source": "bundled://smollm2-135m-instruct"},
    "variants": [{"name": "default", "replicas": 2}],
}
INVALID: dict[str, Any] = {"model": {"name": "m"}, "variants": []}


def resource(spec: Any = VALID, status: Any = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "demo", "namespace": "ns", "uid": "u"}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    out: dict[str, Any] = {"metadata": meta, "spec": spec}
    if status is not None:
        out["status"] = status
    return out


@pytest.mark.parametrize(
    ("obj", "deleting", "readable", "runs", "problems"),
    [
        (resource(), False, True, 2, False),
        (resource(deleting=True), True, True, 2, False),
        (resource(INVALID), False, True, None, True),
        (resource(INVALID, {"lastValidSpec": VALID}), False, True, 2, True),
        (resource(status={"observedGeneration": "not a number"}), False, False, 2, False),
        (resource(status="junk"), False, True, 2, False),  # not a mapping: read as no status
    ],
    ids=["valid", "deleting", "invalid", "invalid-falls-back", "unreadable-status", "status-not-a-mapping"],
)
def test_view(obj, deleting, readable, runs, problems):
    view = DeploymentView.of(obj)
    assert view.deleting is deleting and view.status_readable is readable
    assert view.meta["name"] == "demo" and view.raw_spec is obj["spec"]
    spec = view.running.spec
    assert (spec.variants[0].replicas if spec is not None else None) == runs
    assert bool(view.running.problems) is problems


def test_the_spec_is_parsed_once_and_a_view_is_its_own_view():
    view = DeploymentView.of(resource())
    assert view.running is view.running
    assert DeploymentView.of(view) is view
