"""A CR author gets worker pods of an allow-listed shape only: every other pod field, volume type, value source
and confinement-changing key is refused, by `crds.validate` (what the operator reports as InvalidSpec) and by
the rendered CRD itself (unknown fields, schema enums, CEL rules), so a real API server refuses it at apply time.

Each forbidden row names the API-server layer that refuses it: `unknown` (a field the structural schema does not
declare: strict field validation rejects it, otherwise it is pruned), `schema` (a type/enum/pattern the schema
holds) or `cel` (an `x-kubernetes-validations` rule, evaluated here with cel-python).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from crds.validate import validate

MINIMAL: dict[str, Any] = {
    "model": {"name": "smollm2", "source": "bundled://smollm2-135m-instruct"},
    "variants": [{"name": "default"}],
}
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
PS = "spec.template.podSpec"


def _spec(template: Mapping[str, Any]) -> dict[str, Any]:
    return {**MINIMAL, "template": dict(template)}


def _vol(**source: Any) -> dict[str, Any]:
    return {"podSpec": {"volumes": [{"name": "data", **source}]}}


def _env(**var: Any) -> dict[str, Any]:
    return {"env": [{"name": "X", **var}]}


def _mount(volume: dict[str, Any], **mount: Any) -> dict[str, Any]:
    return {"podSpec": {"volumes": [volume]}, "volumeMounts": [{"name": "data", "mountPath": "/data", **mount}]}


PRIVILEGED = {"privileged": True, "runAsUser": 0}

# name -> (spec.template, problem path, words in the message or fix, API-server layer that refuses it)
FORBIDDEN: dict[str, tuple[dict[str, Any], str, str, str]] = {
    "hostNetwork": ({"podSpec": {"hostNetwork": True}}, f"{PS}.hostNetwork", "network", "unknown"),
    "hostPID": ({"podSpec": {"hostPID": True}}, f"{PS}.hostPID", "PID", "unknown"),
    "hostIPC": ({"podSpec": {"hostIPC": True}}, f"{PS}.hostIPC", "IPC", "unknown"),
    "hostUsers false": ({"podSpec": {"hostUsers": False}}, f"{PS}.hostUsers", "user namespace", "unknown"),
    "nodeName": ({"podSpec": {"nodeName": "node-1"}}, f"{PS}.nodeName", "scheduler", "unknown"),
    "hostPath /": (_vol(hostPath={"path": "/"}), f"{PS}.volumes[0].hostPath", "never hostPath", "unknown"),
    "privileged root init container": (
        {"podSpec": {"initContainers": [{"name": "x", "image": "busybox", "securityContext": PRIVILEGED}]}},
        f"{PS}.initContainers",
        "worker container only",
        "unknown",
    ),
    "ephemeralContainers": (
        {"podSpec": {"ephemeralContainers": [{"name": "x", "image": "busybox", "securityContext": PRIVILEGED}]}},
        f"{PS}.ephemeralContainers",
        "kubectl debug",
        "unknown",
    ),
    "containers": ({"podSpec": {"containers": []}}, f"{PS}.containers", "spec.template.image", "unknown"),
    "pod securityContext": (
        {"podSpec": {"securityContext": {"runAsUser": 0, "runAsNonRoot": False}}},
        f"{PS}.securityContext",
        "restricted security context",
        "unknown",
    ),
    "shareProcessNamespace": (
        {"podSpec": {"shareProcessNamespace": True}},
        f"{PS}.shareProcessNamespace",
        "alone",
        "unknown",
    ),
    "hostAliases": (
        {"podSpec": {"hostAliases": [{"ip": "10.0.0.1", "hostnames": ["api"]}]}},
        f"{PS}.hostAliases",
        "dnsConfig",
        "unknown",
    ),
    "overhead": ({"podSpec": {"overhead": {"cpu": "1"}}}, f"{PS}.overhead", "RuntimeClass", "unknown"),
    "serviceAccountName in podSpec": (
        {"podSpec": {"serviceAccountName": "admin"}},
        f"{PS}.serviceAccountName",
        "spec.template.serviceAccountName",
        "unknown",
    ),
    "automountServiceAccountToken": (
        {"podSpec": {"automountServiceAccountToken": True}},
        f"{PS}.automountServiceAccountToken",
        "never get a service account token",
        "unknown",
    ),
    "terminationGracePeriodSeconds": (
        {"podSpec": {"terminationGracePeriodSeconds": 1}},
        f"{PS}.terminationGracePeriodSeconds",
        "spec.drain.terminationGracePeriodSeconds",
        "unknown",
    ),
    "a pod field outside the allow-list": (
        {"podSpec": {"activeDeadlineSeconds": 5}},
        f"{PS}.activeDeadlineSeconds",
        "allowed pod fields: affinity",
        "unknown",
    ),
    "nfs volume": (_vol(nfs={"server": "nfs", "path": "/"}), f"{PS}.volumes[0].nfs", "volume type", "unknown"),
    "csi volume": (_vol(csi={"driver": "x"}), f"{PS}.volumes[0].csi", "volume type", "unknown"),
    "projected service account token": (
        _vol(projected={"sources": [{"serviceAccountToken": {"path": "token"}}]}),
        f"{PS}.volumes[0].projected.sources[0].serviceAccountToken",
        "service account token",
        "unknown",
    ),
    "emptyDir on hugepages": (
        _vol(emptyDir={"medium": "HugePages"}),
        f"{PS}.volumes[0].emptyDir.medium",
        "Memory",
        "schema",
    ),
    "dnsPolicy ClusterFirstWithHostNet": (
        {"podSpec": {"dnsPolicy": "ClusterFirstWithHostNet"}},
        f"{PS}.dnsPolicy",
        "ClusterFirst",
        "schema",
    ),
    "volume with two sources": (
        _vol(emptyDir={}, secret={"secretName": "s"}),
        f"{PS}.volumes[0]",
        "exactly one",
        "cel",
    ),
    "volume without a source": (_vol(), f"{PS}.volumes[0]", "exactly one", "cel"),
    "volume named like the operator's": (
        {"podSpec": {"volumes": [{"name": "tmp", "emptyDir": {}}]}},
        f"{PS}.volumes[0].name",
        "operator's",
        "cel",
    ),
    "projection with two sources": (
        _vol(projected={"sources": [{"secret": {"name": "s"}, "configMap": {"name": "c"}}]}),
        f"{PS}.volumes[0].projected.sources[0]",
        "exactly one",
        "cel",
    ),
    "env valueFrom an unknown source": (
        _env(valueFrom={"fileKeyRef": {"path": "/etc/shadow", "key": "k"}}),
        "spec.template.env[0].valueFrom.fileKeyRef",
        "secretKeyRef",
        "unknown",
    ),
    "env valueFrom two sources": (
        _env(valueFrom={"secretKeyRef": {"name": "s", "key": "k"}, "fieldRef": {"fieldPath": "metadata.name"}}),
        "spec.template.env[0].valueFrom",
        "exactly one",
        "cel",
    ),
    "env value and valueFrom": (
        _env(value="1", valueFrom={"fieldRef": {"fieldPath": "metadata.name"}}),
        "spec.template.env[0]",
        "both value and valueFrom",
        "cel",
    ),
    "env secretKeyRef in another namespace": (
        _env(valueFrom={"secretKeyRef": {"name": "s", "key": "k", "namespace": "kube-system"}}),
        "spec.template.env[0].valueFrom.secretKeyRef.namespace",
        "not a field",
        "unknown",
    ),
    "operator label": (
        {"labels": {"llmfleet.io/draining": "true"}},
        'spec.template.labels["llmfleet.io/draining"]',
        "set by the operator",
        "cel",
    ),
    "operator annotation": (
        {"annotations": {"llmfleet.io/drain-deadline": "0"}},
        'spec.template.annotations["llmfleet.io/drain-deadline"]',
        "set by the operator",
        "cel",
    ),
    "AppArmor unconfined": (
        {"annotations": {"container.apparmor.security.beta.kubernetes.io/worker": "unconfined"}},
        'spec.template.annotations["container.apparmor.security.beta.kubernetes.io/worker"]',
        "AppArmor",
        "cel",
    ),
    "seccomp unconfined": (
        {"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}},
        'spec.template.annotations["seccomp.security.alpha.kubernetes.io/pod"]',
        "seccomp",
        "cel",
    ),
    "mount over the operator's /tmp": (
        _mount({"name": "data", "emptyDir": {}}, mountPath="/tmp"),
        "spec.template.volumeMounts[0].mountPath",
        "where the operator mounts",
        "cel",
    ),
    "mount below the model mount": (
        _mount({"name": "data", "emptyDir": {}}, mountPath="/models/weights"),
        "spec.template.volumeMounts[0].mountPath",
        "where the operator mounts",
        "cel",
    ),
    "mount of a volume that is not there": (
        _mount({"name": "other", "emptyDir": {}}),
        "spec.template.volumeMounts[0].name",
        "no volume 'data'",
        "cel",
    ),
    "subPath climbing out": (
        _mount({"name": "data", "emptyDir": {}}, subPath="../../etc"),
        "spec.template.volumeMounts[0].subPath",
        "without '..'",
        "cel",
    ),
    "relative mountPath": (
        _mount({"name": "data", "emptyDir": {}}, mountPath="data"),
        "spec.template.volumeMounts[0].mountPath",
        "pattern",
        "schema",
    ),
}

# name -> spec.template that must validate and pass every layer of the CRD
ALLOWED: dict[str, dict[str, Any]] = {
    "affinity": {
        "podSpec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                        ]
                    }
                }
            }
        }
    },
    "topologySpreadConstraints": {
        "podSpec": {
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
            ]
        }
    },
    "runtimeClassName": {"podSpec": {"runtimeClassName": "nvidia"}},
    "schedulerName": {"podSpec": {"schedulerName": "gpu-scheduler"}},
    "imagePullSecrets": {"podSpec": {"imagePullSecrets": [{"name": "registry"}]}},
    "dnsPolicy and dnsConfig": {
        "podSpec": {
            "dnsPolicy": "None",
            "dnsConfig": {
                "nameservers": ["10.0.0.10"],
                "searches": ["svc.cluster.local"],
                "options": [{"name": "ndots", "value": "2"}],
            },
        }
    },
    "pvc volume mounted": _mount(
        {"name": "data", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}, readOnly=True
    ),
    "configMap volume": _vol(configMap={"name": "chat-templates", "items": [{"key": "t", "path": "t.jinja"}]}),
    "secret volume": _vol(secret={"secretName": "hf-token", "defaultMode": 0o440}),
    "emptyDir in memory": _mount({"name": "data", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}),
    "emptyDir on disk": _vol(emptyDir={"medium": "", "sizeLimit": "10Gi"}),
    "projected configMap, secret and pod fields": _vol(
        projected={
            "sources": [
                {"configMap": {"name": "c"}},
                {"secret": {"name": "s", "items": [{"key": "k", "path": "k"}]}},
                {"downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
            ]
        }
    ),
    "mount with a subPath": _mount({"name": "data", "configMap": {"name": "c"}}, subPath="conf/a.yaml"),
    "env from a secret key": _env(valueFrom={"secretKeyRef": {"name": "hf-token", "key": "token"}}),
    "env from a configMap key": _env(valueFrom={"configMapKeyRef": {"name": "c", "key": "k", "optional": True}}),
    "env from a pod field": _env(valueFrom={"fieldRef": {"fieldPath": "status.hostIP"}}),
    "env from a resource": _env(valueFrom={"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}),
    "serviceAccountName and priorityClassName": {"serviceAccountName": "workers", "priorityClassName": "high"},
    "own labels and annotations": {"labels": {"team": "ml"}, "annotations": {"example.com/owner": "ml"}},
}


# ------------------------------------------------------------------------------ what the API server would do


def _unknown_fields(schema: Mapping[str, Any], data: Any, path: str = "spec") -> Iterator[str]:
    """Fields of `data` the structural schema does not declare: what strict field validation rejects (and the
    API server otherwise prunes). Nodes with x-kubernetes-preserve-unknown-fields keep anything."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(data, Mapping):
        properties, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, value in data.items():
            if properties is not None and key in properties:
                yield from _unknown_fields(properties[key], value, f"{path}.{key}")
            elif isinstance(extra, Mapping):
                yield from _unknown_fields(extra, value, f'{path}["{key}"]')
            else:
                yield f"{path}.{key}"
    elif isinstance(data, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(data):
            yield from _unknown_fields(schema["items"], item, f"{path}[{index}]")


def _cel_failures(schema: Mapping[str, Any], data: Any, path: str = "spec") -> Iterator[tuple[str, str]]:
    """(path, message) of every `x-kubernetes-validations` rule that `data` breaks, evaluated where the API server
    evaluates it: with `self` the value at the rule's node. Skips the test without cel-python (a dev extra)."""
    celpy = _celpy()
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(data)})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):  # false, or an evaluation error
            yield path, rule["message"]
    if isinstance(data, Mapping):
        properties, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for key, value in data.items():
            sub = properties.get(key) if key in properties else extra if isinstance(extra, Mapping) else None
            if sub is not None:
                yield from _cel_failures(sub, value, f"{path}.{key}")
    elif isinstance(data, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(data):
            yield from _cel_failures(schema["items"], item, f"{path}[{index}]")


def _celpy() -> Any:
    return pytest.importorskip("celpy", reason="cel-python (dev extra) evaluates the CRD's CEL rules")


def _rules(schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for name, sub in (schema.get("properties") or {}).items():
        yield from _rules(sub, f"{path}.{name}" if path else name)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            yield from _rules(schema[key], path + ("[]" if key == "items" else "{}"))


@pytest.fixture(scope="module")
def spec_schema(openapi_schema: dict[str, Any]) -> dict[str, Any]:
    return openapi_schema["properties"]["spec"]


# ----------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("template", "path", "words", "layer"), FORBIDDEN.values(), ids=FORBIDDEN.keys())
def test_forbidden_pod_shapes_are_one_problem_with_a_fix(template, path, words, layer) -> None:
    problems = validate(_spec(template))
    assert [problem.path for problem in problems] == [path], problems
    (problem,) = problems
    assert words in f"{problem.message} {problem.fix}", problem


@pytest.mark.parametrize(("template", "path", "words", "layer"), FORBIDDEN.values(), ids=FORBIDDEN.keys())
def test_forbidden_pod_shapes_are_refused_by_the_crd_itself(
    spec_schema, schema_validator: jsonschema.Draft4Validator, template, path, words, layer
) -> None:
    spec = _spec(template)
    unknown = list(_unknown_fields(spec_schema, spec))
    schema_errors = list(schema_validator.iter_errors({"apiVersion": "x", "kind": "y", "metadata": {}, "spec": spec}))
    cel = list(_cel_failures(spec_schema, spec)) if not unknown and not schema_errors else []
    refused = {"unknown": bool(unknown), "schema": bool(schema_errors), "cel": bool(cel)}
    assert [name for name, yes in refused.items() if yes] == [layer], (unknown, schema_errors, cel)
    if layer == "unknown":
        assert unknown == [path]
    for cel_path, _ in cel:  # the rule sits at the problem's field or at an object that holds it
        assert path.startswith(cel_path), (path, cel)


def test_every_cel_rule_compiles(spec_schema) -> None:
    celpy = _celpy()
    env = celpy.Environment()
    for _, rule in _rules(spec_schema, "spec"):
        env.compile(rule["rule"])


@pytest.mark.parametrize("template", ALLOWED.values(), ids=ALLOWED.keys())
def test_allowed_pod_fields_pass_validation_and_every_crd_layer(
    spec_schema, schema_validator: jsonschema.Draft4Validator, template
) -> None:
    spec = _spec(template)
    assert validate(spec) == []
    assert list(_unknown_fields(spec_schema, spec)) == []
    assert list(schema_validator.iter_errors({"apiVersion": "x", "kind": "y", "metadata": {}, "spec": spec})) == []
    assert list(_cel_failures(spec_schema, spec)) == []


def test_pod_spec_is_a_closed_structural_object(spec_schema) -> None:
    pod_spec = spec_schema["properties"]["template"]["properties"]["podSpec"]
    assert "x-kubernetes-preserve-unknown-fields" not in pod_spec
    assert set(pod_spec["properties"]) == {
        "affinity", "topologySpreadConstraints", "runtimeClassName", "schedulerName", "imagePullSecrets",
        "dnsPolicy", "dnsConfig", "volumes",
    }  # fmt: skip
    volume = pod_spec["properties"]["volumes"]["items"]["properties"]
    assert set(volume) == {"name", "persistentVolumeClaim", "configMap", "secret", "emptyDir", "projected"}


def test_every_cel_rule_has_a_message_and_sits_where_expected(spec_schema) -> None:
    rules = list(_rules(spec_schema, "spec"))
    for path, rule in rules:
        assert set(rule) == {"rule", "message"} and rule["rule"] and rule["message"], (path, rule)
    assert {path for path, _ in rules} == {
        "spec.template",
        "spec.template.labels",
        "spec.template.annotations",
        "spec.template.env[]",
        "spec.template.env[].valueFrom",
        "spec.template.volumeMounts[]",
        "spec.template.podSpec.volumes[]",
        "spec.template.podSpec.volumes[].projected.sources[]",
        "spec.template.podSpec.volumes[].projected.sources[].downwardAPI.items[]",
    }


def test_lists_under_cel_rules_are_bounded(spec_schema) -> None:
    """The API server estimates each rule's cost from maxItems/maxProperties; unbounded ones are refused."""
    template = spec_schema["properties"]["template"]["properties"]
    assert template["labels"]["maxProperties"] and template["annotations"]["maxProperties"]
    assert template["volumeMounts"]["maxItems"] and template["podSpec"]["properties"]["volumes"]["maxItems"]


@pytest.mark.parametrize(
    "example",
    sorted(p for p in EXAMPLES_DIR.glob("*.yaml") if not p.name.startswith("invalid")),
    ids=lambda p: p.name,
)
def test_examples_have_no_unknown_fields_and_pass_the_cel_rules(spec_schema, example) -> None:
    spec = yaml.safe_load(example.read_text())["spec"]
    assert list(_unknown_fields(spec_schema, spec)) == []
    assert list(_cel_failures(spec_schema, spec)) == []
