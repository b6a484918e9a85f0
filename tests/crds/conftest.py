"""Shared fixtures for the CRD tests: the committed CRD, its schema validator, the examples, a minimal spec."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "inferencedeployment.yaml"

MINIMAL_SPEC: dict[str, Any] = {
    "model": {"name": "smollm2", "source": "bundled://smollm2-135m-instruct"},
    "variants": [{"name": "default"}],
}


@pytest.fixture(scope="session")
def committed_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


@pytest.fixture(scope="session")
def openapi_schema(committed_crd: dict[str, Any]) -> dict[str, Any]:
    return committed_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def schema_validator(openapi_schema: dict[str, Any]) -> jsonschema.Draft4Validator:
    """A real JSON-schema validator over the CRD's schema (OpenAPI 3.0 bounds are draft-4 style)."""
    jsonschema.Draft4Validator.check_schema(openapi_schema)
    return jsonschema.Draft4Validator(openapi_schema)


@pytest.fixture
def make_spec() -> Callable[..., dict[str, Any]]:
    """A fresh minimal valid spec, changed by `mutate(spec)` when given."""

    def build(mutate: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
        spec = copy.deepcopy(MINIMAL_SPEC)
        if mutate is not None:
            mutate(spec)
        return spec

    return build


@pytest.fixture
def as_resource() -> Callable[..., dict[str, Any]]:
    """Wrap a spec into a whole InferenceDeployment object."""

    def wrap(spec: dict[str, Any], name: str = "smollm2") -> dict[str, Any]:
        return {
            "apiVersion": "llmfleet.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": name},
            "spec": spec,
        }

    return wrap
