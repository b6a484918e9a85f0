"""The worker-pod facts (`crds.pods`): what a draining marker means, readiness, the serving port."""

from __future__ import annotations

from typing import Any

import pytest

from crds.pods import (
    DRAINING,
    LABEL_REVISION,
    PORT_NAME,
    WORKER_PORT,
    host_port,
    is_draining,
    is_ready,
    marked,
    named_port,
    ready_condition,
)


def pod(
    *,
    labels: dict[str, Any] | None = None,
    annotations: dict[str, Any] | None = None,
    conditions: list[Any] | None = None,
    ports: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    out: dict[str, Any] = {"metadata": meta}
    if conditions is not None:
        out["status"] = {"conditions": conditions}
    if ports is not None:
        out["spec"] = {"containers": [{"name": "worker", "ports": ports}]}
    return out


@pytest.mark.parametrize(
    ("value", "draining"),
    [
        (None, False),
        ("", False),
        ("false", False),
        ("False", False),
        ("FALSE", False),
        ("0", False),
        (" false ", False),
        ("true", True),
        ("True", True),
        ("1", True),
        ("2024-05-01T12:00:00.000000Z", True),  # the annotation holds when the drain started
        (True, True),
        (False, False),
        (0, False),
    ],
)
def test_marked(value, draining):
    assert marked(value) is draining


@pytest.mark.parametrize(
    ("where", "value", "draining"),
    [
        ("label", "", False),
        ("label", "false", False),
        ("label", "0", False),
        ("label", "true", True),
        ("label", "False", False),
        ("annotation", "", False),
        ("annotation", "false", False),
        ("annotation", "0", False),
        ("annotation", "2024-05-01T12:00:00Z", True),
        ("annotation", "true", True),
        ("neither", None, False),
    ],
)
def test_is_draining_by_label_or_annotation(where, value, draining):
    marks = {DRAINING: value}
    subject = pod(
        labels=marks if where == "label" else {LABEL_REVISION: "r1"},
        annotations=marks if where == "annotation" else None,
    )
    assert is_draining(subject) is draining


def test_is_draining_when_either_is_marked():
    assert is_draining(pod(labels={DRAINING: "false"}, annotations={DRAINING: "2024-05-01T12:00:00Z"}))
    assert is_draining(pod(labels={DRAINING: "true"}, annotations={DRAINING: ""}))
    assert not is_draining({})


READY = {"type": "Ready", "status": "True", "lastTransitionTime": "2024-05-01T12:00:00Z"}


@pytest.mark.parametrize(
    ("conditions", "ready"),
    [
        (None, False),
        ([], False),
        ([{"type": "Ready", "status": "False"}], False),
        ([{"type": "Ready", "status": "Unknown"}], False),
        ([{"type": "ContainersReady", "status": "True"}], False),
        ([READY], True),
        ([{"type": "PodScheduled", "status": "True"}, READY], True),
        (["junk", READY], True),
    ],
)
def test_is_ready(conditions, ready):
    assert is_ready(pod(conditions=conditions)) is ready
    assert (ready_condition(pod(conditions=conditions)) == READY) is ready


@pytest.mark.parametrize(
    ("ports", "port"),
    [
        (None, None),
        ([], None),
        ([{"name": "metrics", "containerPort": 9000}], None),
        ([{"name": PORT_NAME, "containerPort": "8001"}], None),
        ([{"name": "metrics", "containerPort": 9000}, {"name": PORT_NAME, "containerPort": 8001}], 8001),
    ],
)
def test_named_port(ports, port):
    assert named_port(pod(ports=ports)) == port


def test_worker_port_and_host_port():
    assert WORKER_PORT == 8000
    assert host_port("10.0.0.7", WORKER_PORT) == "10.0.0.7:8000"
    assert host_port("fd00::7", 8001) == "[fd00::7]:8001"
