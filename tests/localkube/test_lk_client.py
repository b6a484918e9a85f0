"""Conformance: the kubernetes Python client (and raw HTTP where the client hides the wire) against localkube."""

from __future__ import annotations

import json
import threading

import httpx
import kubernetes
import pytest
from kubernetes import watch
from kubernetes.client import ApiException

from localkube import Cluster
from localkube.testing import wait_for

GROUP, VERSION, PLURAL = "example.com", "v1", "widgets"


def new_widget(name: str = "", generate: str = "", **spec) -> dict:
    meta = {"name": name} if name else {"generateName": generate}
    return {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": meta, "spec": {"size": "small", **spec}}


def status_of(exc: ApiException) -> dict:
    return json.loads(exc.body)


def test_create_list_watch_patch_status(widgets, namespace):
    created = widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget(generate="w-"))
    name = created["metadata"]["name"]
    assert name.startswith("w-") and len(name) == len("w-") + 5
    listing = widgets.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    assert listing["kind"] == "WidgetList" and [i["metadata"]["name"] for i in listing["items"]] == [name]
    seen: list[tuple[str, dict]] = []
    ready = threading.Event()

    def follow() -> None:
        stream = watch.Watch().stream(
            widgets.list_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            resource_version=listing["metadata"]["resourceVersion"],
            timeout_seconds=10,
        )
        ready.set()
        for event in stream:
            seen.append((event["type"], event["object"]))
            if event["type"] == "DELETED":
                return

    thread = threading.Thread(target=follow)
    thread.start()
    ready.wait(5)
    patched = widgets.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": {"replicas": 2, "phase": "Running"}}
    )
    assert patched["status"] == {"replicas": 2, "phase": "Running"} and patched["metadata"]["generation"] == 1
    spec_patched = widgets.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": 4}}
    )
    assert spec_patched["metadata"]["generation"] == 2 and spec_patched["status"]["replicas"] == 2
    widgets.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    thread.join(15)
    assert [kind for kind, _ in seen] == ["MODIFIED", "MODIFIED", "DELETED"]
    versions = [int(obj["metadata"]["resourceVersion"]) for _, obj in seen]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert seen[0][1]["status"]["phase"] == "Running" and seen[1][1]["spec"]["replicas"] == 4


def test_errors_are_status_objects(widgets, namespace):
    widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget("dup"))
    with pytest.raises(ApiException) as exists:
        widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget("dup"))
    body = status_of(exists.value)
    assert exists.value.status == 409 and body["reason"] == "AlreadyExists" and body["kind"] == "Status"
    assert body["details"] == {"name": "dup", "group": "example.com", "kind": "widgets"}
    with pytest.raises(ApiException) as missing:
        widgets.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "nope")
    assert missing.value.status == 404 and status_of(missing.value)["message"] == 'widgets.example.com "nope" not found'
    with pytest.raises(ApiException) as invalid:
        widgets.create_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            {
                "apiVersion": "example.com/v1",
                "kind": "Widget",
                "metadata": {"name": "inv"},
                "spec": {
                    "size": "small",
                    "variants": [{"name": "a", "autoscaling": {"minReplicas": 0, "maxReplicas": 500}}],
                },
            },
        )
    body = status_of(invalid.value)
    assert invalid.value.status == 422 and body["reason"] == "Invalid"
    fields = {c["field"]: c["reason"] for c in body["details"]["causes"]}
    assert fields == {
        "spec.variants[0].autoscaling.minReplicas": "FieldValueInvalid",
        "spec.variants[0].autoscaling.maxReplicas": "FieldValueInvalid",
    }
    with pytest.raises(ApiException) as bad_name:
        widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget("Not_A_Name"))
    assert (
        bad_name.value.status == 422 and status_of(bad_name.value)["details"]["causes"][0]["field"] == "metadata.name"
    )


def test_stale_resource_version_conflicts(widgets, namespace):
    obj = widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget("cas"))
    obj["spec"]["replicas"] = 2
    updated = widgets.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "cas", obj)
    assert int(updated["metadata"]["resourceVersion"]) > int(obj["metadata"]["resourceVersion"])
    obj["spec"]["replicas"] = 3  # still carries the old resourceVersion
    with pytest.raises(ApiException) as conflict:
        widgets.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "cas", obj)
    assert conflict.value.status == 409 and status_of(conflict.value)["reason"] == "Conflict"
    # a JSON patch whose test fails is rejected (kopf's finalizer patches rely on this)
    with pytest.raises(ApiException) as failed:
        widgets.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "cas",
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": obj["metadata"]["resourceVersion"]},
                {"op": "replace", "path": "/spec/replicas", "value": 9},
            ],
            _content_type="application/json-patch+json",
        )
    assert failed.value.status == 422
    assert widgets.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "cas")["spec"]["replicas"] == 2


def test_no_op_update_keeps_resource_version(widgets, namespace):
    obj = widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget("same"))
    again = widgets.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "same", {"spec": {"size": "small"}}
    )
    assert again["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_status_endpoint_ignores_spec_and_main_ignores_status(widgets, namespace):
    obj = widgets.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, {**new_widget("split"), "status": {"phase": "ignored-on-create"}}
    )
    assert "status" not in obj
    obj["spec"]["replicas"] = 7
    obj["status"] = {"phase": "Set"}
    via_status = widgets.replace_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "split", obj)
    assert via_status["status"] == {"phase": "Set"} and via_status["spec"]["replicas"] == 1
    assert via_status["metadata"]["generation"] == 1


def test_labels_fields_pagination_and_deletecollection(widgets, namespace):
    for n in range(5):
        body = new_widget(f"p{n}")
        body["metadata"]["labels"] = {"batch": "a" if n < 3 else "b", "n": str(n)}
        widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    def names(**kw):
        return [
            i["metadata"]["name"]
            for i in widgets.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, **kw)["items"]
        ]

    assert names(label_selector="batch=a") == ["p0", "p1", "p2"]
    assert names(label_selector="batch in (b),n!=4") == ["p3"]
    assert names(label_selector="!missing,n") == ["p0", "p1", "p2", "p3", "p4"]
    assert names(field_selector="metadata.name=p4") == ["p4"]
    page = widgets.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, limit=2)
    assert [i["metadata"]["name"] for i in page["items"]] == ["p0", "p1"] and page["metadata"][
        "remainingItemCount"
    ] == 3
    rest = widgets.list_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, limit=10, _continue=page["metadata"]["continue"]
    )
    assert [i["metadata"]["name"] for i in rest["items"]] == ["p2", "p3", "p4"]
    with pytest.raises(ApiException) as unsupported:
        names(field_selector="spec.size=small")
    assert unsupported.value.status == 400 and "field label not supported" in status_of(unsupported.value)["message"]
    widgets.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, label_selector="batch=a")
    assert names() == ["p3", "p4"]


def test_watch_selector_transitions_and_initial_events(cluster, widgets, namespace):
    obj = new_widget("sel")
    obj["metadata"]["labels"] = {"watched": "yes"}
    widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, obj)
    url = f"{cluster.url}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    events: list[dict] = []
    open_before = cluster.call(lambda kube: kube.store.watch_count())
    with httpx.Client(timeout=10) as http:
        with http.stream(
            "GET",
            url,
            params={
                "watch": "1",
                "labelSelector": "watched=yes",
                "sendInitialEvents": "true",
                "allowWatchBookmarks": "true",
                "resourceVersionMatch": "NotOlderThan",
                "timeoutSeconds": "5",
            },
        ) as response:
            assert response.headers["content-type"].startswith("application/json")
            lines = response.iter_lines()
            events.append(json.loads(next(lines)))
            events.append(json.loads(next(lines)))
            widgets.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, "sel", {"metadata": {"labels": {"watched": "no"}}}
            )
            events.append(json.loads(next(lines)))
    # the client went away long before timeoutSeconds: the server notices and forgets the watch
    wait_for(lambda: cluster.call(lambda kube: kube.store.watch_count()) == open_before, what="the watch to be dropped")
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK", "DELETED"]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert events[2]["object"]["metadata"]["labels"] == {"watched": "no"}  # it left the selector


def test_watch_too_old_resource_version_is_gone(tmp_path):
    with Cluster(kubeconfig=tmp_path / "kc", kubelet=False, workdir=tmp_path, event_log_size=10) as small:
        client = kubernetes.config.new_client_from_config(str(small.kubeconfig))
        core = kubernetes.client.CoreV1Api(client)
        first = core.create_namespaced_config_map("default", {"metadata": {"name": "c0"}})
        for n in range(1, 15):
            core.create_namespaced_config_map("default", {"metadata": {"name": f"c{n}"}})
        with pytest.raises(ApiException) as gone:
            for _ in watch.Watch().stream(
                core.list_namespaced_config_map,
                "default",
                resource_version=first.metadata.resource_version,
                timeout_seconds=2,
            ):
                pass
        assert gone.value.status == 410
        client.close()


def test_garbage_collection_background_foreground_orphan(api, widgets, namespace):
    core = kubernetes.client.CoreV1Api(api)

    def owned(name: str, owner: dict, block: bool = False, finalizers=None) -> None:
        meta = {
            "name": name,
            "ownerReferences": [
                {
                    "apiVersion": "example.com/v1",
                    "kind": "Widget",
                    "name": owner["metadata"]["name"],
                    "uid": owner["metadata"]["uid"],
                    "blockOwnerDeletion": block,
                }
            ],
        }
        if finalizers:
            meta["finalizers"] = finalizers
        core.create_namespaced_config_map(namespace, {"metadata": meta})

    def exists(name: str) -> bool:
        try:
            core.read_namespaced_config_map(name, namespace)
            return True
        except ApiException:
            return False

    bg = widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget("bg"))
    owned("bg-child", bg)
    widgets.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "bg")
    wait_for(lambda: not exists("bg-child"), what="background cascade")

    fg = widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget("fg"))
    owned("fg-child", fg, block=True, finalizers=["example.com/slow"])
    widgets.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fg", propagation_policy="Foreground")
    child = wait_for(
        lambda: (c := core.read_namespaced_config_map("fg-child", namespace)).metadata.deletion_timestamp and c,
        what="the dependent to be deleting",
    )
    owner = widgets.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fg")
    assert owner["metadata"]["finalizers"] == ["foregroundDeletion"]  # waits for its blocking dependent
    core.patch_namespaced_config_map("fg-child", namespace, {"metadata": {"finalizers": None}})
    assert child.metadata.name == "fg-child"
    wait_for(
        lambda: (
            not widgets.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, field_selector="metadata.name=fg"
            )["items"]
        ),
        what="foreground owner removal",
    )

    orphan = widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget("orph"))
    owned("orph-child", orphan)
    widgets.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "orph", propagation_policy="Orphan")
    wait_for(
        lambda: not core.read_namespaced_config_map("orph-child", namespace).metadata.owner_references,
        what="ownerReferences to be removed",
    )
    assert exists("orph-child")


def test_finalizers_block_deletion_and_cannot_be_added_late(widgets, namespace):
    obj = new_widget("fin")
    obj["metadata"]["finalizers"] = ["example.com/a"]
    widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, obj)
    deleting = widgets.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fin")
    assert deleting["metadata"]["deletionTimestamp"]
    with pytest.raises(ApiException) as late:
        widgets.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "fin", {"metadata": {"finalizers": ["example.com/a", "example.com/b"]}}
        )
    assert late.value.status == 422
    widgets.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fin", {"metadata": {"finalizers": []}})
    with pytest.raises(ApiException) as gone:
        widgets.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fin")
    assert gone.value.status == 404


def test_delete_preconditions(api, namespace):
    core = kubernetes.client.CoreV1Api(api)
    cm = core.create_namespaced_config_map(namespace, {"metadata": {"name": "pre"}})
    with pytest.raises(ApiException) as wrong:
        core.delete_namespaced_config_map("pre", namespace, body={"preconditions": {"uid": "not-the-uid"}})
    assert wrong.value.status == 409
    core.delete_namespaced_config_map("pre", namespace, body={"preconditions": {"uid": cm.metadata.uid}})


def test_table_and_partial_metadata(cluster, widgets, namespace):
    widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, new_widget("tab", replicas=2))
    url = f"{cluster.url}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    table = httpx.get(url, headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}).json()
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Size", "Replicas", "Ready", "Age"]
    cells = table["rows"][0]["cells"]
    assert cells[:4] == ["tab", "small", 2, None] and table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    meta = httpx.get(url, headers={"Accept": "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io"}).json()
    assert meta["kind"] == "PartialObjectMetadataList" and "spec" not in meta["items"][0]


def test_http_errors_for_methods_media_and_paths(cluster, namespace):
    base = f"{cluster.url}/api/v1/namespaces/{namespace}/configmaps"
    assert httpx.put(base, json={}).json()["code"] == 405
    assert httpx.get(f"{cluster.url}/apis/nope.io/v1/things").status_code == 404
    proto = httpx.post(base, content=b"k8s\x00", headers={"Content-Type": "application/vnd.kubernetes.protobuf"})
    assert proto.status_code == 415 and proto.json()["reason"] == "UnsupportedMediaType"
    httpx.post(base, json={"metadata": {"name": "smp"}, "data": {"a": "1"}})
    wrong = httpx.patch(f"{base}/smp", content=b"{}", headers={"Content-Type": "text/plain"})
    assert wrong.status_code == 415
    crd_smp = httpx.patch(
        f"{cluster.url}/apis/example.com/v1/namespaces/{namespace}/widgets/x",
        content=b"{}",
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )
    assert crd_smp.status_code in (404, 415)
    assert httpx.get(f"{base}/missing").json()["reason"] == "NotFound"


def test_events_in_both_api_groups(api, namespace):
    core = kubernetes.client.CoreV1Api(api)
    events_v1 = kubernetes.client.EventsV1Api(api)
    events_v1.create_namespaced_event(
        namespace,
        {
            "metadata": {"name": "e1"},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "reason": "Scaled",
            "note": "scaled up",
            "type": "Normal",
            "action": "Scale",
            "reportingController": "test/ctl",
            "reportingInstance": "test-1",
            "regarding": {"kind": "Pod", "name": "p", "namespace": namespace},
        },
    )
    event = core.read_namespaced_event("e1", namespace)
    assert (
        event.message == "scaled up" and event.involved_object.name == "p" and event.reporting_component == "test/ctl"
    )
    listed = core.list_namespaced_event(namespace, field_selector="involvedObject.name=p,reason=Scaled")
    assert [e.metadata.name for e in listed.items] == ["e1"]
    assert events_v1.read_namespaced_event("e1", namespace).note == "scaled up"


def test_leases_and_disruption_budgets(api, namespace):
    coordination = kubernetes.client.CoordinationV1Api(api)
    lease = coordination.create_namespaced_lease(
        namespace, {"metadata": {"name": "leader"}, "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}}
    )
    lease.spec.holder_identity = "b"
    assert coordination.replace_namespaced_lease("leader", namespace, lease).spec.holder_identity == "b"
    policy = kubernetes.client.PolicyV1Api(api)
    policy.create_namespaced_pod_disruption_budget(
        namespace,
        {"metadata": {"name": "pdb"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "none"}}}},
    )
    budget = wait_for(
        lambda: (b := policy.read_namespaced_pod_disruption_budget("pdb", namespace)).status.observed_generation and b,
        what="PDB status",
    )
    assert budget.status.disruptions_allowed == 0 and budget.status.expected_pods == 0


def test_namespace_lifecycle(api):
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": "short-lived"}})
    assert wait_for(lambda: core.list_namespaced_service_account("short-lived").items, what="default service account")
    core.create_namespaced_config_map("short-lived", {"metadata": {"name": "c", "finalizers": ["example.com/hold"]}})
    core.delete_namespace("short-lived")
    assert core.read_namespace("short-lived").status.phase == "Terminating"  # held by the config map's finalizer
    with pytest.raises(ApiException) as forbidden:
        core.create_namespaced_config_map("short-lived", {"metadata": {"name": "late"}})
    assert forbidden.value.status == 403
    held = wait_for(
        lambda: (c := core.read_namespaced_config_map("c", "short-lived")).metadata.deletion_timestamp and c,
        what="the namespace controller to delete the contents",
    )
    assert held.metadata.finalizers == ["example.com/hold"]
    core.patch_namespaced_config_map("c", "short-lived", {"metadata": {"finalizers": None}})
    wait_for(
        lambda: "short-lived" not in [n.metadata.name for n in core.list_namespace().items], what="namespace removal"
    )
    with pytest.raises(ApiException) as missing:
        core.create_namespaced_config_map("short-lived", {"metadata": {"name": "later"}})
    assert missing.value.status == 404


def test_old_events_expire(cluster, api, namespace):
    import datetime as dt

    core = kubernetes.client.CoreV1Api(api)
    involved = {"kind": "ConfigMap", "name": "x", "namespace": namespace}
    core.create_namespaced_event(
        namespace,
        {
            "metadata": {"name": "old"},
            "involvedObject": involved,
            "reason": "R",
            "lastTimestamp": "2020-01-01T00:00:00Z",
        },
    )
    core.create_namespaced_event(namespace, {"metadata": {"name": "new"}, "involvedObject": involved, "reason": "R"})
    cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    assert cluster.call(lambda kube: kube.controllers.expire_events(cutoff)) >= 1
    assert [e.metadata.name for e in core.list_namespaced_event(namespace).items] == ["new"]


def test_status_writes_are_pruned_and_validated(api, namespace):
    ext = kubernetes.client.ApiextensionsV1Api(api)
    ext.create_custom_resource_definition(
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "typedstatuses.example.com"},
            "spec": {
                "group": "example.com",
                "scope": "Namespaced",
                "names": {"plural": "typedstatuses", "kind": "TypedStatus"},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "subresources": {"status": {}},
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "properties": {
                                    "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                    "status": {
                                        "type": "object",
                                        "properties": {"replicas": {"type": "integer", "minimum": 0}},
                                    },
                                },
                            }
                        },
                    }
                ],
            },
        }
    )
    objects = kubernetes.client.CustomObjectsApi(api)
    wait_for(lambda: _served(objects, namespace), what="the new resource to be served")
    objects.create_namespaced_custom_object(
        "example.com",
        "v1",
        namespace,
        "typedstatuses",
        {"apiVersion": "example.com/v1", "kind": "TypedStatus", "metadata": {"name": "t"}},
    )
    written = objects.patch_namespaced_custom_object_status(
        "example.com", "v1", namespace, "typedstatuses", "t", {"status": {"replicas": 2, "undeclared": "dropped"}}
    )
    assert written["status"] == {"replicas": 2}
    with pytest.raises(ApiException) as invalid:
        objects.patch_namespaced_custom_object_status(
            "example.com", "v1", namespace, "typedstatuses", "t", {"status": {"replicas": -1}}
        )
    assert (
        invalid.value.status == 422 and status_of(invalid.value)["details"]["causes"][0]["field"] == "status.replicas"
    )


def _served(objects, namespace: str) -> bool:
    try:
        objects.list_namespaced_custom_object("example.com", "v1", namespace, "typedstatuses")
        return True
    except ApiException:
        return False
