"""How many pods each variant should have, and why: fixed, shared from `spec.replicas`, or autoscaled.

Three sources, per variant (DESIGN section 2):
- `variants[].replicas`: a fixed size.
- `variants[].autoscaling`: the autoscaler's choice, read from `status.autoscaling.variants[].desiredReplicas`
  (the autoscaler writes it there so GitOps never fights it over `spec`), clamped to the variant's current
  min/max. Before the autoscaler has decided, a new variant starts at `max(minReplicas, 1)`: it serves at once
  and may scale to zero later.
- otherwise the variant shares `spec.replicas` (what `kubectl scale` writes) with the other such variants in
  proportion to their weights (largest remainder, ties to the earlier variant; all weights 0 = equal shares).
  Unset `spec.replicas` means one pod per sharing variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from crds.models import AutoscalingSpec, AutoscalingStatus, InferenceDeploymentSpec


class SizeSource(StrEnum):
    """Where a variant's desired size comes from."""

    FIXED = "fixed"
    SHARED = "shared"
    AUTOSCALER = "autoscaler"
    AUTOSCALER_INITIAL = "autoscaler-initial"


@dataclass(frozen=True)
class VariantSize:
    """The desired size of one variant and its origin (for status messages and Events)."""

    variant: str
    replicas: int
    source: SizeSource

    def describe(self) -> str:
        return {
            SizeSource.FIXED: "variants[].replicas",
            SizeSource.SHARED: "spec.replicas shared by weight",
            SizeSource.AUTOSCALER: "autoscaler",
            SizeSource.AUTOSCALER_INITIAL: "autoscaler not yet decided: max(minReplicas, 1)",
        }[self.source]


def desired_sizes(spec: InferenceDeploymentSpec, autoscaling: AutoscalingStatus) -> dict[str, VariantSize]:
    """Desired pods per variant name, in spec order."""
    shared = [v for v in spec.variants if v.replicas is None and v.autoscaling is None]
    shares = split_by_weight(spec.replicas, [v.weight for v in shared]) if spec.replicas is not None else None
    decided = {entry.name: entry.desired_replicas for entry in autoscaling.variants}
    sizes: dict[str, VariantSize] = {}
    for variant in spec.variants:
        if variant.replicas is not None:
            sizes[variant.name] = VariantSize(variant.name, variant.replicas, SizeSource.FIXED)
        elif variant.autoscaling is not None:
            sizes[variant.name] = _autoscaled(variant.name, variant.autoscaling, decided.get(variant.name))
        else:
            count = 1 if shares is None else shares[shared.index(variant)]
            sizes[variant.name] = VariantSize(variant.name, count, SizeSource.SHARED)
    return sizes


def shares_spec_replicas(spec: InferenceDeploymentSpec) -> bool:
    """Whether `spec.replicas` (and so `kubectl scale`) sizes any variant."""
    return any(v.replicas is None and v.autoscaling is None for v in spec.variants)


def split_by_weight(total: int, weights: list[int]) -> list[int]:
    """Split `total` pods by `weights` with the largest-remainder method; all-zero weights split equally."""
    if not weights:
        return []
    if sum(weights) == 0:
        weights = [1] * len(weights)
    weight_sum = sum(weights)
    exact = [total * w for w in weights]  # numerators over weight_sum: exact integer arithmetic
    counts = [numerator // weight_sum for numerator in exact]
    remainders = sorted(range(len(weights)), key=lambda i: (-(exact[i] % weight_sum), i))
    for index in remainders[: total - sum(counts)]:
        counts[index] += 1
    return counts


def _autoscaled(name: str, scaling: AutoscalingSpec, decided: int | None) -> VariantSize:
    if decided is None:
        initial = min(max(scaling.min_replicas, 1), scaling.max_replicas)
        return VariantSize(name, initial, SizeSource.AUTOSCALER_INITIAL)
    clamped = min(max(decided, scaling.min_replicas), scaling.max_replicas)
    return VariantSize(name, clamped, SizeSource.AUTOSCALER)
