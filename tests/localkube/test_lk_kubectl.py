"""Conformance: the real kubectl binary against localkube (CRDs, printer columns, apply/scale/annotate/patch/wait/delete)."""

from __future__ import annotations

import json

import pytest
import yaml

from localkube.testing import wait_for


def widget(obj_name: str, namespace: str, **spec) -> dict:
    return {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": obj_name, "namespace": namespace},
        "spec": {"size": "small", **spec},
    }


@pytest.fixture
def crd(kubectl, widget_crd):
    out = kubectl.apply(yaml.safe_dump(widget_crd))
    assert "customresourcedefinition.apiextensions.k8s.io/widgets.example.com" in out
    kubectl("wait", "--for=condition=established", "crd/widgets.example.com", "--timeout=20s")
    return widget_crd


def test_version_and_discovery(kubectl, crd):
    version = json.loads(kubectl("version", "-o", "json"))
    assert version["serverVersion"]["major"] == "1"
    resources = kubectl("api-resources")
    for line in ("pods ", "customresourcedefinitions", "leases", "poddisruptionbudgets", "widgets"):
        assert line in resources
    widgets_line = next(line for line in resources.splitlines() if line.startswith("widgets"))
    assert widgets_line.split()[1:] == ["wd", "example.com/v1", "true", "Widget"]
    group = json.loads(kubectl("get", "--raw", "/apis/example.com/v1"))
    names = {r["name"] for r in group["resources"]}
    assert {"widgets", "widgets/status", "widgets/scale"} <= names


def test_apply_get_printer_columns_and_yaml(kubectl, crd, namespace):
    out = kubectl.apply(widget("w1", namespace))
    assert "widget.example.com/w1 created" in out
    table = kubectl("get", "wd", "-n", namespace)
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "SIZE", "REPLICAS", "READY", "AGE"]
    cells = row.split()
    assert cells[:3] == ["w1", "small", "1"]  # replicas came from the schema default
    assert cells[3].endswith("s") or cells[3].endswith("m")  # no Ready condition yet: the AGE column follows
    obj = yaml.safe_load(kubectl("get", "wd", "w1", "-n", namespace, "-o", "yaml"))
    meta = obj["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and int(meta["resourceVersion"]) > 0
    assert meta["creationTimestamp"].endswith("Z")
    assert obj["spec"] == {"size": "small", "replicas": 1}
    # re-applying the same manifest changes nothing
    assert "unchanged" in kubectl.apply(widget("w1", namespace))
    again = yaml.safe_load(kubectl("get", "wd", "w1", "-n", namespace, "-o", "yaml"))
    assert again["metadata"]["resourceVersion"] == meta["resourceVersion"]


def test_validation_errors_name_fields(kubectl, crd, namespace):
    bad = widget(
        "bad",
        namespace,
        size="medium",
        replicas=-1,
        name="UPPER",
        variants=[{"name": "a", "autoscaling": {"minReplicas": 0}}, {"autoscaling": {}}],
    )
    result = kubectl.run("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert result.returncode != 0
    err = result.stderr
    assert 'The Widget "bad" is invalid' in err
    assert 'spec.size: Unsupported value: "medium": supported values: "small", "large"' in err
    assert "spec.replicas: Invalid value: -1" in err
    assert "spec.variants[0].autoscaling.minReplicas: Invalid value: 0" in err
    assert "spec.variants[1].name: Required value" in err
    assert 'spec.name: Invalid value: "UPPER"' in err
    unknown = kubectl.run("apply", "-f", "-", input=json.dumps(widget("bad", namespace, colour="red")), check=False)
    assert unknown.returncode != 0 and 'unknown field "spec.colour"' in unknown.stderr
    missing = kubectl.run("get", "wd", "bad", "-n", namespace, check=False)
    assert missing.returncode != 0 and 'widgets.example.com "bad" not found' in missing.stderr


def test_int_or_string_and_preserved_fields(kubectl, crd, namespace):
    kubectl.apply(widget("ios", namespace, port="http", extra={"anything": {"goes": [1, 2]}}))
    obj = kubectl.json("get", "wd", "ios", "-n", namespace)
    assert obj["spec"]["port"] == "http" and obj["spec"]["extra"] == {"anything": {"goes": [1, 2]}}
    bad = kubectl.run("apply", "-f", "-", input=json.dumps(widget("ios2", namespace, port=[1])), check=False)
    assert bad.returncode != 0 and "spec.port" in bad.stderr


def test_scale_annotate_patch_and_generation(kubectl, crd, namespace):
    kubectl.apply(widget("w2", namespace))
    assert "scaled" in kubectl("scale", "wd/w2", "--replicas=3", "-n", namespace)
    obj = kubectl.json("get", "wd", "w2", "-n", namespace)
    assert obj["spec"]["replicas"] == 3 and obj["metadata"]["generation"] == 2
    scale = json.loads(kubectl("get", "--raw", f"/apis/example.com/v1/namespaces/{namespace}/widgets/w2/scale"))
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    kubectl("annotate", "wd", "w2", "team=ml", "-n", namespace)
    kubectl("label", "wd", "w2", "tier=gold", "-n", namespace)
    obj = kubectl.json("get", "wd", "w2", "-n", namespace)
    assert obj["metadata"]["annotations"]["team"] == "ml" and obj["metadata"]["labels"]["tier"] == "gold"
    assert obj["metadata"]["generation"] == 2  # metadata changes do not bump generation
    kubectl("patch", "wd", "w2", "-n", namespace, "--type", "merge", "-p", '{"spec":{"size":"large"}}')
    obj = kubectl.json("get", "wd", "w2", "-n", namespace)
    assert obj["spec"]["size"] == "large" and obj["metadata"]["generation"] == 3
    kubectl(
        "patch",
        "wd",
        "w2",
        "-n",
        namespace,
        "--subresource=status",
        "--type",
        "merge",
        "-p",
        '{"status":{"replicas":3,"conditions":[{"type":"Ready","status":"True"}]}}',
    )
    obj = kubectl.json("get", "wd", "w2", "-n", namespace)
    assert obj["status"]["replicas"] == 3 and obj["metadata"]["generation"] == 3  # status does not bump it
    row = kubectl("get", "wd", "w2", "-n", namespace, "--no-headers").split()
    assert row[:4] == ["w2", "large", "3", "True"]
    assert kubectl("get", "wd", "-n", namespace, "-l", "tier=gold", "-o", "name").split() == ["widget.example.com/w2"]
    assert kubectl("get", "wd", "-n", namespace, "-l", "tier!=gold", "-o", "name").split() == []
    # a status change through the main endpoint is ignored when the status subresource exists
    kubectl("patch", "wd", "w2", "-n", namespace, "--type", "merge", "-p", '{"status":{"replicas":99}}')
    assert kubectl.json("get", "wd", "w2", "-n", namespace)["status"]["replicas"] == 3


def test_describe_shows_object_and_events(kubectl, crd, namespace, api):
    import kubernetes

    kubectl.apply(widget("w3", namespace))
    obj = kubectl.json("get", "wd", "w3", "-n", namespace)
    kubernetes.client.CoreV1Api(api).create_namespaced_event(
        namespace,
        {
            "metadata": {"generateName": "w3-"},
            "type": "Warning",
            "reason": "TooSmall",
            "message": "this widget is small",
            "involvedObject": {
                "apiVersion": "example.com/v1",
                "kind": "Widget",
                "name": "w3",
                "namespace": namespace,
                "uid": obj["metadata"]["uid"],
            },
            "source": {"component": "test"},
            "count": 1,
            "firstTimestamp": obj["metadata"]["creationTimestamp"],
            "lastTimestamp": obj["metadata"]["creationTimestamp"],
        },
    )
    text = kubectl("describe", "wd", "w3", "-n", namespace)
    assert "Name:         w3" in text and "Size:      small" in text
    assert "TooSmall" in text and "this widget is small" in text


def test_wait_for_condition(kubectl, crd, namespace):
    kubectl.apply(widget("w4", namespace))
    waiter = kubectl.popen("wait", "--for=condition=Ready", "wd/w4", "-n", namespace, "--timeout=30s")
    kubectl(
        "patch",
        "wd",
        "w4",
        "-n",
        namespace,
        "--subresource=status",
        "--type",
        "merge",
        "-p",
        '{"status":{"conditions":[{"type":"Ready","status":"True"}]}}',
    )
    out, err = waiter.communicate(timeout=40)
    assert waiter.returncode == 0, err
    assert "condition met" in out


def test_delete_waits_for_finalizers(kubectl, crd, namespace):
    manifest = widget("w5", namespace)
    manifest["metadata"]["finalizers"] = ["example.com/hold"]
    kubectl.apply(manifest)
    deleter = kubectl.popen("delete", "wd", "w5", "-n", namespace, "--timeout=30s")
    obj = wait_for(
        lambda: (o := kubectl.json("get", "wd", "w5", "-n", namespace))["metadata"].get("deletionTimestamp") and o,
        what="deletionTimestamp to be set",
    )
    assert obj["metadata"]["finalizers"] == ["example.com/hold"]
    assert deleter.poll() is None  # kubectl is still waiting for the object to go
    kubectl(
        "patch", "wd", "w5", "-n", namespace, "--type", "json", "-p", '[{"op":"remove","path":"/metadata/finalizers"}]'
    )
    out, err = deleter.communicate(timeout=40)
    assert deleter.returncode == 0, err
    assert 'widget.example.com "w5" deleted' in out
    gone = kubectl.run("get", "wd", "w5", "-n", namespace, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


def test_explain_uses_the_crd_schema(kubectl, crd):
    text = kubectl("explain", "widgets.spec")
    assert "KIND:       Widget" in text
    assert "size\t<string> -required-" in text and "small, large" in text


def test_builtin_tables_and_configmaps(kubectl, namespace):
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg", "namespace": namespace},
            "data": {"a": "1", "b": "2"},
        }
    )
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "sec", "namespace": namespace},
            "stringData": {"token": "s3cret"},
        }
    )
    cm_row = kubectl("get", "cm", "cfg", "-n", namespace, "--no-headers").split()
    assert cm_row[:2] == ["cfg", "2"]
    secret = kubectl.json("get", "secret", "sec", "-n", namespace)
    assert secret["type"] == "Opaque" and secret["data"] == {"token": "czNjcmV0"} and "stringData" not in secret
    header = kubectl("get", "ns").splitlines()[0].split()
    assert header == ["NAME", "STATUS", "AGE"]
    nodes = kubectl("get", "nodes", "--no-headers").split()
    assert nodes[:2] == ["localkube-node", "Ready"]
    svc = kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "s", "namespace": namespace},
            "spec": {"selector": {"app": "x"}, "ports": [{"port": 80, "targetPort": 8080}]},
        }
    )
    assert "service/s created" in svc
    row = kubectl("get", "svc", "s", "-n", namespace, "--no-headers").split()
    assert row[1] == "ClusterIP" and row[2].startswith("10.96.") and row[4] == "80/TCP"
    # typed generators send protobuf: localkube reads it for the common kinds and answers 415 for the others
    kubectl("create", "configmap", "gen", "-n", namespace, "--from-literal=a=b", "--from-literal=c=d")
    generated = kubectl.json("get", "cm", "gen", "-n", namespace)
    assert generated["data"] == {"a": "b", "c": "d"} and "generateName" not in generated["metadata"]
    kubectl("create", "secret", "generic", "gen", "-n", namespace, "--from-literal=key=val")
    assert kubectl.json("get", "secret", "gen", "-n", namespace)["data"] == {"key": "dmFs"}
    kubectl("create", "service", "clusterip", "gensvc", "-n", namespace, "--tcp=80:http")
    assert kubectl.json("get", "svc", "gensvc", "-n", namespace)["spec"]["ports"][0]["targetPort"] == "http"
    assert kubectl("auth", "can-i", "delete", "pods").strip() == "yes"
    unsupported = kubectl.run(
        "create", "pdb", "gen", "-n", namespace, "--selector=a=b", "--min-available=1", check=False
    )
    assert unsupported.returncode != 0 and "application/json" in unsupported.stderr


def test_strategic_merge_for_builtins(kubectl, namespace):
    base = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "sm", "namespace": namespace},
        "spec": {"selector": {"app": "x"}, "ports": [{"name": "a", "port": 80}, {"name": "b", "port": 81}]},
    }
    kubectl.apply(base)
    kubectl(
        "patch", "svc", "sm", "-n", namespace, "-p", '{"spec":{"ports":[{"port":81,"name":"b","targetPort":9000}]}}'
    )
    ports = {p["name"]: p for p in kubectl.json("get", "svc", "sm", "-n", namespace)["spec"]["ports"]}
    assert ports["a"]["port"] == 80 and ports["b"]["targetPort"] == 9000  # merged by port, not replaced
    base["spec"]["ports"] = [{"name": "a", "port": 80}]
    kubectl.apply(base)
    ports = [p["name"] for p in kubectl.json("get", "svc", "sm", "-n", namespace)["spec"]["ports"]]
    assert ports == ["a"]  # apply removed the port it no longer declares


def test_dry_run_server_changes_nothing(kubectl, crd, namespace):
    out = kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(widget("dry", namespace)))
    assert "created (server dry run)" in out
    assert kubectl.run("get", "wd", "dry", "-n", namespace, check=False).returncode != 0


def test_namespace_deletion_empties_it(kubectl, crd, api):
    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "doomed"}})
    kubectl.apply(widget("inside", "doomed"))
    kubectl("delete", "namespace", "doomed", "--timeout=30s")
    assert kubectl.run("get", "ns", "doomed", check=False).returncode != 0
    assert kubectl("get", "wd", "-n", "doomed", "-o", "name").strip() == ""


def test_deleting_a_crd_deletes_its_objects_first(kubectl, widget_crd, namespace):
    crd = json.loads(
        json.dumps(widget_crd)
        .replace("widgets", "gadgets")
        .replace("Widget", "Gadget")
        .replace("widget", "gadget")
        .replace('"wd"', '"gd"')
    )
    kubectl.apply(crd)
    kubectl("wait", "--for=condition=established", "crd/gadgets.example.com", "--timeout=20s")
    gadget = {
        "apiVersion": "example.com/v1",
        "kind": "Gadget",
        "metadata": {"name": "g1", "namespace": namespace, "finalizers": ["example.com/hold"]},
        "spec": {"size": "small"},
    }
    kubectl.apply(gadget)
    kubectl("delete", "crd", "gadgets.example.com", "--wait=false")
    wait_for(
        lambda: kubectl.json("get", "gadgets", "g1", "-n", namespace)["metadata"].get("deletionTimestamp"),
        what="the CRD's objects to be deleted first",
    )
    terminating = kubectl.json("get", "crd", "gadgets.example.com")
    assert "Terminating" in {c["type"] for c in terminating["status"]["conditions"]}
    kubectl("patch", "gadgets", "g1", "-n", namespace, "--type", "merge", "-p", '{"metadata":{"finalizers":null}}')
    wait_for(lambda: kubectl.run("get", "crd", "gadgets.example.com", check=False).returncode != 0, what="CRD removal")
    assert "gadgets" not in kubectl("api-resources")
