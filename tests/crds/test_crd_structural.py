"""The structural-schema checker catches each rule it exists for, and the pydantic -> structural rewrite is right."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

from crds.render import structural_problems, to_structural


def _root(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
GOOD = _root(
    metadata={"type": "object"},
    spec=_root(
        size={"type": "integer", "minimum": 0, "default": 1},
        quantity={"anyOf": INT_OR_STRING, "x-kubernetes-int-or-string": True},
        extra={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        labels={"type": "object", "additionalProperties": {"type": "string"}},
        items={
            "type": "array",
            "items": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    ),
)


def test_a_good_schema_passes() -> None:
    assert structural_problems(GOOD) == []


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (_root(a={"$ref": "#/$defs/A"}), "keyword '$ref' is not allowed"),
        ({**_root(), "$defs": {}}, "keyword '$defs' is not allowed"),
        (_root(a={"type": "string", "title": "A"}), "keyword 'title' is not allowed"),
        (_root(a={"description": "untyped"}), "<root>.a: no `type`"),
        (_root(a={"type": "null"}), "unknown type 'null'"),
        (_root(a={"anyOf": [{"type": "integer"}, {"type": "null"}]}), "`anyOf` is only allowed"),
        (_root(a={"type": "string", "anyOf": [{"minLength": 1}]}), "`anyOf` is only allowed"),
        (_root(a={"oneOf": [{"type": "string"}]}), "keyword 'oneOf' is not allowed"),
        (
            _root(a={"type": "integer", "anyOf": INT_OR_STRING, "x-kubernetes-int-or-string": True}),
            "must not set `type`",
        ),
        (_root(a={"type": "object", "additionalProperties": False}), "additionalProperties must be a schema"),
        (
            _root(a={"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}),
            "mutually exclusive",
        ),
        (_root(a={"type": "string", "properties": {}}), "need `type: object`"),
        (_root(a={"type": "integer", "minimum": 0, "exclusiveMinimum": 0}), "exclusiveMinimum must be a boolean"),
        (_root(a={"type": "array"}), "needs a single `items` schema"),
        (_root(a={"type": "array", "items": [{"type": "string"}]}), "needs a single `items` schema"),
        (_root(a={"type": "string", "items": {"type": "string"}}), "need `type: array`"),
        (_root(a={"type": "array", "items": {"type": "string"}, "uniqueItems": True}), "'uniqueItems' is not allowed"),
        (
            _root(
                a={
                    "type": "array",
                    "items": {"type": "object", "properties": {"k": {"type": "string"}}},
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["k"],
                }
            ),
            "map key 'k' must be required or defaulted",
        ),
        (
            _root(
                a={
                    "type": "array",
                    "items": {"type": "object", "properties": {}},
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["k"],
                }
            ),
            "map key 'k' is not a property",
        ),
        (_root(a={"type": "integer", "minimum": 1, "default": 0}), "default 0 does not validate"),
        (_root(a={"type": "string", "enum": ["x", 1]}), "enum values [1] are not of type string"),
        (_root(a={"type": "string", "format": "color"}), "format 'color' is unknown"),
        (_root(a={"type": "object", "required": ["b"], "properties": {}}), "required fields ['b'] are not declared"),
        (_root(metadata={"type": "object", "properties": {}}), "<root>.metadata: may only be"),
        ({"type": "string"}, "the root must be `type: object`"),
    ],
)
def test_each_rule_is_enforced(schema: dict[str, Any], expected: str) -> None:
    problems = structural_problems(schema)
    assert any(expected in problem for problem in problems), problems


class _Inner(BaseModel):
    """Inner doc."""

    level: int = Field(1, gt=0, le=10, description="A level.")


class _Outer(BaseModel):
    """Outer doc."""

    inner: _Inner = Field(default_factory=_Inner, description="Field doc wins.")
    maybe: _Inner | None = Field(None, description="Optional object.")
    count: int | None = Field(None, ge=0)
    free: dict[str, Any] = Field(default_factory=dict)
    names: dict[str, str] = Field(default_factory=dict)


def test_to_structural_inlines_refs_unwraps_optionals_and_rewrites_bounds() -> None:
    schema = to_structural(_Outer.model_json_schema())
    props = schema["properties"]
    assert props["inner"]["description"] == "Field doc wins."
    assert props["inner"]["properties"]["level"] == {
        "type": "integer",
        "default": 1,
        "description": "A level.",
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 10,
    }
    assert props["maybe"]["type"] == "object" and "default" not in props["maybe"]
    assert props["count"] == {"type": "integer", "minimum": 0}
    assert props["free"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert props["names"] == {"type": "object", "additionalProperties": {"type": "string"}}
    assert structural_problems({"type": "object", "properties": {"x": schema}}) == []


class _Node(BaseModel):
    children: list[_Node] = Field(default_factory=list)


class _Union(BaseModel):
    value: int | str | None = None


@pytest.mark.parametrize(
    ("model", "message"), [(_Node, "recursive model"), (_Union, "cannot express a union of 2 types")]
)
def test_to_structural_refuses_what_kubernetes_cannot_hold(model: type[BaseModel], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        to_structural(model.model_json_schema())
