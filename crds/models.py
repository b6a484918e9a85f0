"""Pydantic models of the InferenceDeployment resource: the single source of truth for its shape.

`crds/render.py` turns these models into the CRD's structural OpenAPI schema, so every constraint, default and
description written here is what the API server enforces and what `kubectl explain infd.spec...` shows. Rules that
span several fields (min <= max, increasing canary weights, ...) are not here: they live in `crds/validate.py`, so
a semantically wrong spec still parses and the operator can report it instead of failing to read the resource.

The pod template is an allow-list (`PodExtras`, `Volume`, `EnvVarSource`, ...): a CR author gets worker pods of that
shape only (docs/cr-authors.md), so these models declare every field they accept and the CRD schema has no
free-form pod fields. What a structural schema cannot say ("exactly one volume source", operator-owned names and
keys) is written here as CEL `x-kubernetes-validations` (`_cel`), which a real API server enforces at apply time;
`crds/validate.py` checks the same rules in Python, because localkube and older API servers run no CEL.

Names are snake_case in Python and camelCase on the wire (`by_alias=True` when dumping). Spec models reject
unknown fields (typos are errors); status models ignore them (an older operator can read a newer status).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, WithJsonSchema
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict, JsonValue

GROUP = "llmfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ("infd",)

# A Kubernetes resource quantity ("500m", "2", "1.5Gi", "64Mi"), the same pattern the API server uses.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Served model names: no ':' because the gateway reads `MODEL:VARIANT` as a request for one variant.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
MODEL_SOURCE_PATTERN = (
    r"^(bundled://[a-z0-9][a-z0-9._-]*"
    r"|hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?"
    r"|/[^\s]*)$"
)
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# Names of Secrets, ConfigMaps, claims, RuntimeClasses, schedulers (Kubernetes' DNS-1123 subdomain).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# Label and annotation keys under the operator's own prefix (`llmfleet.io/deployment`, `llmfleet.io/draining`,
# ...) are the operator's: a pod created with them would be mistaken for another deployment's or a draining one.
OPERATOR_KEY_PREFIX = f"{GROUP}/"
# Annotation keys that loosen a container's confinement (AppArmor unconfined, seccomp off); worker pods keep the
# operator's security context.
CONFINEMENT_ANNOTATION_PREFIXES = (
    "container.apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
)
# Volume names the operator gives its own volumes of the worker pod (scratch /tmp, model cache, model claim).
OPERATOR_VOLUME_NAMES = ("tmp", "model-cache", "model")
# Where the operator mounts them in the worker container (`controllers.pods`).
TMP_MOUNT = "/tmp"
MODELS_MOUNT = "/models"
DEFAULT_CACHE_DIR = "/var/cache/llmfleet"
OPERATOR_MOUNT_PATHS = (TMP_MOUNT, MODELS_MOUNT, DEFAULT_CACHE_DIR)


def _int_to_quantity(value: Any) -> Any:
    """YAML turns `cpu: 2` into an int; like the API server (int-or-string), accept integers as quantities.
    Floats stay floats and fail, as they do on the API server: write `"0.5"` or `500m`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_int_to_quantity),
    StringConstraints(pattern=QUANTITY_PATTERN),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
DnsLabel = Annotated[str, StringConstraints(pattern=DNS_LABEL_PATTERN, max_length=63)]
# Free-form objects: rendered with `x-kubernetes-preserve-unknown-fields: true`.
FreeForm = dict[str, Any]


def _list_map(*keys: str) -> dict[str, Any]:
    """Schema extras that make a list a map keyed by `keys` (server-side apply merges entries, keys must be unique)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


class _SpecModel(BaseModel):
    """Base of spec models: camelCase on the wire, unknown fields are errors, types strict (no "3" for 3) exactly
    like the API server's schema; enum fields opt out (`strict=False`) so that they accept their string values."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)


class _StatusModel(BaseModel):
    """Base of status models: camelCase on the wire, unknown fields ignored."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


# ----------------------------------------------------------------------------------------------------------- spec


class Engine(StrEnum):
    """Inference engine run in the worker pods."""

    BUILTIN = "builtin"
    VLLM = "vllm"


class Quantization(StrEnum):
    """Weight quantization of a variant."""

    NONE = "none"
    FP8 = "fp8"
    INT4 = "int4"


class DType(StrEnum):
    """Activation/weight compute dtype; `auto` lets the engine choose (bfloat16 where supported)."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class ModelSpec(_SpecModel):
    """The model served, and where its weights come from."""

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=MODEL_NAME_PATTERN,
        description="Served model name: the `model` field clients send (e.g. `smollm2`, `llama-3-8b`). "
        "Letters, digits, '.', '_', '/', '-'; no ':' (the gateway reads `NAME:VARIANT` as a request for one variant).",
    )
    source: str = Field(
        max_length=512,
        pattern=MODEL_SOURCE_PATTERN,
        description="Where the weights come from: `bundled://smollm2-135m-instruct` (shipped with the worker image), "
        "`hf://ORG/REPO` (downloaded from a model hub; the cluster must reach one), `pvc://CLAIM/PATH` "
        "(a PersistentVolumeClaim mounted read-only) or an absolute path already present on the node.",
    )
    revision: str | None = Field(
        None, min_length=1, max_length=128, description="Hub revision (branch, tag or commit) for `hf://` sources."
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=1_048_576,
        description="Longest sequence (prompt + output tokens) served; unset means the model's own limit.",
    )


class EngineSpec(_SpecModel):
    """The inference engine and its knobs; the same names map to both engines' flags."""

    type: Engine = Field(
        Engine.BUILTIN,
        strict=False,
        description="`builtin` (llmfleet's own paged-KV engine: CPU or CUDA) or `vllm` (vLLM's OpenAI server).",
    )
    dtype: DType = Field(DType.AUTO, strict=False, description="Compute dtype: auto, float32, bfloat16 or float16.")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Most sequences batched together in one step.")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=16,
        le=1_048_576,
        description="Token budget of one engine step (prefill chunks + decodes); unset means the engine default.",
    )
    kv_cache_bytes: Quantity | None = Field(
        None,
        description="Memory reserved for the paged KV cache per pod, as a quantity (e.g. `64Mi`, `8Gi`); unset means "
        "the engine sizes it from free memory.",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts into chunks that share steps with decodes."
    )
    extra_args: FreeForm = Field(
        default_factory=dict,
        description="Extra engine flags, free-form: key = flag name without leading dashes (e.g. "
        "`gpu-memory-utilization: 0.9`), `true` = bare flag. Flags that have a field here or that the operator "
        "sets itself (model, host, port, quantization, ...) are refused: use the field.",
    )


class AutoscalingTargets(_SpecModel):
    """Per-replica targets; the autoscaler sizes the variant so that every set signal is at or below its target."""

    queue_depth_per_replica: float | None = Field(
        None, gt=0, le=10_000, description="Mean waiting requests per ready pod (`vllm:num_requests_waiting`)."
    )
    kv_cache_utilization: float | None = Field(
        None, gt=0, le=1, description="Mean KV-cache usage fraction per pod (`vllm:kv_cache_usage_perc`), 0..1."
    )
    ttft_p95_seconds: float | None = Field(
        None, gt=0, le=3600, description="95th percentile time to first token, seconds."
    )


class AutoscalingSpec(_SpecModel):
    """Autoscaling of one variant on queue depth, KV-cache utilisation and TTFT."""

    min_replicas: int = Field(
        1, ge=0, le=1000, description="Fewest pods; 0 allows scale to zero (needs `scaleToZeroAfterSeconds`)."
    )
    max_replicas: int = Field(ge=1, le=1000, description="Most pods.")
    targets: AutoscalingTargets = Field(
        default_factory=AutoscalingTargets, description="Signals and their per-replica targets; set at least one."
    )
    tolerance: float = Field(
        0.1, ge=0, le=0.5, description="No change while every signal is within this fraction of its target."
    )
    scale_up_max_step: int = Field(4, ge=1, le=1000, description="Most pods added by one decision.")
    scale_down_stabilization_seconds: int = Field(
        120,
        ge=0,
        le=3600,
        description="Scale down only to the highest recommendation of this trailing window.",
    )
    scale_to_zero_after_seconds: int | None = Field(
        None,
        ge=10,
        le=86_400,
        description="Go to zero pods after this many seconds without requests (needs `minReplicas: 0`); the "
        "gateway holds requests meanwhile and wakes the variant.",
    )


class Resources(_SpecModel):
    """Per-pod resources. They are requests; memory and GPUs are also the limits."""

    cpu: Quantity | None = Field(None, description="CPU request, e.g. `2` or `500m`.")
    memory: Quantity | None = Field(None, description="Memory request and limit, e.g. `2Gi`.")
    gpu: int = Field(0, ge=0, le=16, alias="nvidia.com/gpu", description="NVIDIA GPUs per pod (request = limit).")


class VariantSpec(_SpecModel):
    """One way of serving the model (e.g. an fp8 and an int4 build); each variant has its own pods and size."""

    name: str = Field(
        min_length=1,
        max_length=32,
        pattern=DNS_LABEL_PATTERN,
        description="Variant name: lowercase letters, digits and '-' (used in pod names and labels).",
    )
    quantization: Quantization = Field(
        Quantization.NONE,
        strict=False,
        description="Weight quantization: `none`, `fp8` or `int4`. With `engine.type: vllm`, int4 needs a "
        "pre-quantized checkpoint in this variant's `source`.",
    )
    source: str | None = Field(
        None,
        max_length=512,
        pattern=MODEL_SOURCE_PATTERN,
        description="Weights for this variant only (e.g. an AWQ/GPTQ int4 checkpoint); unset means `model.source`.",
    )
    weight: int = Field(
        1,
        ge=0,
        le=1000,
        description="Relative share of the requests that name no variant and no tier (share = weight / sum of "
        "weights), and of `spec.replicas`. 0 = reached only by tier or by `MODEL:VARIANT`.",
    )
    tiers: list[DnsLabel] = Field(
        default_factory=list,
        max_length=16,
        description="Request tiers this variant serves first (`x-llmfleet-tier` or the API key's tier); empty = none.",
    )
    resources: Resources = Field(default_factory=Resources, description="Per-pod CPU, memory and GPUs.")
    replicas: int | None = Field(
        None, ge=0, le=1000, description="Fixed pod count for this variant (instead of `autoscaling`)."
    )
    autoscaling: AutoscalingSpec | None = Field(None, description="Autoscale this variant (instead of `replicas`).")
    extra_args: FreeForm = Field(
        default_factory=dict, description="Engine flags for this variant only, laid over `engine.extraArgs`."
    )


class CanaryStep(_SpecModel):
    """One step of a canary rollout."""

    weight: int = Field(ge=1, le=100, description="Percent of traffic (and of pods) on the canary during this step.")
    pause_seconds: int = Field(
        60, ge=0, le=86_400, description="How long the step holds while analysis runs before the next step."
    )


class AnalysisSpec(_SpecModel):
    """Canary analysis: canary vs stable on LLM metrics, checked every `intervalSeconds`."""

    ttft_p95_max_ratio: float = Field(
        1.5, ge=1, le=100, description="Fail when canary TTFT p95 exceeds stable's by more than this factor."
    )
    itl_p95_max_ratio: float = Field(
        1.5, ge=1, le=100, description="Fail when canary inter-token latency p95 exceeds stable's by this factor."
    )
    error_rate_max: float = Field(
        0.01, ge=0, le=1, description="Fail when the canary's error rate (5xx and aborted streams) is above this."
    )
    quality_min_agreement: float = Field(
        0.9,
        ge=0,
        le=1,
        description="When the quantization changes: fail when the canary's top token matches the stable "
        "revision's greedy token at fewer than this fraction of positions (teacher-forced on stable's continuations "
        "of the probe prompts; see docs/canary.md).",
    )
    interval_seconds: int = Field(30, ge=5, le=3600, description="Seconds between analysis checks.")
    failure_limit: int = Field(2, ge=1, le=100, description="Consecutive failed checks that trigger a rollback.")
    min_requests: int = Field(
        10, ge=0, le=100_000, description="Fewer canary requests than this in an interval: inconclusive, not pass."
    )


class CanarySpec(_SpecModel):
    """A canary rollout: the new revision takes traffic step by step while analysis compares it with stable."""

    steps: list[CanaryStep] = Field(
        min_length=1,
        max_length=20,
        description="Steps with strictly increasing weights in 1..100; promotion follows the last step.",
    )
    analysis: AnalysisSpec = Field(
        default_factory=AnalysisSpec, description="Thresholds that fail an analysis check, and how often checks run."
    )


class RolloutSpec(_SpecModel):
    """How a change of the pod-relevant spec reaches the pods. Without it pods are replaced (drained) directly."""

    canary: CanarySpec = Field(description="Canary rollout with automated analysis and rollback.")


class DrainSpec(_SpecModel):
    """Lame-duck draining of every pod that goes away."""

    timeout_seconds: int = Field(
        120, ge=0, le=3600, description="Longest wait for in-flight requests to finish before the pod is deleted."
    )
    termination_grace_period_seconds: int = Field(
        150, ge=1, le=7200, description="The pods' grace period; must exceed `timeoutSeconds`."
    )


def _cel(rule: str, message: str) -> JsonDict:
    """One CEL rule of `x-kubernetes-validations`: what the API server checks at apply time that the schema cannot
    say. `crds/validate.py` checks the same in Python, so the operator refuses what an API server without the rule
    (or localkube, which runs no CEL) let through."""
    return {"rule": rule, "message": message}


def _one_of(fields: tuple[str, ...], what: str) -> list[JsonValue]:
    """The CEL rule of an object that must set exactly one of `fields` (wire names)."""
    count = " + ".join(f"(has(self.{name}) ? 1 : 0)" for name in fields)
    return [_cel(f"{count} == 1", f"set exactly one {what}: {', '.join(fields)}")]


class KeySelector(_SpecModel):
    """A key of a Secret or ConfigMap in the deployment's own namespace (Kubernetes never looks elsewhere)."""

    name: str = Field(
        max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the Secret or ConfigMap."
    )
    key: str = Field(min_length=1, max_length=253, pattern=CONFIG_KEY_PATTERN, description="The key to select.")
    optional: bool | None = Field(None, description="Whether a missing object or key is allowed.")


class ObjectFieldSelector(_SpecModel):
    """A field of the pod (downward API), e.g. `metadata.name`, `status.podIP`, `metadata.labels['app']`."""

    field_path: str = Field(min_length=1, max_length=256, description="Path of the field, e.g. `status.hostIP`.")
    api_version: str | None = Field(None, max_length=64, description="Schema version of the path; default `v1`.")


class ResourceFieldSelector(_SpecModel):
    """A resource request or limit of the worker container (downward API), e.g. `limits.memory`."""

    resource: str = Field(min_length=1, max_length=128, description="e.g. `requests.cpu`, `limits.memory`.")
    container_name: str | None = Field(None, max_length=63, description="Container; default the worker.")
    divisor: Quantity | None = Field(None, description="Unit the value is divided by, e.g. `1Mi`.")


ENV_SOURCE_FIELDS = ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")


class EnvVarSource(_SpecModel):
    """Where a variable's value comes from: exactly one of a Secret key, a ConfigMap key, a pod field or a
    resource of the worker container. Secrets and ConfigMaps are those of the deployment's namespace."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": _one_of(ENV_SOURCE_FIELDS, "value source")}
    )

    secret_key_ref: KeySelector | None = Field(None, description="A key of a Secret of the namespace.")
    config_map_key_ref: KeySelector | None = Field(None, description="A key of a ConfigMap of the namespace.")
    field_ref: ObjectFieldSelector | None = Field(None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(None, description="A resource of the worker.")


class EnvVar(_SpecModel):
    """An environment variable of the worker container: a literal `value` or a `valueFrom` source, not both."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel("!(has(self.value) && has(self.valueFrom))", "set either value or valueFrom, not both")
            ]
        }
    )

    name: str = Field(min_length=1, max_length=256, pattern=ENV_NAME_PATTERN, description="Variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: EnvVarSource | None = Field(
        None, description="Value from a Secret or ConfigMap key, a pod field or a container resource."
    )


class TolerationOperator(StrEnum):
    """How a toleration matches a taint's value."""

    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    """Taint effect a toleration matches."""

    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(_SpecModel):
    """A Kubernetes toleration."""

    key: str | None = Field(None, max_length=317, description="Taint key; empty with `Exists` matches all.")
    operator: TolerationOperator | None = Field(None, strict=False, description="`Exists` or `Equal` (default).")
    value: str | None = Field(None, max_length=63, description="Taint value for `Equal`.")
    effect: TaintEffect | None = Field(None, strict=False, description="Effect matched; empty matches all.")
    toleration_seconds: int | None = Field(None, ge=0, description="How long a NoExecute taint is tolerated.")


class PullPolicy(StrEnum):
    """When the kubelet pulls the image."""

    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


FileMode = Annotated[int, Field(ge=0, le=0o777, description="File mode bits (0-0777, e.g. 0440 = 288).")]


class KeyToPath(_SpecModel):
    """A key of a ConfigMap or Secret projected to a file of the volume."""

    key: str = Field(min_length=1, max_length=253, pattern=CONFIG_KEY_PATTERN, description="The key.")
    path: str = Field(min_length=1, max_length=4096, description="Relative file path in the volume.")
    mode: FileMode | None = None


class PersistentVolumeClaimSource(_SpecModel):
    """A PersistentVolumeClaim of the deployment's namespace."""

    claim_name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the claim.")
    read_only: bool | None = Field(None, description="Mount read-only.")


class ConfigMapVolumeSource(_SpecModel):
    """A ConfigMap of the deployment's namespace as files."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the ConfigMap.")
    items: list[KeyToPath] | None = Field(None, max_length=256, description="Keys to project; unset = all.")
    default_mode: FileMode | None = None
    optional: bool | None = Field(None, description="Whether a missing ConfigMap is allowed.")


class SecretVolumeSource(_SpecModel):
    """A Secret of the deployment's namespace as files."""

    secret_name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the Secret.")
    items: list[KeyToPath] | None = Field(None, max_length=256, description="Keys to project; unset = all.")
    default_mode: FileMode | None = None
    optional: bool | None = Field(None, description="Whether a missing Secret is allowed.")


class StorageMedium(StrEnum):
    """Backing of an emptyDir: the node's disk (empty string) or memory (tmpfs, counted in the pod's memory)."""

    DEFAULT = ""
    MEMORY = "Memory"


class EmptyDirSource(_SpecModel):
    """A scratch directory that lives as long as the pod."""

    medium: StorageMedium | None = Field(None, strict=False, description="`\"\"` (node disk) or `Memory`.")
    size_limit: Quantity | None = Field(None, description="Most space used, e.g. `10Gi`.")


class DownwardAPIFile(_SpecModel):
    """A pod field or container resource written to a file."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": _one_of(("fieldRef", "resourceFieldRef"), "file source")}
    )

    path: str = Field(min_length=1, max_length=4096, description="Relative file path in the volume.")
    field_ref: ObjectFieldSelector | None = Field(None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(None, description="A resource of a container.")
    mode: FileMode | None = None


class DownwardAPIProjection(_SpecModel):
    """Pod fields as files."""

    items: list[DownwardAPIFile] = Field(max_length=64, description="Files to write.")


class ConfigMapProjection(_SpecModel):
    """A ConfigMap of the namespace, projected."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the ConfigMap.")
    items: list[KeyToPath] | None = Field(None, max_length=256, description="Keys to project; unset = all.")
    optional: bool | None = Field(None, description="Whether a missing ConfigMap is allowed.")


class SecretProjection(_SpecModel):
    """A Secret of the namespace, projected."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the Secret.")
    items: list[KeyToPath] | None = Field(None, max_length=256, description="Keys to project; unset = all.")
    optional: bool | None = Field(None, description="Whether a missing Secret is allowed.")


PROJECTION_FIELDS = ("configMap", "secret", "downwardAPI")


class VolumeProjection(_SpecModel):
    """One source of a projected volume: a ConfigMap, a Secret or pod fields (never a service account token)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _one_of(PROJECTION_FIELDS, "projection")})

    config_map: ConfigMapProjection | None = Field(None, description="A ConfigMap of the namespace.")
    secret: SecretProjection | None = Field(None, description="A Secret of the namespace.")
    downward_api: DownwardAPIProjection | None = Field(None, alias="downwardAPI", description="Pod fields.")


class ProjectedSource(_SpecModel):
    """Several ConfigMaps, Secrets and pod fields in one directory."""

    sources: list[VolumeProjection] = Field(min_length=1, max_length=16, description="What to project.")
    default_mode: FileMode | None = None


VOLUME_SOURCE_FIELDS = ("persistentVolumeClaim", "configMap", "secret", "emptyDir", "projected")


class Volume(_SpecModel):
    """A volume of the worker pod, of a type that reaches only the deployment's own namespace or the pod itself:
    persistentVolumeClaim, configMap, secret, emptyDir or projected (configMap, secret, downwardAPI). Never
    hostPath or another node-level or cluster-level source."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                *_one_of(VOLUME_SOURCE_FIELDS, "volume source"),
                _cel(
                    "!(self.name in [" + ", ".join(f"'{name}'" for name in OPERATOR_VOLUME_NAMES) + "])",
                    f"volume names {', '.join(OPERATOR_VOLUME_NAMES)} are the operator's: choose another name",
                ),
            ]
        }
    )

    name: str = Field(max_length=63, pattern=DNS_LABEL_PATTERN, description="Volume name (DNS label).")
    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(
        None, description="A PersistentVolumeClaim of the namespace."
    )
    config_map: ConfigMapVolumeSource | None = Field(None, description="A ConfigMap of the namespace.")
    secret: SecretVolumeSource | None = Field(None, description="A Secret of the namespace.")
    empty_dir: EmptyDirSource | None = Field(None, description="Scratch space for the pod's lifetime.")
    projected: ProjectedSource | None = Field(None, description="ConfigMaps, Secrets and pod fields together.")


class LocalObjectReference(_SpecModel):
    """An object of the deployment's namespace, by name."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Its name.")


class DnsPolicy(StrEnum):
    """How the pod resolves names (`ClusterFirstWithHostNet` is left out: worker pods never use the host network)."""

    CLUSTER_FIRST = "ClusterFirst"
    DEFAULT = "Default"
    NONE = "None"


class DnsOption(_SpecModel):
    """A resolver option."""

    name: str = Field(min_length=1, max_length=64, description="Option name, e.g. `ndots`.")
    value: str | None = Field(None, max_length=64, description="Option value.")


class DnsConfig(_SpecModel):
    """Resolver settings merged with those of `dnsPolicy`."""

    nameservers: list[str] | None = Field(None, max_length=3, description="Name server IP addresses.")
    searches: list[Annotated[str, StringConstraints(max_length=253)]] | None = Field(
        None, max_length=32, description="Search domains."
    )
    options: list[DnsOption] | None = Field(None, max_length=16, description="Resolver options.")


POD_EXTRAS_DESCRIPTION = (
    "Extra pod fields, from an allow-list: affinity, topologySpreadConstraints, runtimeClassName, "
    "schedulerName, imagePullSecrets, dnsPolicy, dnsConfig, volumes (persistentVolumeClaim, configMap, secret, "
    "emptyDir, projected). Anything else (hostNetwork/PID/IPC, nodeName, hostPath, initContainers, "
    "securityContext, ...) is refused: whoever may create an InferenceDeployment gets pods of this shape only."
)


class PodExtras(_SpecModel):
    """The pod fields a model server legitimately needs beyond the template's own, and nothing that widens what
    the pod may do on its node or in the cluster (see docs/cr-authors.md)."""

    affinity: FreeForm | None = Field(
        None, description="Node, pod and anti-affinity (a Kubernetes `Affinity`): scheduling only."
    )
    topology_spread_constraints: list[FreeForm] | None = Field(
        None, max_length=16, description="Spread of the pods over zones or nodes (Kubernetes' constraints)."
    )
    runtime_class_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="RuntimeClass, e.g. `nvidia`."
    )
    scheduler_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Scheduler; unset = the default one."
    )
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        None, max_length=16, description="Secrets of the namespace to pull the worker image with."
    )
    dns_policy: DnsPolicy | None = Field(None, strict=False, description="ClusterFirst, Default or None.")
    dns_config: DnsConfig | None = Field(None, description="Resolver settings.")
    volumes: list[Volume] | None = Field(
        None,
        max_length=32,
        description="Extra volumes (persistentVolumeClaim, configMap, secret, emptyDir, projected), mounted with "
        "spec.template.volumeMounts.",
        json_schema_extra=_list_map("name"),
    )


class VolumeMount(_SpecModel):
    """A volume of `spec.template.podSpec.volumes` mounted into the worker container."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!(" + " || ".join(f"self.mountPath == '{p}' || self.mountPath.startsWith('{p}/')"
                                       for p in OPERATOR_MOUNT_PATHS) + ")",
                    f"mount paths {', '.join(OPERATOR_MOUNT_PATHS)} and below are the operator's: choose another",
                ),
                _cel(
                    "!has(self.subPath) || (!self.subPath.startsWith('/') && !self.subPath.contains('..'))",
                    "subPath must be a relative path without '..'",
                ),
            ]
        }
    )

    name: str = Field(max_length=63, pattern=DNS_LABEL_PATTERN, description="Name of a volume of podSpec.volumes.")
    mount_path: str = Field(
        min_length=2, max_length=1024, pattern=r"^/[^:]*$", description="Absolute path in the container."
    )
    read_only: bool | None = Field(None, description="Mount read-only.")
    sub_path: str | None = Field(None, min_length=1, max_length=1024, description="Path inside the volume.")


_KEY_RULES: list[JsonValue] = [
    _cel(
        f"self.all(k, !k.startsWith('{OPERATOR_KEY_PREFIX}'))",
        f"keys under {OPERATOR_KEY_PREFIX} are set by the operator: remove them",
    )
]
_ANNOTATION_RULES: list[JsonValue] = [
    *_KEY_RULES,
    _cel(
        "self.all(k, " + " && ".join(f"!k.startsWith('{p}')" for p in CONFINEMENT_ANNOTATION_PREFIXES) + ")",
        "AppArmor and seccomp annotations are not allowed: worker pods keep the operator's security context",
    ),
]


class PodTemplate(_SpecModel):
    """What the worker pods look like beyond the engine: image, env, placement, extra pod fields."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.podSpec) && "
                    "has(self.podSpec.volumes) && self.podSpec.volumes.exists(v, v.name == m.name))",
                    "every volumeMounts[].name must name a volume of podSpec.volumes",
                )
            ]
        }
    )

    image: str | None = Field(None, min_length=1, max_length=512, description="Worker image; unset = operator default.")
    image_pull_policy: PullPolicy | None = Field(None, strict=False, description="Always, IfNotPresent or Never.")
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Extra environment.", json_schema_extra=_list_map("name")
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description=f"Extra pod labels (keys under {OPERATOR_KEY_PREFIX} are the operator's).",
        json_schema_extra={"x-kubernetes-validations": _KEY_RULES},
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description=f"Extra pod annotations (not under {OPERATOR_KEY_PREFIX}; no AppArmor or seccomp annotations).",
        json_schema_extra={"x-kubernetes-validations": _ANNOTATION_RULES},
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod node selector.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Pod tolerations.")
    service_account_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS_LABEL_PATTERN,
        description="Service account the pods run as (any of the namespace, as for a pod author); its token is "
        "never mounted.",
    )
    priority_class_name: str | None = Field(None, max_length=253, description="Priority class of the pods.")
    volume_mounts: list[VolumeMount] | None = Field(
        None,
        max_length=32,
        description="Volumes of podSpec.volumes mounted into the worker container.",
        json_schema_extra=_list_map("mountPath"),
    )
    pod_spec: PodExtras = Field(default_factory=PodExtras, description=POD_EXTRAS_DESCRIPTION)


class InferenceDeploymentSpec(_SpecModel):
    """Desired state of an InferenceDeployment: a model served by one or more variants of worker pods."""

    model: ModelSpec = Field(description="The served model and its weights.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Inference engine and its knobs.")
    variants: list[VariantSpec] = Field(
        min_length=1,
        max_length=16,
        description="Variants serving the model; at least one, names unique.",
        json_schema_extra=_list_map("name"),
    )
    replicas: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Pods shared, by weight, by the variants that set neither `replicas` nor `autoscaling`; unset "
        "means one pod each. Written by `kubectl scale` (the scale subresource).",
    )
    rollout: RolloutSpec | None = Field(None, description="Canary rollout of spec changes; unset = direct replace.")
    drain: DrainSpec = Field(default_factory=DrainSpec, description="Draining of pods that go away.")
    template: PodTemplate = Field(default_factory=PodTemplate, description="Worker pod template.")


# --------------------------------------------------------------------------------------------------------- status


class Phase(StrEnum):
    """Summary of the deployment's state (the `Phase` printer column)."""

    PENDING = "Pending"
    PROGRESSING = "Progressing"
    AVAILABLE = "Available"
    DEGRADED = "Degraded"
    INVALID_SPEC = "InvalidSpec"
    SCALED_TO_ZERO = "ScaledToZero"
    TERMINATING = "Terminating"


class ConditionType(StrEnum):
    """Condition types the operator sets."""

    AVAILABLE = "Available"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    INVALID_SPEC = "InvalidSpec"
    READY = "Ready"  # kstatus: the spec's revision serves all its replicas and nothing is pending
    RECONCILING = "Reconciling"  # kstatus, abnormal-true: a rollout, drain or scale is under way
    STALLED = "Stalled"  # kstatus, abnormal-true: no progress without a fix (invalid spec, rollback, stuck pods)


class ConditionStatus(StrEnum):
    """Status of a condition."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_StatusModel):
    """A Kubernetes-style condition."""

    type: str = Field(
        min_length=1,
        max_length=316,
        description="Condition type: " + ", ".join(f"`{t.value}`" for t in ConditionType) + ".",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field("", max_length=1024, description="CamelCase reason of the last transition.")
    message: str = Field("", max_length=32_768, description="Human-readable details.")
    last_transition_time: AwareDatetime = Field(description="When the status last changed.")
    observed_generation: int | None = Field(None, ge=0, description="Generation the condition was computed from.")


class RevisionReplicas(_StatusModel):
    """Pods of one revision of a variant."""

    revision: str = Field(description="Revision hash of the pod-relevant spec.")
    replicas: int = Field(0, ge=0, description="Pods of this revision (not counting draining ones).")
    ready_replicas: int = Field(0, ge=0, description="Ready pods of this revision.")
    desired_replicas: int = Field(0, ge=0, description="Pods this revision should have.")


class VariantStatus(_StatusModel):
    """Observed size of one variant."""

    name: str = Field(description="Variant name.")
    replicas: int = Field(0, ge=0, description="Pods of the variant (not counting draining ones).")
    ready_replicas: int = Field(0, ge=0, description="Ready pods.")
    desired_replicas: int = Field(
        0, ge=0, description="Pods wanted (fixed size, share of spec.replicas, or the autoscaler's choice)."
    )
    draining_replicas: int = Field(0, ge=0, description="Pods being drained.")
    revisions: list[RevisionReplicas] = Field(
        default_factory=list,
        max_length=8,
        description="Pods per revision (stable and canary during a rollout).",
        json_schema_extra=_list_map("revision"),
    )


class RolloutPhase(StrEnum):
    """Where a canary rollout stands."""

    STABLE = "Stable"
    PROGRESSING = "Progressing"
    PROMOTING = "Promoting"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"


class Verdict(StrEnum):
    """Outcome of one analysis check."""

    PASS = "Pass"
    FAIL = "Fail"
    INCONCLUSIVE = "Inconclusive"


class AnalysisResult(_StatusModel):
    """One canary analysis check: the measured values and the verdict."""

    time: AwareDatetime = Field(description="When the check ran.")
    step: int = Field(ge=0, description="Step index during the check.")
    verdict: Verdict = Field(description="Pass, Fail or Inconclusive (missing data is never a pass).")
    ttft_p95_ratio: float | None = Field(None, ge=0, description="Canary / stable TTFT p95.")
    itl_p95_ratio: float | None = Field(None, ge=0, description="Canary / stable inter-token latency p95.")
    error_rate: float | None = Field(None, ge=0, le=1, description="Canary error rate.")
    quality_agreement: float | None = Field(None, ge=0, le=1, description="Greedy token agreement with stable.")
    canary_requests: int | None = Field(None, ge=0, description="Canary requests seen in the interval.")
    message: str = Field("", max_length=4096, description="Why this verdict.")


class RolloutStatus(_StatusModel):
    """Revisions and canary progress. All durable rollout state: an operator restart resumes from here."""

    phase: RolloutPhase = Field(
        RolloutPhase.STABLE, description="Stable, Progressing, Promoting, RollingBack or RolledBack."
    )
    stable_revision: str | None = Field(None, description="Revision hash serving as stable.")
    canary_revision: str | None = Field(None, description="Revision hash under test, if any.")
    rejected_revision: str | None = Field(
        None, description="Revision last rolled back; not tried again until the spec changes."
    )
    step: int = Field(0, ge=0, description="Index of the current canary step.")
    canary_weight: int = Field(0, ge=0, le=100, description="Percent of traffic on the canary now.")
    started_at: AwareDatetime | None = Field(None, description="When the rollout began.")
    step_started_at: AwareDatetime | None = Field(None, description="When the current step began.")
    canary_metrics_since: AwareDatetime | None = Field(
        None,
        description="When the running canary's metrics series first appeared: its analysis clock starts then "
        "(unset while the operator waits for them; no check runs on no data).",
    )
    consecutive_failures: int = Field(0, ge=0, description="Failed analysis checks in a row.")
    analysis: list[AnalysisResult] = Field(
        default_factory=list, max_length=20, description="Latest analysis checks, oldest first (bounded)."
    )
    reason: str = Field("", max_length=1024, description="CamelCase reason of the last phase change.")
    message: str = Field("", max_length=32_768, description="Why the rollout is where it is.")
    stable_spec: FreeForm | None = Field(
        None,
        description="Snapshot of the stable revision's pod-relevant spec, so its pods can be recreated while a "
        "canary runs.",
    )


class MetricInputs(_StatusModel):
    """Signal values a scaling decision was computed from (unset = not available)."""

    queue_depth_per_replica: float | None = Field(None, ge=0, description="Mean waiting requests per ready pod.")
    kv_cache_utilization: float | None = Field(None, ge=0, description="Mean KV-cache usage fraction.")
    ttft_p95_seconds: float | None = Field(None, ge=0, description="TTFT p95, seconds.")
    gateway_queued: int | None = Field(None, ge=0, description="Requests held at the gateway while at zero.")


class DecisionTrigger(StrEnum):
    """What caused a scaling decision."""

    TIMER = "Timer"
    ALERT = "Alert"
    WAKE = "Wake"


class ScaleDecision(_StatusModel):
    """One autoscaling decision, kept so `kubectl describe` explains the fleet's size."""

    time: AwareDatetime = Field(description="When it was decided.")
    trigger: DecisionTrigger = Field(DecisionTrigger.TIMER, description="Timer, Alert or Wake.")
    current_replicas: int = Field(ge=0, description="Pods before the decision.")
    ready_replicas: int = Field(0, ge=0, description="Ready pods before the decision.")
    starting_replicas: int = Field(0, ge=0, description="Pods starting (counted as capacity on its way).")
    desired_replicas: int = Field(ge=0, description="Pods decided.")
    inputs: MetricInputs = Field(default_factory=MetricInputs, description="Signal values used.")
    reason: str = Field("", max_length=4096, description="Why this size.")


class Recommendation(_StatusModel):
    """A recommendation inside the scale-down stabilisation window."""

    time: AwareDatetime = Field(description="When it was recommended.")
    replicas: int = Field(ge=0, description="Recommended pods.")


class AlertIntent(_StatusModel):
    """A bounded scale-up floor requested by an Alertmanager alert; it expires."""

    alert: str = Field(min_length=1, max_length=256, description="Alert name.")
    fingerprint: str | None = Field(None, max_length=256, description="Alertmanager fingerprint.")
    replicas: int = Field(ge=0, description="Pods to keep at least while the intent lives.")
    received_at: AwareDatetime = Field(description="When the alert arrived.")
    expires_at: AwareDatetime = Field(description="When the intent lapses.")
    reason: str = Field("", max_length=4096, description="Summary from the alert.")


class VariantAutoscalingStatus(_StatusModel):
    """Durable autoscaler state of one variant (restarts keep windows and intents)."""

    name: str = Field(description="Variant name.")
    desired_replicas: int | None = Field(None, ge=0, description="Latest size the autoscaler chose.")
    last_scale_time: AwareDatetime | None = Field(None, description="When the size last changed.")
    idle_since: AwareDatetime | None = Field(None, description="Since when no requests arrived (scale to zero).")
    last_decisions: list[ScaleDecision] = Field(
        default_factory=list, max_length=10, description="Latest decisions, oldest first (bounded)."
    )
    recommendations: list[Recommendation] = Field(
        default_factory=list,
        max_length=1024,
        description="Scale-down stabilisation window, oldest first; a record can be dropped once a later one "
        "is at least as high.",
    )
    alert_intents: list[AlertIntent] = Field(
        default_factory=list, max_length=16, description="Live alert-driven scale-up intents."
    )


class AutoscalingStatus(_StatusModel):
    """Autoscaler state per variant."""

    variants: list[VariantAutoscalingStatus] = Field(
        default_factory=list,
        max_length=16,
        description="One entry per autoscaled variant.",
        json_schema_extra=_list_map("name"),
    )


class DrainReason(StrEnum):
    """Why a pod is drained."""

    SCALE_DOWN = "ScaleDown"
    ROLLOUT = "Rollout"
    REPLACE = "Replace"
    DELETION = "Deletion"


class DrainStatus(_StatusModel):
    """A drain in progress (resumed after an operator restart)."""

    pod: str = Field(min_length=1, max_length=253, description="Pod being drained.")
    variant: str | None = Field(None, description="Its variant.")
    revision: str | None = Field(None, description="Its revision.")
    reason: DrainReason = Field(DrainReason.SCALE_DOWN, description="ScaleDown, Rollout, Replace or Deletion.")
    started_at: AwareDatetime = Field(description="When draining began.")
    deadline: AwareDatetime = Field(description="When the pod is deleted even with requests in flight.")
    in_flight: int | None = Field(None, ge=0, description="Requests in flight at the last poll.")


class Endpoint(_StatusModel):
    """A routing group for the gateway: the pods of one (revision, variant) and their traffic weight."""

    variant: str = Field(description="Variant name (label `llmfleet.io/variant`).")
    revision: str = Field(description="Revision hash (label `llmfleet.io/revision`).")
    weight: int = Field(0, ge=0, description="Relative share of untiered requests (share = weight / sum).")
    tiers: list[str] = Field(default_factory=list, description="Request tiers served first.")
    quantization: Quantization = Field(Quantization.NONE, description="Quantization of these pods.")
    canary: bool = Field(False, description="Whether this is the canary revision.")


class InferenceDeploymentStatus(_StatusModel):
    """Observed state, written only by the operator. Autoscaled sizes live here, so GitOps never fights them."""

    observed_generation: int | None = Field(None, ge=0, description="Generation last reconciled.")
    phase: Phase = Field(Phase.PENDING, description="Summary state.")
    replicas: int = Field(0, ge=0, description="All pods (not counting draining ones); the scale subresource's count.")
    ready_replicas: int = Field(0, ge=0, description="Ready pods.")
    desired_replicas: int = Field(0, ge=0, description="Pods wanted over all variants.")
    label_selector: str | None = Field(None, description="Selector of the pods (for the scale subresource).")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Available, Progressing, Degraded, InvalidSpec.",
        json_schema_extra=_list_map("type"),
    )
    variants: list[VariantStatus] = Field(
        default_factory=list, max_length=16, description="Per-variant sizes.", json_schema_extra=_list_map("name")
    )
    rollout: RolloutStatus = Field(default_factory=RolloutStatus, description="Revisions and canary progress.")
    autoscaling: AutoscalingStatus = Field(default_factory=AutoscalingStatus, description="Autoscaler state.")
    drains: list[DrainStatus] = Field(
        default_factory=list, max_length=256, description="Drains in progress.", json_schema_extra=_list_map("pod")
    )
    endpoints: list[Endpoint] = Field(
        default_factory=list, max_length=64, description="Routing groups and weights for the gateway."
    )
    last_valid_spec: FreeForm | None = Field(
        None,
        description="The last spec that passed validation. While a later edit is invalid (see the InvalidSpec "
        "condition), the fleet keeps running this one: failed pods are replaced, autoscaling and rollouts go on.",
    )


class InferenceDeployment(BaseModel):
    """A whole InferenceDeployment object as the API returns it (metadata kept as a plain mapping)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    api_version: str = Field(API_VERSION, description="`llmfleet.io/v1alpha1`.")
    kind: str = Field(KIND, description="`InferenceDeployment`.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus = Field(default_factory=InferenceDeploymentStatus)
