"""Revision ids: a short hash of what a human chose for a variant's pods, so only deliberate changes roll pods.

Why: a pod's revision decides whether it is replaced. Were it the hash of the pod as the operator renders it, any
change in how a new operator version renders pods (a new flag, env var or probe setting) would roll every worker
pod of every deployment on an operator upgrade: for a GPU fleet a fleet-wide cold start and lost KV caches. So
the revision of a (deployment, variant) hashes the intent instead (`pod_intent`):
- the CR fields that reach pods: `model`, `engine`, `drain`, `template` and the variant's own pod fields (`name`,
  `quantization`, `source`, `resources`, `extraArgs`), dumped without default values, so a field a newer CRD adds
  with a default changes no revision. Fields that never reach a pod (weights, tiers, replica counts, autoscaling,
  rollout steps, LoRA adapters: loaded into running pods by `controllers.adapters`; `NON_POD_FIELDS`, `NON_POD_VARIANT_FIELDS`) cannot change the revision;
- the operator settings that decide which server runs and how it is reached (`worker_identity`): the worker
  image (the CR's, else the operator's default: a new default worker image is a deliberate upgrade of the
  software that serves, so it rolls, drained and canaried like any change), the worker command and extra
  arguments, the port the operator and the gateway dial;
- `RENDER_VERSION`, which the project bumps only when a rendering change must reach running pods (a fix they
  cannot run without), and the operator's `render_epoch` setting, which an administrator raises to push the
  current rendering (e.g. new `extra_env`) to every pod.
Everything else the operator renders (security context, probes, HOME/cache env, volumes, `extra_env`) reaches new
pods only: running pods of an unchanged spec keep serving across an operator upgrade. Pods are still built by
`controllers.pods.pod_template`; only the label that says which revision they are comes from here.

The hash is canonical JSON (sorted keys) through SHA-256, cut to 10 hex digits: a valid label value, stable across
processes, restarts and operator versions. May import crds and controllers.pods only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from controllers.pods import PodDefaults
from crds.models import InferenceDeploymentSpec, VariantSpec

REVISION_LENGTH = 10
# Bump only when a change in how pods are rendered must reach pods that already run (it rolls every worker pod of
# every deployment, drained, on the operator's upgrade); say so in the release notes. See docs/rollouts.md.
RENDER_VERSION = 1
# Spec fields (JSON names) that never reach a pod; `variants` is hashed one variant at a time.
NON_POD_FIELDS = ("replicas", "rollout", "adapters")
NON_POD_VARIANT_FIELDS = ("weight", "tiers", "replicas", "autoscaling")


def revision_of(data: Mapping[str, Any]) -> str:
    """The revision id of JSON-able data (10 lowercase hex digits)."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]


def worker_identity(spec: InferenceDeploymentSpec, defaults: PodDefaults) -> dict[str, Any]:
    """The operator-level choices that are part of the revision: which server runs and where it listens."""
    return {
        "image": spec.template.image or defaults.image,
        "command": list(defaults.command),
        "extraArgs": list(defaults.extra_args),
        "port": defaults.port,
    }


def pod_intent(
    deployment: str,
    spec: InferenceDeploymentSpec,
    variant: VariantSpec,
    defaults: PodDefaults,
    render_version: int | None = None,
) -> dict[str, Any]:
    """What the revision of one variant's pods is the hash of (see the module docstring)."""
    data = spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    for key in (*NON_POD_FIELDS, "variants"):
        data.pop(key, None)
    own = variant.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    data["variant"] = {key: value for key, value in own.items() if key not in NON_POD_VARIANT_FIELDS}
    data["deployment"] = deployment
    data["worker"] = worker_identity(spec, defaults)
    data["render"] = [RENDER_VERSION if render_version is None else render_version, defaults.render_epoch]
    return data


def variant_revision(
    deployment: str,
    spec: InferenceDeploymentSpec,
    variant: VariantSpec,
    defaults: PodDefaults,
    render_version: int | None = None,
) -> str:
    """The revision of a (deployment, variant): the label its pods carry."""
    return revision_of(pod_intent(deployment, spec, variant, defaults, render_version))
