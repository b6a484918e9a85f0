"""Conformance: a real kopf operator (create/update/delete handlers, finalizers, status patches, events)."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes
import pytest
from kubernetes.client import ApiException

from localkube.testing import wait_for

OPERATOR = Path(__file__).with_name("kopf_operator.py")
GROUP, VERSION, PLURAL = "example.com", "v1", "widgets"
FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def own_registry():
    """A fresh kopf registry for this operator, so its handlers never leak into other tests' kopf runs."""
    import kopf

    previous = kopf.get_default_registry()
    registry = kopf.OperatorRegistry()
    kopf.set_default_registry(registry)
    yield registry
    kopf.set_default_registry(previous)


def test_kopf_handlers_fire_once_each(cluster, api, widgets, namespace, tmp_path, monkeypatch, own_registry):
    from kopf.testing import KopfRunner

    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("LK_KOPF_LOG", str(log))
    monkeypatch.setenv("LK_KOPF_SERVER", cluster.url)
    core = kubernetes.client.CoreV1Api(api)

    def get() -> dict:
        return widgets.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "op")

    with KopfRunner(
        ["run", "--standalone", "--namespace", namespace, str(OPERATOR)], timeout=60, registry=own_registry
    ) as runner:
        widgets.create_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "op"}, "spec": {"size": "small"}},
        )
        created = wait_for(
            lambda: (o := get()).get("status", {}).get("phase") == "Created" and o,
            timeout=30,
            what="the create handler's status patch",
        )
        assert FINALIZER in created["metadata"]["finalizers"]
        assert created["status"]["on_create"] == {"size": "small"}  # the handler's return value, stored by kopf
        widgets.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "op", {"spec": {"size": "large"}})
        wait_for(lambda: get().get("status", {}).get("phase") == "Updated", timeout=30, what="the update handler")
        widgets.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "op")

        def deleted() -> bool:
            try:
                get()
                return False
            except ApiException as exc:
                return exc.status == 404

        wait_for(deleted, timeout=30, what="kopf to remove its finalizer")

        def kopf_events() -> list:
            found = [
                e
                for e in core.list_namespaced_event(namespace, field_selector="involvedObject.name=op").items
                if e.source and e.source.component == "kopf"
            ]
            return found if {"Provisioned", "Logging"} <= {e.reason for e in found} else []

        events = wait_for(kopf_events, what="kopf's explicit event and its logging events")
    assert runner.exception is None, runner.stdout
    assert [(c["handler"], c["generation"]) for c in calls(log)] == [("create", 1), ("update", 2), ("delete", 2)]
    assert any(e.message == "widget arrived" for e in events if e.reason == "Logging")
    assert all(
        e.involved_object.kind == "Widget" and e.involved_object.uid == created["metadata"]["uid"] for e in events
    )
