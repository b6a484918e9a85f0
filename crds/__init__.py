"""The InferenceDeployment custom resource: pydantic models (the single source of truth), the generated CRD, semantic validation."""

from crds.helpers import dump_spec, dump_status, parse_quantity, parse_resource, parse_spec, parse_status
from crds.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    Engine,
    InferenceDeployment,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    Quantization,
)
from crds.render import crd, render, structural_problems
from crds.validate import Problem, validate, validate_resource

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "Engine",
    "InferenceDeployment",
    "InferenceDeploymentSpec",
    "InferenceDeploymentStatus",
    "Problem",
    "Quantization",
    "crd",
    "dump_spec",
    "dump_status",
    "parse_quantity",
    "parse_resource",
    "parse_spec",
    "parse_status",
    "render",
    "structural_problems",
    "validate",
    "validate_resource",
]
