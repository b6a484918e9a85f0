"""Structural OpenAPI v3 schemas of CustomResourceDefinitions: pruning, defaulting and validation.

Mirrors the apiextensions-apiserver: unknown fields are pruned unless ``x-kubernetes-preserve-unknown-fields``,
``default`` values are applied to present parents (nulls of non-nullable fields are dropped first), then the object
is validated and every problem is reported as a ``Cause`` with a Kubernetes field path
(``spec.variants[0].autoscaling.minReplicas``). ``x-kubernetes-validations`` (CEL) rules are not evaluated.
"""

from __future__ import annotations

import functools
import math
import re

from localkube.errors import Cause, duplicate, invalid_value, not_supported, render_value, required_value
from localkube.meta import clone

_ROOT_FIELDS = ("apiVersion", "kind", "metadata")
_TYPE_CHECKS = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}
_JSON_TYPE = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _json_type(value: object) -> str:
    return "null" if value is None else _JSON_TYPE.get(type(value), type(value).__name__)


@functools.lru_cache(maxsize=512)
def _regex(pattern: str) -> re.Pattern:
    return re.compile(pattern)


# ---------------------------------------------------------------------------------------------------------- prune


def prune(obj: object, schema: dict | None, path: str = "", root: bool = False) -> list[str]:
    """Remove fields the schema does not know, in place; returns the paths of pruned fields."""
    pruned: list[str] = []
    if schema is None:
        return pruned
    if isinstance(obj, dict):
        props = schema.get("properties")
        additional = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
        embedded = schema.get("x-kubernetes-embedded-resource") is True
        for key in list(obj):
            child_path = join(path, key)
            if (root or embedded) and key in _ROOT_FIELDS:
                if key == "metadata" and isinstance(obj[key], dict) and props and "metadata" in props and not root:
                    pruned += prune(obj[key], props["metadata"], child_path)
                continue
            if props is not None and key in props:
                pruned += prune(obj[key], props[key], child_path)
            elif isinstance(additional, dict):
                pruned += prune(obj[key], additional, child_path)
            elif (
                additional is True or preserve or (props is None and additional is None and not _has_structure(schema))
            ):
                continue
            else:
                del obj[key]
                pruned.append(child_path)
    elif isinstance(obj, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for n, item in enumerate(obj):
                pruned += prune(item, items, f"{path}[{n}]")
    return pruned


def _has_structure(schema: dict) -> bool:
    """An object schema with neither properties nor additionalProperties prunes everything, unless it preserves."""
    return schema.get("type") == "object" or "properties" in schema


# -------------------------------------------------------------------------------------------------------- default


def apply_defaults(obj: object, schema: dict | None) -> None:
    """Apply ``default`` values in place, like the API server does when decoding a request."""
    if schema is None:
        return
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key in obj and obj[key] is None and not sub.get("nullable"):
                del obj[key]
            if key not in obj and "default" in sub:
                obj[key] = clone(sub["default"])
        for key, value in obj.items():
            if key in props:
                apply_defaults(value, props[key])
            elif isinstance(schema.get("additionalProperties"), dict):
                apply_defaults(value, schema["additionalProperties"])
    elif isinstance(obj, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for item in obj:
                apply_defaults(item, items)


# ------------------------------------------------------------------------------------------------------- validate


def validate(obj: object, schema: dict | None, path: str = "", root: bool = False) -> list[Cause]:
    """Validate ``obj`` against a structural schema and return every problem found."""
    if schema is None:
        return []
    causes: list[Cause] = []
    if obj is None:
        if schema.get("nullable"):
            return []
        typ = schema.get("type")
        if typ:
            return [invalid_value(path, None, f'{path or "body"} in body must be of type {typ}: "null"')]
        return []
    typ = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not (_TYPE_CHECKS["integer"](obj) or isinstance(obj, str)):
            return [
                invalid_value(
                    path, obj, f"{path} in body must be of type integer,string: {render_value(_json_type(obj))}"
                )
            ]
    elif typ and typ in _TYPE_CHECKS and not _TYPE_CHECKS[typ](obj):
        return [
            invalid_value(path, obj, f"{path or 'body'} in body must be of type {typ}: {render_value(_json_type(obj))}")
        ]

    if "enum" in schema and obj not in schema["enum"]:
        causes.append(not_supported(path, obj, schema["enum"]))

    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        causes += _numeric(obj, schema, path)
    elif isinstance(obj, str):
        causes += _string(obj, schema, path)
    elif isinstance(obj, list):
        causes += _array(obj, schema, path)
    elif isinstance(obj, dict):
        causes += _object(obj, schema, path, root)

    for sub in schema.get("allOf") or []:
        causes += validate(obj, sub, path)
    if schema.get("anyOf") and all(validate(obj, sub, path) for sub in schema["anyOf"]):
        causes.append(invalid_value(path, obj, f"{path} in body must match at least one schema in anyOf"))
    if schema.get("oneOf"):
        matching = sum(1 for sub in schema["oneOf"] if not validate(obj, sub, path))
        if matching != 1:
            causes.append(invalid_value(path, obj, f"{path} in body must validate one and only one schema (oneOf)"))
    if isinstance(schema.get("not"), dict) and not validate(obj, schema["not"], path):
        causes.append(invalid_value(path, obj, f"{path} in body should not be valid against the 'not' schema"))
    return causes


def _numeric(value: float, schema: dict, path: str) -> list[Cause]:
    causes = []
    if "minimum" in schema:
        lo = schema["minimum"]
        if schema.get("exclusiveMinimum") is True and value <= lo:
            causes.append(invalid_value(path, value, f"{path} in body should be greater than {lo}"))
        elif value < lo:
            causes.append(invalid_value(path, value, f"{path} in body should be greater than or equal to {lo}"))
    if "maximum" in schema:
        hi = schema["maximum"]
        if schema.get("exclusiveMaximum") is True and value >= hi:
            causes.append(invalid_value(path, value, f"{path} in body should be less than {hi}"))
        elif value > hi:
            causes.append(invalid_value(path, value, f"{path} in body should be less than or equal to {hi}"))
    if schema.get("multipleOf"):
        factor = schema["multipleOf"]
        quotient = value / factor
        if not math.isclose(quotient, round(quotient), rel_tol=0, abs_tol=1e-9):
            causes.append(invalid_value(path, value, f"{path} in body should be a multiple of {factor}"))
    fmt = schema.get("format")
    if fmt == "int32" and isinstance(value, int) and not -(2**31) <= value < 2**31:
        causes.append(invalid_value(path, value, f"{path} in body must be of type int32"))
    return causes


def _string(value: str, schema: dict, path: str) -> list[Cause]:
    causes = []
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        causes.append(Cause(path, "FieldValueTooLong", f"Too long: may not be more than {schema['maxLength']} bytes"))
    if "minLength" in schema and len(value) < schema["minLength"]:
        causes.append(invalid_value(path, value, f"{path} in body should be at least {schema['minLength']} chars long"))
    if "pattern" in schema and not _regex(schema["pattern"]).search(value):
        causes.append(invalid_value(path, value, f"{path} in body should match '{schema['pattern']}'"))
    return causes


def _array(value: list, schema: dict, path: str) -> list[Cause]:
    causes: list[Cause] = []
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        causes.append(
            Cause(path, "FieldValueTooMany", f"Too many: {len(value)}: must have at most {schema['maxItems']} items")
        )
    if "minItems" in schema and len(value) < schema["minItems"]:
        causes.append(invalid_value(path, value, f"{path} in body should have at least {schema['minItems']} items"))
    list_type = schema.get("x-kubernetes-list-type")
    if schema.get("uniqueItems") or list_type == "set":
        seen: list = []
        for n, item in enumerate(value):
            if item in seen:
                causes.append(duplicate(f"{path}[{n}]", item))
            seen.append(item)
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen_keys: set = set()
        for n, item in enumerate(value):
            if isinstance(item, dict):
                key = tuple(render_value(item.get(k)) for k in keys)
                if key in seen_keys:
                    causes.append(duplicate(f"{path}[{n}]", {k: item.get(k) for k in keys}))
                seen_keys.add(key)
    items = schema.get("items")
    if isinstance(items, dict):
        for n, item in enumerate(value):
            causes += validate(item, items, f"{path}[{n}]")
    return causes


def _object(value: dict, schema: dict, path: str, root: bool) -> list[Cause]:
    causes: list[Cause] = []
    for key in schema.get("required") or []:
        if key not in value:
            causes.append(required_value(join(path, key)))
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        causes.append(
            Cause(
                path, "FieldValueTooMany", f"Too many: {len(value)}: must have at most {schema['maxProperties']} items"
            )
        )
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        causes.append(
            invalid_value(path, value, f"{path} in body should have at least {schema['minProperties']} properties")
        )
    props = schema.get("properties") or {}
    additional = schema.get("additionalProperties")
    for key, item in value.items():
        if root and key in _ROOT_FIELDS:
            continue
        if key in props:
            causes += validate(item, props[key], join(path, key))
        elif isinstance(additional, dict):
            causes += validate(item, additional, join(path, key))
    return causes


# ------------------------------------------------------------------------------------------- structural checks


def check_structural(schema: object, path: str = "schema.openAPIV3Schema") -> list[Cause]:
    """The CRD-level rules a real API server enforces on ``openAPIV3Schema`` (the main ones)."""
    if not isinstance(schema, dict):
        return [required_value(path)]
    causes = _check_node(schema, path, in_logic=False)
    if schema.get("type") != "object":
        causes.append(invalid_value(f"{path}.type", schema.get("type"), "must be object at the root"))
    meta = (schema.get("properties") or {}).get("metadata")
    if isinstance(meta, dict):
        extra = set(meta.get("properties") or {}) - {"name", "generateName"}
        if extra:
            causes.append(
                Cause(
                    f"{path}.properties[metadata]",
                    "FieldValueForbidden",
                    "Forbidden: must not specify anything other than name and generateName, but metadata is implicitly specified",
                )
            )
    return causes


def _check_node(node: dict, path: str, in_logic: bool) -> list[Cause]:
    causes: list[Cause] = []
    if "$ref" in node:
        causes.append(Cause(f"{path}.$ref", "FieldValueForbidden", "Forbidden: $ref is not supported"))
    has_children = "properties" in node or "items" in node or "additionalProperties" in node
    untyped_ok = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    if not in_logic and not node.get("type") and not untyped_ok:
        causes.append(
            required_value(
                f"{path}.type", "must not be empty for specified object fields" if has_children else "must not be empty"
            )
        )
    if node.get("type") == "array" and not in_logic and not isinstance(node.get("items"), dict):
        causes.append(required_value(f"{path}.items", "must be specified"))
    if (
        "properties" in node
        and isinstance(node.get("additionalProperties"), (dict, bool))
        and node["additionalProperties"] is not True
    ):
        causes.append(
            Cause(
                f"{path}.additionalProperties",
                "FieldValueForbidden",
                "Forbidden: additionalProperties and properties are mutual exclusive",
            )
        )
    for key, sub in (node.get("properties") or {}).items():
        if isinstance(sub, dict):
            causes += _check_node(sub, f"{path}.properties[{key}]", in_logic)
    if isinstance(node.get("items"), dict):
        causes += _check_node(node["items"], f"{path}.items", in_logic)
    if isinstance(node.get("additionalProperties"), dict):
        causes += _check_node(node["additionalProperties"], f"{path}.additionalProperties", in_logic)
    for logic in ("allOf", "anyOf", "oneOf"):
        for n, sub in enumerate(node.get(logic) or []):
            if isinstance(sub, dict):
                causes += _check_node(sub, f"{path}.{logic}[{n}]", in_logic=True)
    if isinstance(node.get("not"), dict):
        causes += _check_node(node["not"], f"{path}.not", in_logic=True)
    if "default" in node and not in_logic:
        default = clone(node["default"])
        if isinstance(default, (dict, list)):
            prune(default, node)
        bad = validate(default, {k: v for k, v in node.items() if k != "default"}, "")
        for cause in bad:
            causes.append(
                Cause(f"{path}.default{('.' + cause.field) if cause.field else ''}", cause.reason, cause.message)
            )
    for key in ("pattern",):
        if key in node:
            try:
                _regex(node[key])
            except re.error as exc:
                causes.append(
                    invalid_value(f"{path}.pattern", node[key], f"must be a valid regular expression, but isn't: {exc}")
                )
    return causes
