"""Small pure conversions between API objects (plain dicts) and the InferenceDeployment models.

The operator and gateway receive CRs as dicts from the API server and write status back as JSON merge patches;
these helpers keep the camelCase/None/unknown-field rules in one place. `parse_quantity` reads Kubernetes
quantities (`kvCacheBytes`, resources) without importing the kubernetes client.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from crds.models import InferenceDeployment, InferenceDeploymentSpec, InferenceDeploymentStatus

_SUFFIX_FACTORS = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
# Number, then one of: a binary suffix, a decimal SI suffix, or an integer exponent (never two of them).
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$")


def parse_resource(obj: Mapping[str, Any]) -> InferenceDeployment:
    """An InferenceDeployment dict from the API -> model. Unknown status fields are ignored; a bad spec raises
    `pydantic.ValidationError` (run `crds.validate` first to report it as problems)."""
    return InferenceDeployment.model_validate(obj)


def parse_spec(spec: Mapping[str, Any]) -> InferenceDeploymentSpec:
    """A `spec` dict -> model; raises `pydantic.ValidationError` when it does not fit the schema."""
    return InferenceDeploymentSpec.model_validate(spec)


def parse_status(status: Mapping[str, Any] | None) -> InferenceDeploymentStatus:
    """A `status` dict (or None for a fresh object) -> model, ignoring fields this version does not know."""
    return InferenceDeploymentStatus.model_validate(status or {})


def dump_status(status: InferenceDeploymentStatus) -> dict[str, Any]:
    """Status model -> JSON-able camelCase dict without None values, ready for a status patch."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def dump_spec(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """Spec model -> JSON-able camelCase dict without None values (defaults included)."""
    return spec.model_dump(mode="json", by_alias=True, exclude_none=True)


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes quantity (`500m`, `2`, `64Mi`, `1e9`) -> its exact value; ValueError when malformed."""
    match = None if isinstance(value, bool) else _QUANTITY.match(str(value).strip())
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (examples: 500m, 2, 1.5Gi, 64Mi)")
    number, suffix = match.group(1), match.group(2) or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return Decimal(number + suffix)
    return Decimal(number) * _SUFFIX_FACTORS[suffix]
