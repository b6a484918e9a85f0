"""The pod template of an InferenceDeployment, as an allow-list: a CR author gets worker pods of this shape only.

Every field accepted is declared (`PodExtras`, `Volume`, `EnvVarSource`, ...), so the CRD schema has no free-form
pod fields (docs/cr-authors.md). What a structural schema cannot say ("exactly one volume source", operator-owned
names, keys and mount paths) is written as CEL `x-kubernetes-validations` (`cel`), which a real API server enforces
at apply time; `crds/validate.py` checks the same rules in Python, because localkube and older API servers run no
CEL.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field, StringConstraints
from pydantic.json_schema import JsonValue

from crds.base import (
    CONFIG_KEY_PATTERN,
    CONFINEMENT_ANNOTATION_PREFIXES,
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    ENV_NAME_PATTERN,
    OPERATOR_KEY_PREFIX,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUME_NAMES,
    FreeForm,
    Quantity,
    SpecModel,
    cel,
    list_map,
    one_of,
)


class KeySelector(SpecModel):
    """A key of a Secret or ConfigMap in the deployment's own namespace (Kubernetes never looks elsewhere)."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the Secret or ConfigMap.")
    key: str = Field(min_length=1, max_length=253, pattern=CONFIG_KEY_PATTERN, description="The key to select.")
    optional: bool | None = Field(None, description="Whether a missing object or key is allowed.")


class ObjectFieldSelector(SpecModel):
    """A field of the pod (downward API), e.g. `metadata.name`, `status.podIP`, `metadata.labels['app']`."""

    field_path: str = Field(min_length=1, max_length=256, description="Path of the field, e.g. `status.hostIP`.")
    api_version: str | None = Field(None, max_length=64, description="Schema version of the path; default `v1`.")


class ResourceFieldSelector(SpecModel):
    """A resource request or limit of the worker container (downward API), e.g. `limits.memory`."""

    resource: str = Field(min_length=1, max_length=128, description="e.g. `requests.cpu`, `limits.memory`.")
    container_name: str | None = Field(None, max_length=63, description="Container; default the worker.")
    divisor: Quantity | None = Field(None, description="Unit the value is divided by, e.g. `1Mi`.")


ENV_SOURCE_FIELDS = ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")


class EnvVarSource(SpecModel):
    """Where a variable's value comes from: exactly one of a Secret key, a ConfigMap key, a pod field or a
    resource of the worker container. Secrets and ConfigMaps are those of the deployment's namespace."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": one_of(ENV_SOURCE_FIELDS, "value source")})

    secret_key_ref: KeySelector | None = Field(None, description="A key of a Secret of the namespace.")
    config_map_key_ref: KeySelector | None = Field(None, description="A key of a ConfigMap of the namespace.")
    field_ref: ObjectFieldSelector | None = Field(None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(None, description="A resource of the worker.")


class EnvVar(SpecModel):
    """An environment variable of the worker container: a literal `value` or a `valueFrom` source, not both."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!(has(self.value) && has(self.valueFrom))", "set either value or valueFrom, not both")
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


class Toleration(SpecModel):
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


class KeyToPath(SpecModel):
    """A key of a ConfigMap or Secret projected to a file of the volume."""

    key: str = Field(min_length=1, max_length=253, pattern=CONFIG_KEY_PATTERN, description="The key.")
    path: str = Field(min_length=1, max_length=4096, description="Relative file path in the volume.")
    mode: FileMode | None = None


class PersistentVolumeClaimSource(SpecModel):
    """A PersistentVolumeClaim of the deployment's namespace."""

    claim_name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the claim.")
    read_only: bool | None = Field(None, description="Mount read-only.")


class ConfigMapVolumeSource(SpecModel):
    """A ConfigMap of the deployment's namespace as files."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the ConfigMap.")
    items: list[KeyToPath] | None = Field(None, max_length=256, description="Keys to project; unset = all.")
    default_mode: FileMode | None = None
    optional: bool | None = Field(None, description="Whether a missing ConfigMap is allowed.")


class SecretVolumeSource(SpecModel):
    """A Secret of the deployment's namespace as files."""

    secret_name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the Secret.")
    items: list[KeyToPath] | None = Field(None, max_length=256, description="Keys to project; unset = all.")
    default_mode: FileMode | None = None
    optional: bool | None = Field(None, description="Whether a missing Secret is allowed.")


class StorageMedium(StrEnum):
    """Backing of an emptyDir: the node's disk (empty string) or memory (tmpfs, counted in the pod's memory)."""

    DEFAULT = ""
    MEMORY = "Memory"


class EmptyDirSource(SpecModel):
    """A scratch directory that lives as long as the pod."""

    medium: StorageMedium | None = Field(None, strict=False, description='`""` (node disk) or `Memory`.')
    size_limit: Quantity | None = Field(None, description="Most space used, e.g. `10Gi`.")


class DownwardAPIFile(SpecModel):
    """A pod field or container resource written to a file."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": one_of(("fieldRef", "resourceFieldRef"), "file source")}
    )

    path: str = Field(min_length=1, max_length=4096, description="Relative file path in the volume.")
    field_ref: ObjectFieldSelector | None = Field(None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(None, description="A resource of a container.")
    mode: FileMode | None = None


class DownwardAPIProjection(SpecModel):
    """Pod fields as files."""

    items: list[DownwardAPIFile] = Field(max_length=64, description="Files to write.")


class ConfigMapProjection(SpecModel):
    """A ConfigMap of the namespace, projected."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the ConfigMap.")
    items: list[KeyToPath] | None = Field(None, max_length=256, description="Keys to project; unset = all.")
    optional: bool | None = Field(None, description="Whether a missing ConfigMap is allowed.")


class SecretProjection(SpecModel):
    """A Secret of the namespace, projected."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the Secret.")
    items: list[KeyToPath] | None = Field(None, max_length=256, description="Keys to project; unset = all.")
    optional: bool | None = Field(None, description="Whether a missing Secret is allowed.")


PROJECTION_FIELDS = ("configMap", "secret", "downwardAPI")


class VolumeProjection(SpecModel):
    """One source of a projected volume: a ConfigMap, a Secret or pod fields (never a service account token)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": one_of(PROJECTION_FIELDS, "projection")})

    config_map: ConfigMapProjection | None = Field(None, description="A ConfigMap of the namespace.")
    secret: SecretProjection | None = Field(None, description="A Secret of the namespace.")
    downward_api: DownwardAPIProjection | None = Field(None, alias="downwardAPI", description="Pod fields.")


class ProjectedSource(SpecModel):
    """Several ConfigMaps, Secrets and pod fields in one directory."""

    sources: list[VolumeProjection] = Field(min_length=1, max_length=16, description="What to project.")
    default_mode: FileMode | None = None


VOLUME_SOURCE_FIELDS = ("persistentVolumeClaim", "configMap", "secret", "emptyDir", "projected")


class Volume(SpecModel):
    """A volume of the worker pod, of a type that reaches only the deployment's own namespace or the pod itself:
    persistentVolumeClaim, configMap, secret, emptyDir or projected (configMap, secret, downwardAPI). Never
    hostPath or another node-level or cluster-level source."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                *one_of(VOLUME_SOURCE_FIELDS, "volume source"),
                cel(
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


class LocalObjectReference(SpecModel):
    """An object of the deployment's namespace, by name."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Its name.")


class DnsPolicy(StrEnum):
    """How the pod resolves names (`ClusterFirstWithHostNet` is left out: worker pods never use the host network)."""

    CLUSTER_FIRST = "ClusterFirst"
    DEFAULT = "Default"
    NONE = "None"


class DnsOption(SpecModel):
    """A resolver option."""

    name: str = Field(min_length=1, max_length=64, description="Option name, e.g. `ndots`.")
    value: str | None = Field(None, max_length=64, description="Option value.")


class DnsConfig(SpecModel):
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


class PodExtras(SpecModel):
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
        json_schema_extra=list_map("name"),
    )


class VolumeMount(SpecModel):
    """A volume of `spec.template.podSpec.volumes` mounted into the worker container."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!("
                    + " || ".join(
                        f"self.mountPath == '{p}' || self.mountPath.startsWith('{p}/')" for p in OPERATOR_MOUNT_PATHS
                    )
                    + ")",
                    f"mount paths {', '.join(OPERATOR_MOUNT_PATHS)} and below are the operator's: choose another",
                ),
                cel(
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
    cel(
        f"self.all(k, !k.startsWith('{OPERATOR_KEY_PREFIX}'))",
        f"keys under {OPERATOR_KEY_PREFIX} are set by the operator: remove them",
    )
]
_ANNOTATION_RULES: list[JsonValue] = [
    *_KEY_RULES,
    cel(
        "self.all(k, " + " && ".join(f"!k.startsWith('{p}')" for p in CONFINEMENT_ANNOTATION_PREFIXES) + ")",
        "AppArmor and seccomp annotations are not allowed: worker pods keep the operator's security context",
    ),
]


class PodTemplate(SpecModel):
    """What the worker pods look like beyond the engine: image, env, placement, extra pod fields."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
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
        default_factory=list, max_length=128, description="Extra environment.", json_schema_extra=list_map("name")
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
        json_schema_extra=list_map("mountPath"),
    )
    pod_spec: PodExtras = Field(default_factory=PodExtras, description=POD_EXTRAS_DESCRIPTION)
