"""The generated CRD: committed copy up to date, structural, accepted as a CRD object, with the agreed shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from typer.testing import CliRunner

from crds.cli import app as crd_app
from crds.render import CRD_NAME, render, structural_problems

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "inferencedeployment.yaml"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node with a readable path (`spec.variants[].name`)."""
    found = [(path, node)]
    for name, sub in node.get("properties", {}).items():
        found += _walk(sub, f"{path}.{name}" if path else name)
    if isinstance(node.get("items"), dict):
        found += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _walk(node["additionalProperties"], f"{path}{{}}")
    return found


def _at(schema: dict[str, Any], json_path: str) -> dict[str, Any]:
    node = schema
    for part in json_path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_committed_yaml_is_fresh() -> None:
    assert CRD_FILE.read_text() == render(), (
        "crds/inferencedeployment.yaml is stale: run `make crd` after changing crds/models.py"
    )


def test_render_is_deterministic_and_cli_prints_it() -> None:
    result = CliRunner().invoke(crd_app, ["render"])
    assert result.exit_code == 0, result.output
    assert result.output == render() == render()


def test_schema_is_structural(openapi_schema: dict[str, Any]) -> None:
    assert structural_problems(openapi_schema) == []


def test_crd_object_is_a_valid_customresourcedefinition(committed_crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(committed_crd, kubernetes_validate.latest_version(), strict=True)


def test_names_scope_and_version(committed_crd: dict[str, Any]) -> None:
    spec = committed_crd["spec"]
    assert committed_crd["metadata"]["name"] == CRD_NAME == "inferencedeployments.llmfleet.io"
    assert spec["group"] == "llmfleet.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceDeployment"
    assert spec["names"]["plural"] == "inferencedeployments"
    assert spec["names"]["singular"] == "inferencedeployment"
    assert spec["names"]["shortNames"] == ["infd"]
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)


def test_subresources_point_at_fields_of_the_right_type(committed_crd: dict[str, Any]) -> None:
    version = committed_crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert version["subresources"]["status"] == {}
    scale = version["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.labelSelector",
    }
    assert _at(schema, scale["specReplicasPath"])["type"] == "integer"
    assert _at(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert _at(schema, scale["labelSelectorPath"])["type"] == "string"
    assert "replicas" not in schema["properties"]["spec"].get("required", [])


def test_printer_columns_resolve_to_typed_fields(committed_crd: dict[str, Any]) -> None:
    version = committed_crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    columns = {column["name"]: column for column in version["additionalPrinterColumns"]}
    assert list(columns)[:6] == ["Model", "Ready", "Desired", "Phase", "Canary", "Age"]
    assert columns["Canary"]["jsonPath"] == ".status.rollout.canaryWeight"
    assert columns["Age"] == {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    for name, column in columns.items():
        if column["jsonPath"].startswith(".metadata"):
            continue
        assert _at(schema, column["jsonPath"])["type"] == column["type"], name


def test_no_json_schema_leftovers(openapi_schema: dict[str, Any]) -> None:
    text = yaml.safe_dump(openapi_schema)
    for leftover in ("$ref", "$defs", "title:", "anyOf: null", "additionalProperties: false", "type: 'null'"):
        assert leftover not in text


def test_free_form_fields_are_exactly_the_intended_ones(openapi_schema: dict[str, Any]) -> None:
    free = {path for path, node in _walk(openapi_schema) if node.get("x-kubernetes-preserve-unknown-fields")}
    assert free == {
        "spec.engine.extraArgs",
        "spec.variants[].extraArgs",
        "spec.template.podSpec.affinity",
        "spec.template.podSpec.topologySpreadConstraints[]",
        "status.rollout.stableSpec",
        "status.lastValidSpec",
    }


def test_optional_fields_become_plain_types_and_quantities_int_or_string(openapi_schema: dict[str, Any]) -> None:
    nodes = dict(_walk(openapi_schema))
    assert nodes["spec.replicas"]["type"] == "integer"
    assert nodes["spec.variants[].autoscaling"]["type"] == "object"
    assert nodes["spec.variants[].autoscaling"]["description"].startswith("Autoscale this variant")
    for path in ("spec.engine.kvCacheBytes", "spec.variants[].resources.cpu", "spec.variants[].resources.memory"):
        assert nodes[path]["x-kubernetes-int-or-string"] is True
        assert nodes[path]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
        assert "type" not in nodes[path]
    assert nodes["spec.variants[].resources.nvidia.com/gpu"]["type"] == "integer"
    target = nodes["spec.variants[].autoscaling.targets.kvCacheUtilization"]
    assert (target["minimum"], target["exclusiveMinimum"], target["maximum"]) == (0, True, 1)


def test_defaults_and_enums_are_kept(openapi_schema: dict[str, Any]) -> None:
    nodes = dict(_walk(openapi_schema))
    assert nodes["spec.variants[].quantization"]["enum"] == ["none", "int8", "fp8", "int4"]
    assert nodes["spec.variants[].quantization"]["default"] == "none"
    assert nodes["spec.engine.type"]["enum"] == ["builtin", "vllm"]
    assert nodes["spec.drain.timeoutSeconds"]["default"] == 120
    assert nodes["spec.variants"]["x-kubernetes-list-type"] == "map"
    assert nodes["spec.variants"]["x-kubernetes-list-map-keys"] == ["name"]
    assert openapi_schema["properties"]["spec"]["required"] == ["model", "variants"]
    assert nodes["spec.model"]["required"] == ["name", "source"]


def test_every_field_is_described(openapi_schema: dict[str, Any]) -> None:
    undocumented = [
        path
        for path, node in _walk(openapi_schema)
        if path.startswith(("spec", "status")) and not path.endswith(("[]", "{}")) and not node.get("description")
    ]
    assert undocumented == []
