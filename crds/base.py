"""The ground the InferenceDeployment models stand on: the API's identity, value patterns, names the operator
keeps for itself, shared value types, the spec and status base classes and the CEL helpers.

Everything here is shared by `crds.spec`, `crds.podtemplate` and `crds.status`; `crds.models` re-exports it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    StringConstraints,
    WithJsonSchema,
)
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
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
ADAPTER_SOURCE_PATTERN = r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+(@[^\s]+)?|file:///[^\s]*|/[^\s]*)$"
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


def list_map(*keys: str) -> dict[str, Any]:
    """Schema extras that make a list a map keyed by `keys` (server-side apply merges entries, keys must be unique)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


class SpecModel(BaseModel):
    """Base of spec models: camelCase on the wire, unknown fields are errors, types strict (no "3" for 3) exactly
    like the API server's schema; enum fields opt out (`strict=False`) so that they accept their string values."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)


class StatusModel(BaseModel):
    """Base of status models: camelCase on the wire, unknown fields ignored."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


def cel(rule: str, message: str) -> JsonDict:
    """One CEL rule of `x-kubernetes-validations`: what the API server checks at apply time that the schema cannot
    say. `crds/validate.py` checks the same in Python, so the operator refuses what an API server without the rule
    (or localkube, which runs no CEL) let through."""
    return {"rule": rule, "message": message}


def one_of(fields: tuple[str, ...], what: str) -> list[JsonValue]:
    """The CEL rule of an object that must set exactly one of `fields` (wire names)."""
    count = " + ".join(f"(has(self.{name}) ? 1 : 0)" for name in fields)
    return [cel(f"{count} == 1", f"set exactly one {what}: {', '.join(fields)}")]
