"""values.schema.json and the chart's cross-value checks turn bad values into clear `helm template` errors.

Types and ranges live in the schema (helm applies it before rendering); rules across values (two operator
replicas need peering, cluster-wide RBAC excludes a namespace list, ...) live in the `llmfleet.validate` template
helper and fail with a message that says how to fix the values. Both are exercised with the real helm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "llmfleet"


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"replicaCount": 0}}, "operator.replicaCount: Must be greater than or equal to 1"),
        ({"opertor": {"replicaCount": 2}}, "Additional property opertor is not allowed"),
        ({"operator": {"peering": {"enabld": True}}}, "Additional property enabld is not allowed"),
        ({"crds": {"enabled": "yes"}}, "crds.enabled: Invalid type. Expected: boolean, given: string"),
        ({"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy: image.pullPolicy must be one of"),
        ({"watchNamespaces": ["Team_A"]}, "watchNamespaces.0: Does not match pattern"),
        ({"watchNamespaces": ["a", "a"]}, "watchNamespaces: array items[0,1] must be unique"),
        ({"gateway": {"port": 70000}}, "gateway.port: Must be less than or equal to 65535"),
        ({"gateway": {"service": {"type": "Ingress"}}}, "gateway.service.type: gateway.service.type must be one of"),
        ({"operator": {"prometheusUrl": "prometheus:9090"}}, "operator.prometheusUrl: Does not match pattern"),
        ({"operator": {"logLevel": "verbose"}}, "operator.logLevel: operator.logLevel must be one of"),
        ({"monitoring": {"interval": "15 seconds"}}, "monitoring.interval: Does not match pattern"),
        (
            {"monitoring": {"prometheusRule": {"kvCacheUtilization": 1.5}}},
            "monitoring.prometheusRule.kvCacheUtilization: Must be less than or equal to 1",
        ),
        (
            {"monitoring": {"prometheusRule": {"ttftP95Seconds": 0}}},
            "monitoring.prometheusRule.ttftP95Seconds: Must be greater than 0",
        ),
    ],
)
def test_schema_rejects_bad_values_with_the_key_path(template, values, message):
    result = template(values)
    assert result.returncode != 0, f"helm accepted {values}"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"operator": {"replicaCount": 2}},
            "operator.replicaCount=2 needs operator.peering.enabled=true",
        ),
        (
            {"rbac": {"clusterWide": True}, "watchNamespaces": ["team-a"]},
            "rbac.clusterWide=true serves every namespace: leave watchNamespaces empty",
        ),
        (
            {"watchNamespaces": ["team-a", "team-b"]},
            "the gateway watches one namespace or all of them",
        ),
        (
            {"gateway": {"apiKeys": {"existingSecret": ""}}},
            "gateway.apiKeys.existingSecret is empty",
        ),
        (
            {"gateway": {"config": {"host": "0.0.0.0"}}},
            "gateway.config.host is set by the chart",
        ),
        (
            {"gateway": {"config": {"port": 9000}}},
            "use gateway.port instead",
        ),
        (
            {"gateway": {"config": {"metrics_port": 9000}}},
            "use gateway.metricsPort instead",
        ),
        (
            {"gateway": {"config": {"metrics_host": "0.0.0.0"}}},
            "gateway.config.metrics_host is set by the chart",
        ),
        (
            {"gateway": {"config": {"allow_open_mode": True}}},
            "the chart runs the gateway with API keys only",
        ),
        (
            {"gateway": {"metricsPort": 8080}},
            "gateway.metricsPort must differ from gateway.port",
        ),
    ],
)
def test_cross_value_rules_fail_with_how_to_fix(template, values, message):
    result = template(values)
    assert result.returncode != 0, f"helm accepted {values}"
    assert message in result.stderr, result.stderr


def test_default_values_satisfy_the_schema(schema):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)


def _leaf_paths(values: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(values, dict) and values:
        return [p for key, sub in values.items() for p in _leaf_paths(sub, (*prefix, key))]
    return [prefix]


def _declared(schema: dict[str, Any], path: tuple[str, ...]) -> bool:
    """Whether the schema names every step of `path` (free-form maps, e.g. labels, end the walk)."""
    node = schema
    for key in path:
        properties = node.get("properties")
        if properties is None:
            return node.get("type") == "object"  # a free-form map: any key is data, not a setting
        if key not in properties:
            return False
        node = properties[key]
    return True


def test_schema_declares_every_value_with_a_type_and_a_description(schema):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    undeclared = [".".join(p) for p in _leaf_paths(values) if not _declared(schema, p)]
    assert not undeclared, f"values.yaml keys missing from values.schema.json: {undeclared}"

    def walk(node: dict[str, Any], path: str) -> None:
        for key, sub in (node.get("properties") or {}).items():
            here = f"{path}.{key}".lstrip(".")
            assert "type" in sub or "anyOf" in sub, f"{here} has no type"
            assert sub.get("description") or sub.get("properties"), f"{here} has no description"
            walk(sub, here)

    walk(schema, "")
