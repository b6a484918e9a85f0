"""Pydantic models of the InferenceDeployment resource: the single source of truth for its shape.

`crds/render.py` turns these models into the CRD's structural OpenAPI schema, so every constraint, default and
description written here is what the API server enforces and what `kubectl explain infd.spec...` shows. Rules that
span several fields (min <= max, increasing canary weights, ...) are not here: they live in `crds/validate.py`, so
a semantically wrong spec still parses and the operator can report it instead of failing to read the resource.

The models live in one module per part of the resource, and this module re-exports them all, so
`from crds.models import X` works for every name:
- `crds.base`: the API's identity (group, version, kind), value patterns, names the operator keeps for itself,
  shared value types (`Quantity`, `FreeForm`), the spec and status base classes and the CEL helpers.
- `crds.spec`: the spec (model, engine, variants, autoscaling, rollout, drain).
- `crds.podtemplate`: the worker pod template, an allow-list (`PodExtras`, `Volume`, `EnvVarSource`, ...): a CR
  author gets worker pods of that shape only (docs/cr-authors.md), so these models declare every field they accept
  and the CRD schema has no free-form pod fields. What a structural schema cannot say ("exactly one volume source",
  operator-owned names and keys) is written as CEL `x-kubernetes-validations` (`crds.base.cel`), which a real API
  server enforces at apply time; `crds/validate.py` checks the same rules in Python, because localkube and older
  API servers run no CEL.
- `crds.status`: the status, written only by the operator.
- here: `InferenceDeployment`, the whole object.

Names are snake_case in Python and camelCase on the wire (`by_alias=True` when dumping). Spec models reject
unknown fields (typos are errors); status models ignore them (an older operator can read a newer status).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from crds.base import (
    API_VERSION,
    CONFIG_KEY_PATTERN,
    CONFINEMENT_ANNOTATION_PREFIXES,
    DEFAULT_CACHE_DIR,
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    ENV_NAME_PATTERN,
    GROUP,
    KIND,
    MODEL_NAME_PATTERN,
    MODEL_SOURCE_PATTERN,
    MODELS_MOUNT,
    OPERATOR_KEY_PREFIX,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUME_NAMES,
    PLURAL,
    QUANTITY_PATTERN,
    SHORT_NAMES,
    SINGULAR,
    TMP_MOUNT,
    VERSION,
    DnsLabel,
    FreeForm,
    Quantity,
)
from crds.podtemplate import (
    ENV_SOURCE_FIELDS,
    POD_EXTRAS_DESCRIPTION,
    PROJECTION_FIELDS,
    VOLUME_SOURCE_FIELDS,
    ConfigMapProjection,
    ConfigMapVolumeSource,
    DnsConfig,
    DnsOption,
    DnsPolicy,
    DownwardAPIFile,
    DownwardAPIProjection,
    EmptyDirSource,
    EnvVar,
    EnvVarSource,
    FileMode,
    KeySelector,
    KeyToPath,
    LocalObjectReference,
    ObjectFieldSelector,
    PersistentVolumeClaimSource,
    PodExtras,
    PodTemplate,
    ProjectedSource,
    PullPolicy,
    ResourceFieldSelector,
    SecretProjection,
    SecretVolumeSource,
    StorageMedium,
    TaintEffect,
    Toleration,
    TolerationOperator,
    Volume,
    VolumeMount,
    VolumeProjection,
)
from crds.spec import (
    VLLM_LORA_RANKS,
    AdapterSpec,
    AnalysisSpec,
    AutoscalingSpec,
    AutoscalingTargets,
    CanarySpec,
    CanaryStep,
    DrainSpec,
    DType,
    Engine,
    EngineSpec,
    InferenceDeploymentSpec,
    LoraSpec,
    ModelSpec,
    Quantization,
    Resources,
    RolloutSpec,
    SpeculativeMethod,
    SpeculativeSpec,
    VariantSpec,
)
from crds.status import (
    AdapterPodState,
    AdapterPodStatus,
    AdapterStatus,
    AlertIntent,
    AnalysisResult,
    AutoscalingStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    DecisionTrigger,
    DrainReason,
    DrainStatus,
    Endpoint,
    InferenceDeploymentStatus,
    MetricInputs,
    Phase,
    Recommendation,
    RevisionReplicas,
    RolloutPhase,
    RolloutStatus,
    ScaleDecision,
    VariantAutoscalingStatus,
    VariantStatus,
    Verdict,
)

__all__ = [
    "API_VERSION",
    "CONFIG_KEY_PATTERN",
    "CONFINEMENT_ANNOTATION_PREFIXES",
    "DEFAULT_CACHE_DIR",
    "DNS_LABEL_PATTERN",
    "DNS_SUBDOMAIN_PATTERN",
    "ENV_NAME_PATTERN",
    "ENV_SOURCE_FIELDS",
    "GROUP",
    "KIND",
    "MODELS_MOUNT",
    "MODEL_NAME_PATTERN",
    "MODEL_SOURCE_PATTERN",
    "OPERATOR_KEY_PREFIX",
    "OPERATOR_MOUNT_PATHS",
    "OPERATOR_VOLUME_NAMES",
    "PLURAL",
    "POD_EXTRAS_DESCRIPTION",
    "PROJECTION_FIELDS",
    "QUANTITY_PATTERN",
    "SHORT_NAMES",
    "SINGULAR",
    "TMP_MOUNT",
    "VERSION",
    "VLLM_LORA_RANKS",
    "VOLUME_SOURCE_FIELDS",
    "AdapterPodState",
    "AdapterPodStatus",
    "AdapterSpec",
    "AdapterStatus",
    "AlertIntent",
    "AnalysisResult",
    "AnalysisSpec",
    "AutoscalingSpec",
    "AutoscalingStatus",
    "AutoscalingTargets",
    "CanarySpec",
    "CanaryStep",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "ConfigMapProjection",
    "ConfigMapVolumeSource",
    "DType",
    "DecisionTrigger",
    "DnsConfig",
    "DnsLabel",
    "DnsOption",
    "DnsPolicy",
    "DownwardAPIFile",
    "DownwardAPIProjection",
    "DrainReason",
    "DrainSpec",
    "DrainStatus",
    "EmptyDirSource",
    "Endpoint",
    "Engine",
    "EngineSpec",
    "EnvVar",
    "EnvVarSource",
    "FileMode",
    "FreeForm",
    "InferenceDeployment",
    "InferenceDeploymentSpec",
    "InferenceDeploymentStatus",
    "KeySelector",
    "KeyToPath",
    "LocalObjectReference",
    "LoraSpec",
    "MetricInputs",
    "ModelSpec",
    "ObjectFieldSelector",
    "PersistentVolumeClaimSource",
    "Phase",
    "PodExtras",
    "PodTemplate",
    "ProjectedSource",
    "PullPolicy",
    "Quantity",
    "Quantization",
    "Recommendation",
    "ResourceFieldSelector",
    "Resources",
    "RevisionReplicas",
    "RolloutPhase",
    "RolloutSpec",
    "RolloutStatus",
    "ScaleDecision",
    "SecretProjection",
    "SecretVolumeSource",
    "SpeculativeMethod",
    "SpeculativeSpec",
    "StorageMedium",
    "TaintEffect",
    "Toleration",
    "TolerationOperator",
    "VariantAutoscalingStatus",
    "VariantSpec",
    "VariantStatus",
    "Verdict",
    "Volume",
    "VolumeMount",
    "VolumeProjection",
]


class InferenceDeployment(BaseModel):
    """A whole InferenceDeployment object as the API returns it (metadata kept as a plain mapping)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    api_version: str = Field(API_VERSION, description="`llmfleet.io/v1alpha1`.")
    kind: str = Field(KIND, description="`InferenceDeployment`.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus = Field(default_factory=InferenceDeploymentStatus)
