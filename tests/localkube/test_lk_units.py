"""Table-driven tests of localkube's pure pieces: selectors, JSONPath, patches, schemas, scheduling, env, routes."""

from __future__ import annotations

import base64

import pytest

from localkube import protobuf, structural
from localkube.apiserver import Route, parse_route
from localkube.builtins import pod_status_reason
from localkube.errors import ApiError
from localkube.jsonpath import compile_path, find
from localkube.kubelet import IPAllocator
from localkube.meta import human_duration
from localkube.patches import json_patch, merge_patch, strategic_merge_patch
from localkube.podenv import ContainerConfigError, command_line, container_env, expand
from localkube.scheduler import fits, parse_quantity
from localkube.selectors import field_value, parse_field_selector, parse_label_selector, selector_from_object
from localkube.store import Event, Watch

LABELS = {"app": "web", "tier": "gold", "n": "5"}


@pytest.mark.parametrize(
    "selector, expected",
    [
        ("", True),
        ("app=web", True),
        ("app==web,tier=gold", True),
        ("app!=web", False),
        ("app in (api, web)", True),
        ("app notin (web)", False),
        ("missing", False),
        ("!missing", True),
        ("tier,!missing,app in (web)", True),
        ("n>3", True),
        ("n<3", False),
        ("other!=x", True),
    ],
)
def test_label_selectors(selector, expected):
    assert parse_label_selector(selector).matches(LABELS) is expected


@pytest.mark.parametrize("bad", ["a=b=c(", "n>x", "(app)"])
def test_malformed_label_selectors_are_bad_requests(bad):
    with pytest.raises(ApiError) as exc:
        parse_label_selector(bad)
    assert exc.value.code == 400


@pytest.mark.parametrize(
    "selector, expected",
    [
        ({"matchLabels": {"app": "web"}}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold", "silver"]}]}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, False),
        ({"matchLabels": {"app": "web"}, "matchExpressions": [{"key": "n", "operator": "Exists"}]}, True),
        ({}, True),
    ],
)
def test_label_selector_objects(selector, expected):
    assert selector_from_object(selector).matches(LABELS) is expected


def test_field_selectors():
    pod = {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"nodeName": "n1", "hostNetwork": False},
        "status": {"phase": "Running"},
    }
    allowed = frozenset({"metadata.name", "status.phase", "spec.nodeName", "spec.hostNetwork"})
    assert parse_field_selector("status.phase=Running,spec.nodeName!=n2", allowed).matches(pod)
    assert not parse_field_selector("status.phase==Pending", allowed).matches(pod)
    assert field_value(pod, "spec.hostNetwork") == "false" and field_value(pod, "spec.missing") == ""
    with pytest.raises(ApiError) as exc:
        parse_field_selector("spec.restartPolicy=Always", allowed)
    assert exc.value.code == 400 and "field label not supported" in exc.value.message


OBJ = {
    "status": {
        "conditions": [{"type": "Ready", "status": "True"}, {"type": "Degraded", "status": "False"}],
        "replicas": 3,
        "weights": {"a.b": 7},
    },
    "spec": {"items": [1, 2, 3]},
}


@pytest.mark.parametrize(
    "path, expected",
    [
        (".status.replicas", [3]),
        ('.status.conditions[?(@.type=="Ready")].status', ["True"]),
        ('.status.conditions[?(@.type!="Ready")].type', ["Degraded"]),
        (".status.conditions[*].type", ["Ready", "Degraded"]),
        (".spec.items[-1]", [3]),
        (".spec.items[5]", []),
        (".status.weights['a.b']", [7]),
        ("{.status.replicas}", [3]),
        (".missing.path", []),
    ],
)
def test_jsonpath(path, expected):
    assert find(OBJ, compile_path(path)) == expected


@pytest.mark.parametrize(
    "target, patch, expected",
    [
        ({"a": 1, "b": {"c": 2}}, {"b": {"c": None, "d": 3}}, {"a": 1, "b": {"d": 3}}),
        ({"a": [1, 2]}, {"a": [3]}, {"a": [3]}),
        ({"a": 1}, {"a": None}, {}),
    ],
)
def test_merge_patch(target, patch, expected):
    assert merge_patch(target, patch) == expected


def test_json_patch_test_failure_is_invalid():
    doc = {"metadata": {"resourceVersion": "5"}, "spec": {"x": 1}}
    assert json_patch(doc, [{"op": "replace", "path": "/spec/x", "value": 2}])["spec"]["x"] == 2
    with pytest.raises(ApiError) as exc:
        json_patch(doc, [{"op": "test", "path": "/metadata/resourceVersion", "value": "4"}])
    assert exc.value.code == 422
    with pytest.raises(ApiError) as bad:
        json_patch(doc, {"op": "add"})
    assert bad.value.code == 400


@pytest.mark.parametrize(
    "target, patch, expected",
    [
        # containers merge by name; env merges by name
        (
            {
                "containers": [
                    {"name": "a", "image": "x", "env": [{"name": "K", "value": "1"}]},
                    {"name": "b", "image": "y"},
                ]
            },
            {"containers": [{"name": "a", "env": [{"name": "J", "value": "2"}]}]},
            {
                "containers": [
                    {"name": "a", "image": "x", "env": [{"name": "K", "value": "1"}, {"name": "J", "value": "2"}]},
                    {"name": "b", "image": "y"},
                ]
            },
        ),
        # $patch: delete removes a keyed item
        (
            {"containers": [{"name": "a"}, {"name": "b"}]},
            {"containers": [{"name": "a", "$patch": "delete"}]},
            {"containers": [{"name": "b"}]},
        ),
        # lists without a merge key are replaced
        ({"args": ["1", "2"]}, {"args": ["3"]}, {"args": ["3"]}),
        # finalizers merge as a set; $deleteFromPrimitiveList removes
        (
            {"finalizers": ["a", "b"]},
            {"finalizers": ["c"], "$deleteFromPrimitiveList/finalizers": ["a"]},
            {"finalizers": ["b", "c"]},
        ),
        # service ports merge by port; $setElementOrder orders them
        (
            {"ports": [{"port": 80, "name": "a"}, {"port": 81, "name": "b"}]},
            {"$setElementOrder/ports": [{"port": 81}, {"port": 80}], "ports": [{"port": 81, "targetPort": 9}]},
            {"ports": [{"port": 81, "name": "b", "targetPort": 9}, {"port": 80, "name": "a"}]},
        ),
        # $retainKeys drops keys not listed
        (
            {"strategy": {"type": "A", "rolling": {"x": 1}}},
            {"strategy": {"$retainKeys": ["type"], "type": "B"}},
            {"strategy": {"type": "B"}},
        ),
        # null deletes
        ({"a": 1, "b": 2}, {"a": None}, {"b": 2}),
    ],
)
def test_strategic_merge_patch(target, patch, expected):
    assert strategic_merge_patch(target, patch) == expected


SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["size"],
            "properties": {
                "size": {"type": "string", "enum": ["s", "l"]},
                "replicas": {"type": "integer", "minimum": 0, "default": 1},
                "ratio": {"type": "number", "exclusiveMaximum": True, "maximum": 1},
                "name": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4},
                "port": {"x-kubernetes-int-or-string": True},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "opt": {"type": "string", "nullable": True},
                "nested": {"type": "object", "default": {}, "properties": {"depth": {"type": "integer", "default": 2}}},
                "list": {
                    "type": "array",
                    "maxItems": 2,
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["name"],
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}, "min": {"type": "integer", "minimum": 1}},
                    },
                },
            },
        },
    },
}


def test_prune_and_default():
    obj = {
        "apiVersion": "x/v1",
        "kind": "X",
        "metadata": {"name": "a"},
        "spec": {
            "size": "s",
            "unknown": 1,
            "free": {"keep": {"me": 1}},
            "labels": {"a": "b"},
            "replicas": None,
            "list": [{"name": "a", "junk": True}],
        },
        "extra": 1,
    }
    pruned = structural.prune(obj, SCHEMA, root=True)
    assert sorted(pruned) == ["extra", "spec.list[0].junk", "spec.unknown"]
    structural.apply_defaults(obj, SCHEMA)
    assert obj["spec"]["replicas"] == 1  # a non-nullable null is dropped, then defaulted
    assert obj["spec"]["nested"] == {"depth": 2}  # a defaulted parent gets its children's defaults
    assert obj["spec"]["free"] == {"keep": {"me": 1}} and obj["metadata"] == {"name": "a"}


@pytest.mark.parametrize(
    "spec, causes",
    [
        ({"size": "s"}, []),
        ({}, [("spec.size", "FieldValueRequired")]),
        ({"size": "m"}, [("spec.size", "FieldValueNotSupported")]),
        ({"size": "s", "replicas": -1}, [("spec.replicas", "FieldValueInvalid")]),
        ({"size": "s", "replicas": "3"}, [("spec.replicas", "FieldValueInvalid")]),
        ({"size": "s", "replicas": True}, [("spec.replicas", "FieldValueInvalid")]),
        ({"size": "s", "ratio": 1}, [("spec.ratio", "FieldValueInvalid")]),
        ({"size": "s", "name": "abcde"}, [("spec.name", "FieldValueTooLong")]),
        ({"size": "s", "name": "AB"}, [("spec.name", "FieldValueInvalid")]),
        ({"size": "s", "port": 80}, []),
        ({"size": "s", "port": "http"}, []),
        ({"size": "s", "port": 1.5}, [("spec.port", "FieldValueInvalid")]),
        ({"size": "s", "labels": {"a": 1}}, [("spec.labels.a", "FieldValueInvalid")]),
        ({"size": "s", "opt": None}, []),
        ({"size": "s", "list": [{"name": "a"}, {"name": "a"}]}, [("spec.list[1]", "FieldValueDuplicate")]),
        ({"size": "s", "list": [{"name": "a", "min": 0}]}, [("spec.list[0].min", "FieldValueInvalid")]),
        ({"size": "s", "list": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}, [("spec.list", "FieldValueTooMany")]),
        ({"size": "s", "list": [{}]}, [("spec.list[0].name", "FieldValueRequired")]),
    ],
)
def test_schema_validation_causes(spec, causes):
    found = structural.validate({"metadata": {"name": "x"}, "spec": spec}, SCHEMA, root=True)
    assert [(c.field, c.reason) for c in found] == causes


@pytest.mark.parametrize(
    "schema, fields",
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}}, []),
        (
            {"type": "object", "properties": {"a": {"properties": {"b": {"type": "string"}}}}},
            ["schema.openAPIV3Schema.properties[a].type"],
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}},
            ["schema.openAPIV3Schema.properties[a].$ref", "schema.openAPIV3Schema.properties[a].type"],
        ),
        (
            {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "default": 0}}},
            ["schema.openAPIV3Schema.properties[a].default"],
        ),
        ({"type": "string"}, ["schema.openAPIV3Schema.type"]),
        ({"type": "object", "properties": {"l": {"type": "array"}}}, ["schema.openAPIV3Schema.properties[l].items"]),
    ],
)
def test_structural_schema_checks(schema, fields):
    assert [c.field for c in structural.check_structural(schema)] == fields


NODE = {
    "metadata": {"name": "n", "labels": {"kubernetes.io/os": "linux", "gpu": "no"}},
    "status": {"allocatable": {"cpu": "2", "nvidia.com/gpu": "1"}},
}


def _pod(**spec):
    return {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}], **spec}}


@pytest.mark.parametrize(
    "pod, bound, ok, words",
    [
        (_pod(), [], True, ""),
        (_pod(nodeSelector={"kubernetes.io/os": "linux"}), [], True, ""),
        (_pod(nodeSelector={"gpu": "yes"}), [], False, "node affinity/selector"),
        (
            _pod(
                affinity={
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["no"]}]}
                            ]
                        }
                    }
                }
            ),
            [],
            True,
            "",
        ),
        (_pod(containers=[{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]), [], True, ""),
        (
            _pod(containers=[{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]),
            [_pod(containers=[{"name": "c", "resources": {"requests": {"nvidia.com/gpu": 1}}}])],
            False,
            "Insufficient nvidia.com/gpu",
        ),
        (
            _pod(containers=[{"name": "c", "resources": {"requests": {"cpu": "64", "example.com/fpga": "1"}}}]),
            [],
            False,
            "Insufficient example.com/fpga",
        ),
    ],
)
def test_scheduler_fits(pod, bound, ok, words):
    verdict = fits(pod, NODE, bound)
    assert verdict.ok is ok and words in verdict.message


@pytest.mark.parametrize("text, value", [("500m", 0.5), ("2Gi", 2 * 2**30), ("1", 1.0), (3, 3.0), ("1.5k", 1500.0)])
def test_parse_quantity(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    "text, env, expected",
    [
        ("$(A)-$(B)", {"A": "1", "B": "2"}, "1-2"),
        ("$(MISSING)", {}, "$(MISSING)"),
        ("$$(A)", {"A": "1"}, "$(A)"),
        ("cost: $$5", {}, "cost: $5"),
    ],
)
def test_env_expansion(text, env, expected):
    assert expand(text, env) == expected


def test_container_env_sources():
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "labels": {"app": "a"}, "uid": "u"},
        "spec": {"nodeName": "node"},
        "status": {"podIP": "127.1.2.3"},
    }
    secrets = {("ns", "s"): {"data": {"k": base64.b64encode(b"secret").decode()}}}
    maps = {("ns", "c"): {"data": {"x": "1", "y": "2"}}}
    container = {
        "name": "c",
        "command": ["run", "--ip=$(IP)"],
        "args": ["$(X_x)"],
        "resources": {"limits": {"cpu": "1500m"}},
        "envFrom": [{"configMapRef": {"name": "c"}, "prefix": "X_"}, {"secretRef": {"name": "gone", "optional": True}}],
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "nope", "optional": True}}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "BOTH", "value": "$(APP)/$(S)"},
        ],
    }
    env = container_env(pod, container, lambda ns, n: secrets.get((ns, n)), lambda ns, n: maps.get((ns, n)))
    assert env == {"X_x": "1", "X_y": "2", "IP": "127.1.2.3", "APP": "a", "S": "secret", "CPU": "2", "BOTH": "a/secret"}
    assert command_line(container, env) == ["run", "--ip=127.1.2.3", "1"]
    missing = {
        "name": "c",
        "command": ["x"],
        "env": [{"name": "S", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}],
    }
    with pytest.raises(ContainerConfigError, match='secret "nope" not found'):
        container_env(pod, missing, lambda ns, n: None, lambda ns, n: None)
    with pytest.raises(ContainerConfigError, match="command"):
        command_line({"name": "c", "image": "x"}, {})


@pytest.mark.parametrize(
    "seconds, text",
    [
        (5, "5s"),
        (119, "119s"),
        (125, "2m5s"),
        (600, "10m"),
        (3 * 3600 + 60, "3h1m"),
        (30 * 3600, "30h"),
        (3 * 86400 + 3600, "3d1h"),
        (400 * 86400, "400d"),
    ],
)
def test_human_duration(seconds, text):
    assert human_duration(seconds) == text


@pytest.mark.parametrize(
    "path, route",
    [
        ("/api/v1/pods", Route("", "v1", "pods")),
        ("/api/v1/namespaces/ns/pods/p/log", Route("", "v1", "pods", "ns", "p", "log")),
        ("/api/v1/namespaces/ns", Route("", "v1", "namespaces", None, "ns")),
        ("/api/v1/namespaces/ns/status", Route("", "v1", "namespaces", None, "ns", "status")),
        ("/api/v1/namespaces/ns/configmaps", Route("", "v1", "configmaps", "ns")),
        ("/apis/x.io/v1/namespaces/ns/things/t/scale", Route("x.io", "v1", "things", "ns", "t", "scale")),
        ("/api/v1/watch/namespaces/ns/pods", Route("", "v1", "pods", "ns", watch_path=True)),
        ("/apis/x.io", None),
    ],
)
def test_parse_route(path, route):
    assert parse_route([p for p in path.split("/") if p]) == route


def _pod_with(phase="Running", statuses=(), deleting=False, init=()):
    meta = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"initContainers": [{"name": "i"}] * len(init)},
        "status": {"phase": phase, "containerStatuses": list(statuses), "initContainerStatuses": list(init)},
    }


@pytest.mark.parametrize(
    "pod, text",
    [
        (_pod_with(), "Running"),
        (_pod_with(statuses=[{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]), "CrashLoopBackOff"),
        (
            _pod_with(phase="Succeeded", statuses=[{"state": {"terminated": {"reason": "Completed", "exitCode": 0}}}]),
            "Completed",
        ),
        (_pod_with(statuses=[{"state": {"terminated": {"exitCode": 2}}}]), "ExitCode:2"),
        (_pod_with(deleting=True), "Terminating"),
        (_pod_with(phase="Pending", init=[{"state": {"running": {}}}]), "Init:0/1"),
    ],
)
def test_pod_status_reason(pod, text):
    assert pod_status_reason(pod) == text


def test_watch_translates_selector_transitions():
    watch = Watch(("", "pods"), "ns", parse_label_selector("app=a"), parse_field_selector("", None))
    inside = {"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "a"}}}
    outside = {"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "b"}}}
    elsewhere = {"metadata": {"name": "p", "namespace": "other", "labels": {"app": "a"}}}
    assert watch.translate(Event(1, ("", "pods"), "ADDED", inside, None)) == ("ADDED", inside)
    assert watch.translate(Event(2, ("", "pods"), "MODIFIED", outside, inside)) == ("DELETED", outside)
    assert watch.translate(Event(3, ("", "pods"), "MODIFIED", inside, outside)) == ("ADDED", inside)
    assert watch.translate(Event(4, ("", "pods"), "MODIFIED", inside, inside)) == ("MODIFIED", inside)
    assert watch.translate(Event(5, ("", "pods"), "ADDED", elsewhere, None)) is None


def _pb_field(number: int, payload: bytes) -> bytes:
    return bytes([(number << 3) | 2, len(payload)]) + payload


def test_protobuf_envelope_decoding():
    meta = _pb_field(1, b"cm") + _pb_field(2, b"")  # an empty generateName, as Go sends it
    entry = _pb_field(1, b"k") + _pb_field(2, b"v")
    raw = _pb_field(1, meta) + _pb_field(2, entry)
    body = b"k8s\x00" + _pb_field(1, _pb_field(1, b"v1") + _pb_field(2, b"ConfigMap")) + _pb_field(2, raw)
    assert protobuf.decode(body, protobuf.PROTOBUF) == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cm"},
        "data": {"k": "v"},
    }
    unknown = b"k8s\x00" + _pb_field(1, _pb_field(1, b"apps/v1") + _pb_field(2, b"Deployment")) + _pb_field(2, b"")
    with pytest.raises(ApiError) as exc:
        protobuf.decode(unknown, protobuf.PROTOBUF)
    assert exc.value.code == 415
    with pytest.raises(ApiError) as truncated:
        protobuf.decode(b"k8s\x00\x0a\x09v1", protobuf.PROTOBUF)
    assert truncated.value.code == 400


def test_ip_allocator_round_robin_and_release():
    ips = IPAllocator("127.251.7.0/29")
    got = [ips.allocate() for _ in range(5)]
    assert got == ["127.251.7.2", "127.251.7.3", "127.251.7.4", "127.251.7.5", "127.251.7.6"]  # .1 is skipped
    with pytest.raises(RuntimeError):
        ips.allocate()
    ips.release("127.251.7.4")
    assert ips.allocate() == "127.251.7.4"
    assert IPAllocator("127.9.9.0/24").allocate("127.9.9.77") == "127.9.9.77"  # a pod keeps its address on restart
    with pytest.raises(ValueError):
        IPAllocator("10.0.0.0/24")
