"""Render the InferenceDeployment CRD from the pydantic models, and check that its schema is structural.

The API server accepts only *structural* OpenAPI v3 schemas: every node typed, no `$ref`/`$defs`, no `anyOf`
standing in for a type (except the int-or-string idiom), no `additionalProperties: false`, and numeric bounds in
the OpenAPI 3.0 style (`exclusiveMinimum` is a boolean). Pydantic emits JSON Schema 2020-12, so `to_structural()`
rewrites it; `structural_problems()` is an independent checker that `crd()` (and the tests) run on the result.
Output is deterministic: keys are sorted when dumped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema
import yaml
from pydantic import BaseModel

from crds.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
)

CRD_NAME = f"{PLURAL}.{GROUP}"

PRINTER_COLUMNS = (
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "description": "Served model name."},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready pods."},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas", "description": "Pods wanted."},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Summary state."},
    {
        "name": "Canary",
        "type": "integer",
        "jsonPath": ".status.rollout.canaryWeight",
        "description": "Percent of traffic on the canary revision.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Stable",
        "type": "string",
        "jsonPath": ".status.rollout.stableRevision",
        "description": "Stable revision.",
        "priority": 1,
    },
    {
        "name": "Canary-Revision",
        "type": "string",
        "jsonPath": ".status.rollout.canaryRevision",
        "description": "Canary revision under test.",
        "priority": 1,
    },
)

# Keys of apiextensions.k8s.io/v1 JSONSchemaProps that a structural schema written by us may use.
_ALLOWED_KEYS = frozenset(
    {
        "type", "description", "format", "default", "enum", "nullable",
        "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "multipleOf",
        "maxLength", "minLength", "pattern", "maxItems", "minItems", "maxProperties", "minProperties",
        "required", "items", "properties", "additionalProperties", "anyOf",
        "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string", "x-kubernetes-embedded-resource",
        "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-validations",
    }
)  # fmt: skip
_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean"})
_INT_OR_STRING_ANYOF = [{"type": "integer"}, {"type": "string"}]
# Formats the API server knows (k8s.io/kube-openapi strfmt); anything else would be rejected or ignored.
_FORMATS = frozenset(
    {
        "bsonobjectid", "uri", "email", "hostname", "ipv4", "ipv6", "cidr", "mac", "uuid", "uuid3", "uuid4",
        "uuid5", "isbn", "isbn10", "isbn13", "creditcard", "ssn", "hexcolor", "rgbcolor", "byte", "password",
        "date", "duration", "date-time", "datetime", "int32", "int64", "float", "double",
    }
)  # fmt: skip


# -------------------------------------------------------------------------------------------- pydantic -> structural


def to_structural(schema: Mapping[str, Any]) -> dict[str, Any]:
    """Turn a pydantic JSON schema (with `$defs`) into a self-contained structural OpenAPI v3 schema."""
    defs = schema.get("$defs", {})
    body = {k: v for k, v in schema.items() if k != "$defs"}
    return _convert(body, defs, ())


def _convert(node: Mapping[str, Any], defs: Mapping[str, Any], seen: tuple[str, ...]) -> dict[str, Any]:
    node = dict(node)
    target: dict[str, Any] | None = None
    if "$ref" in node:
        target = _resolve(node.pop("$ref"), defs, seen)
    elif "allOf" in node and len(node["allOf"]) == 1:
        target = _convert(node.pop("allOf")[0], defs, seen)
    elif "anyOf" in node and {"type": "null"} in node["anyOf"]:
        rest = [option for option in node.pop("anyOf") if option != {"type": "null"}]
        if len(rest) != 1:
            raise ValueError(f"cannot express a union of {len(rest)} types in a structural schema: {rest}")
        target = _convert(rest[0], defs, seen)
        if node.get("default", ...) is None:
            del node["default"]
    out = _convert_keywords(node, defs, seen)
    if target is not None:
        # Keywords written at the field (description, default) win over those of the referenced type.
        out = {**target, **out}
    return out


def _resolve(ref: str, defs: Mapping[str, Any], seen: tuple[str, ...]) -> dict[str, Any]:
    name = ref.removeprefix("#/$defs/")
    if name in seen:
        raise ValueError(f"recursive model {name!r} cannot be inlined into a structural schema")
    return _convert(defs[name], defs, (*seen, name))


def _convert_keywords(node: Mapping[str, Any], defs: Mapping[str, Any], seen: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title":
            continue
        if key == "properties":
            out[key] = {name: _convert(sub, defs, seen) for name, sub in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs, seen)
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, Mapping):
                out[key] = _convert(value, defs, seen)
            # `false` (pydantic's extra="forbid") is dropped: the API server prunes unknown fields instead.
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    return out


def _model_schema(model: type[BaseModel]) -> dict[str, Any]:
    return to_structural(model.model_json_schema(by_alias=True, mode="validation"))


def openapi_schema() -> dict[str, Any]:
    """The CRD's `openAPIV3Schema`: the whole object, with spec and status from the models."""
    return {
        "type": "object",
        "description": "InferenceDeployment serves one LLM through worker pods, with variants, autoscaling, "
        "canary rollouts and draining, managed by the llmfleet operator.",
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": _model_schema(InferenceDeploymentSpec),
            "status": _model_schema(InferenceDeploymentStatus),
        },
        "required": ["spec"],
    }


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object; raises ValueError if the schema is not structural."""
    schema = openapi_schema()
    problems = structural_problems(schema)
    if problems:
        raise ValueError("the generated schema is not structural:\n" + "\n".join(problems))
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "llmfleet"}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["llmfleet"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.labelSelector",
                        },
                    },
                    "additionalPrinterColumns": [dict(column) for column in PRINTER_COLUMNS],
                }
            ],
        },
    }


def render() -> str:
    """The CRD as YAML, exactly what `crds/inferencedeployment.yaml` holds."""
    header = (
        f"# {API_VERSION} {KIND}: generated from crds/models.py by `llmfleet crd render`.\n"
        "# Do not edit: change the models and run `make crd`.\n"
    )
    return header + yaml.safe_dump(crd(), sort_keys=True, width=120, default_flow_style=False)


# ------------------------------------------------------------------------------------------------ structural check


def structural_problems(schema: Mapping[str, Any]) -> list[str]:
    """Every way `schema` (an openAPIV3Schema) breaks the structural rules; empty means the API server takes it."""
    problems: list[str] = []
    if schema.get("type") != "object":
        problems.append("<root>: the root must be `type: object`")
    metadata = schema.get("properties", {}).get("metadata")
    if metadata is not None and dict(metadata) != {"type": "object"}:
        problems.append("<root>.metadata: may only be `{type: object}` (the API server owns its schema)")
    _check_node(schema, "<root>", problems)
    return problems


def _check_node(node: Any, path: str, problems: list[str]) -> None:
    if not isinstance(node, Mapping):
        problems.append(f"{path}: a schema must be an object, got {type(node).__name__}")
        return
    for key in sorted(set(node) - _ALLOWED_KEYS):
        problems.append(f"{path}: keyword {key!r} is not allowed in a structural schema")
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    kind = node.get("type")
    if kind is None and not (int_or_string or preserve):
        problems.append(f"{path}: no `type` (only int-or-string and preserve-unknown-fields nodes may omit it)")
    elif kind is not None and kind not in _TYPES:
        problems.append(f"{path}: unknown type {kind!r}")
    if int_or_string and kind is not None:
        problems.append(f"{path}: an int-or-string node must not set `type`")
    if "anyOf" in node and not (int_or_string and node["anyOf"] == _INT_OR_STRING_ANYOF):
        problems.append(f"{path}: `anyOf` is only allowed as the int-or-string idiom [integer, string]")
    if "format" in node and node["format"] not in _FORMATS:
        problems.append(f"{path}: format {node['format']!r} is unknown to the API server")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node and not isinstance(node[key], bool):
            problems.append(f"{path}: {key} must be a boolean next to minimum/maximum (OpenAPI 3.0)")
    if "enum" in node and kind in _TYPES:
        bad = [value for value in node["enum"] if not _matches_type(value, kind)]
        if bad:
            problems.append(f"{path}: enum values {bad} are not of type {kind}")
    _check_object(node, path, problems)
    _check_array(node, path, problems)
    if "default" in node:
        _check_default(node, path, problems)


def _check_object(node: Mapping[str, Any], path: str, problems: list[str]) -> None:
    properties = node.get("properties")
    extra = node.get("additionalProperties")
    if (properties is not None or extra is not None) and node.get("type") != "object":
        problems.append(f"{path}: properties/additionalProperties need `type: object`")
    if properties is not None and extra is not None:
        problems.append(f"{path}: properties and additionalProperties are mutually exclusive")
    if isinstance(extra, bool):
        problems.append(f"{path}: additionalProperties must be a schema, not {extra} (use preserve-unknown-fields)")
    elif extra is not None:
        _check_node(extra, f"{path}.additionalProperties", problems)
    for name, sub in (properties or {}).items():
        _check_node(sub, f"{path}.{name}", problems)
    missing = [name for name in node.get("required", []) if properties is None or name not in properties]
    if missing:
        problems.append(f"{path}: required fields {missing} are not declared in properties")


def _check_array(node: Mapping[str, Any], path: str, problems: list[str]) -> None:
    if node.get("type") != "array":
        if "items" in node or "x-kubernetes-list-type" in node:
            problems.append(f"{path}: items/x-kubernetes-list-type need `type: array`")
        return
    items = node.get("items")
    if not isinstance(items, Mapping):
        problems.append(f"{path}: an array needs a single `items` schema")
        return
    _check_node(items, f"{path}[]", problems)
    if node.get("x-kubernetes-list-type") == "map":
        keys = node.get("x-kubernetes-list-map-keys") or []
        item_properties = items.get("properties", {})
        if not keys:
            problems.append(f"{path}: a map list needs x-kubernetes-list-map-keys")
        for key in keys:
            if key not in item_properties:
                problems.append(f"{path}: map key {key!r} is not a property of the items")
            elif key not in items.get("required", []) and "default" not in item_properties[key]:
                problems.append(f"{path}: map key {key!r} must be required or defaulted")


def _check_default(node: Mapping[str, Any], path: str, problems: list[str]) -> None:
    without_default = {k: v for k, v in node.items() if k != "default"}
    error = jsonschema.exceptions.best_match(jsonschema.Draft4Validator(without_default).iter_errors(node["default"]))
    if error is not None:
        problems.append(f"{path}: default {node['default']!r} does not validate: {error.message}")


def _matches_type(value: Any, kind: str) -> bool:
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, Mapping),
        "array": lambda v: isinstance(v, list),
    }
    return checks[kind](value)
