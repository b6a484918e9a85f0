"""Semantic validation of InferenceDeployment specs: the rules a schema cannot hold, as plain data.

`validate(spec)` never raises on bad input: it returns `Problem`s (field path, what is wrong, how to fix it).
Given a dict, it first checks the schema through the pydantic models (the same rules the API server applies)
and turns each error into a Problem; given a model, or once the dict parses, it applies the semantic rules below.
The operator reports problems as an `InvalidSpec` condition and a Warning Event; `llmfleet crd validate` prints them.

The pod template is an allow-list (docs/cr-authors.md): a field outside it (hostNetwork, nodeName, hostPath,
initContainers, securityContext, ...) gets a problem saying why it is refused and what to use instead, and the
CEL rules of the CRD (crds/models.py) are checked here again for API servers that do not run them.

Quantization support matrix (`engine.type` x `variants[].quantization`):
- builtin: none, int8, fp8, int4 -- the builtin engine quantizes weights itself at load time (weight-only).
- vllm: none, fp8 (vLLM's online `--quantization fp8`), int8 and int4 *only from a pre-quantized checkpoint* named
  in the variant's `source` (int8: compressed-tensors W8A8 / GPTQ 8-bit; int4: AWQ/GPTQ; vLLM reads the scheme from
  the checkpoint's config). vLLM has no online int8 or int4 weight quantization of our kind on CPU (bitsandbytes is
  a different format and CUDA-only), so either without a variant `source` would silently serve the unquantized
  model: refused.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from crds.models import (
    API_VERSION,
    CONFINEMENT_ANNOTATION_PREFIXES,
    ENV_SOURCE_FIELDS,
    KIND,
    OPERATOR_KEY_PREFIX,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUME_NAMES,
    PROJECTION_FIELDS,
    VLLM_LORA_RANKS,
    VOLUME_SOURCE_FIELDS,
    Engine,
    InferenceDeploymentSpec,
    PodExtras,
    Quantization,
)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where (`path`, e.g. `spec.variants[0].autoscaling`), what, and how to fix it."""

    path: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}. Fix: {self.fix}"


# Engine flags that have a typed field (use the field) or that the operator sets itself (cannot be overridden),
# keyed by normalised flag name (lowercase, no leading dashes, '-' for '_').
_RESERVED_ENGINE_ARGS: Mapping[str, str] = {
    "model": "set spec.model.source (the operator passes the model path)",
    "host": "remove it (the operator binds the server to the pod IP)",
    "port": "remove it (the operator owns the serving port)",
    "served-model-name": "set spec.model.name",
    "revision": "set spec.model.revision",
    "max-model-len": "set spec.model.maxModelLen",
    "quantization": "set spec.variants[].quantization",
    "dtype": "set spec.engine.dtype",
    "max-num-seqs": "set spec.engine.maxNumSeqs",
    "max-num-batched-tokens": "set spec.engine.maxNumBatchedTokens",
    "kv-cache-memory-bytes": "set spec.engine.kvCacheBytes",
    "kv-cache-bytes": "set spec.engine.kvCacheBytes",
    "enable-prefix-caching": "set spec.engine.enablePrefixCaching",
    "no-enable-prefix-caching": "set spec.engine.enablePrefixCaching",
    "enable-chunked-prefill": "set spec.engine.enableChunkedPrefill",
    "no-enable-chunked-prefill": "set spec.engine.enableChunkedPrefill",
    "speculative-config": "set spec.engine.speculative",
    "enable-lora": "set spec.engine.lora",
    "max-loras": "set spec.engine.lora.maxLoras",
    "max-lora-rank": "set spec.engine.lora.maxLoraRank",
    "lora-modules": "list the adapters in spec.adapters",
}

# Why a pod field is not in `template.podSpec` and what to do instead. Fields not listed here get the allow-list.
_FORBIDDEN_POD_FIELDS: Mapping[str, str] = {
    "containers": "use spec.template.image/env and the engine fields",
    "initContainers": "remove it: worker pods run the worker container only (put setup steps into the image)",
    "ephemeralContainers": "remove it: debug with `kubectl debug`, under your own RBAC",
    "nodeSelector": "use spec.template.nodeSelector",
    "tolerations": "use spec.template.tolerations",
    "terminationGracePeriodSeconds": "use spec.drain.terminationGracePeriodSeconds",
    "serviceAccountName": "use spec.template.serviceAccountName",
    "serviceAccount": "use spec.template.serviceAccountName",
    "automountServiceAccountToken": "remove it: worker pods never get a service account token mounted",
    "priorityClassName": "use spec.template.priorityClassName",
    "restartPolicy": "remove it (worker pods always restart)",
    "hostNetwork": "remove it: worker pods never share the node's network, PID or IPC namespaces",
    "hostPID": "remove it: worker pods never share the node's network, PID or IPC namespaces",
    "hostIPC": "remove it: worker pods never share the node's network, PID or IPC namespaces",
    "hostUsers": "remove it: worker pods never share the node's user namespace",
    "nodeName": "remove it (it bypasses the scheduler); pick nodes with spec.template.nodeSelector or podSpec.affinity",
    "securityContext": "remove it: the operator sets a restricted security context (non-root, no privilege "
    "escalation, all capabilities dropped, RuntimeDefault seccomp)",
    "shareProcessNamespace": "remove it: the worker container runs alone",
    "hostAliases": "remove it; use podSpec.dnsConfig",
    "hostname": "remove it (the operator names the pods)",
    "subdomain": "remove it (the operator names the pods)",
    "overhead": "remove it (the RuntimeClass sets it)",
    "enableServiceLinks": "remove it (the operator turns service links off)",
}
_ALLOWED_VOLUME_TYPES = ", ".join(VOLUME_SOURCE_FIELDS)
# Fixes for unknown fields by the (index-free) path of the object that does not have them.
_EXTRA_FIELD_FIXES: Mapping[str, tuple[str, str]] = {
    "template.podSpec.volumes[]": (
        "is not an allowed volume type",
        f"use one of {_ALLOWED_VOLUME_TYPES}; never hostPath or another node-level source",
    ),
    "template.podSpec.volumes[].projected.sources[]": (
        "is not an allowed projection",
        f"use one of {', '.join(PROJECTION_FIELDS)} (worker pods never get a service account token)",
    ),
    "template.env[].valueFrom": ("is not an allowed value source", f"use one of {', '.join(ENV_SOURCE_FIELDS)}"),
}

# Field-specific advice for schema errors, keyed by path without `spec.` and with list indices as `[]`.
_FIELD_HINTS: Mapping[str, str] = {
    "model.name": "use a served model name of letters, digits, '.', '_', '/', '-' (no ':'), e.g. `smollm2`",
    "model.source": "use bundled://NAME, hf://ORG/REPO, pvc://CLAIM/PATH or an absolute path, "
    "e.g. `bundled://smollm2-135m-instruct`",
    "variants[].source": "use hf://ORG/REPO, pvc://CLAIM/PATH, bundled://NAME or an absolute path",
    "variants[].name": "use lowercase letters, digits and '-', at most 32 characters, e.g. `fp8`",
    "variants[].tiers[]": "use lowercase letters, digits and '-', e.g. `premium`",
    "variants": "add a variant, e.g. `variants: [{name: default}]`",
    "engine.kvCacheBytes": "use a Kubernetes quantity, e.g. `64Mi` or `8Gi`",
    "variants[].resources.cpu": "use a Kubernetes quantity, e.g. `2` or `500m`",
    "variants[].resources.memory": "use a Kubernetes quantity, e.g. `2Gi`",
    "template.env[].name": "use letters, digits, '_', '-', '.' and no leading digit, e.g. `LOG_LEVEL`",
    "template.serviceAccountName": "use lowercase letters, digits and '-'",
    "adapters[].name": "use letters, digits, '.', '_', '-' (no ':' or '/'), e.g. `sql-expert`",
    "adapters[].source": "use an absolute folder path, file:///FOLDER or hf://ORG/REPO[@REVISION]",
}
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def validate(spec: InferenceDeploymentSpec | Mapping[str, Any] | None) -> list[Problem]:
    """All problems of an InferenceDeployment spec (a dict as written, or a parsed model); empty when it is valid."""
    if isinstance(spec, InferenceDeploymentSpec):
        model = spec
    elif isinstance(spec, Mapping):
        try:
            model = InferenceDeploymentSpec.model_validate(spec)
        except ValidationError as error:
            return [_problem_from_error(item) for item in error.errors()]
    else:
        return [Problem("spec", "is missing or not a mapping", "add a spec with `model` and `variants`")]
    return [problem for rule in _RULES for problem in rule(model)]


def validate_resource(obj: Mapping[str, Any]) -> list[Problem]:
    """Problems of a whole InferenceDeployment manifest: apiVersion, kind, metadata.name, then the spec."""
    problems: list[Problem] = []
    if obj.get("apiVersion") != API_VERSION:
        problems.append(Problem("apiVersion", f"is {obj.get('apiVersion')!r}", f"set `apiVersion: {API_VERSION}`"))
    if obj.get("kind") != KIND:
        problems.append(Problem("kind", f"is {obj.get('kind')!r}", f"set `kind: {KIND}`"))
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not _DNS_1035_LABEL.match(name) or len(name) > 63:
        problems.append(
            Problem(
                "metadata.name",
                f"{name!r} is not a DNS-1035 label (it names the Service and labels of the pods)",
                "use at most 63 lowercase letters, digits and '-', starting with a letter, e.g. `smollm2`",
            )
        )
    return problems + validate(obj.get("spec"))


# ---------------------------------------------------------------------------------------------- schema problems


def _path(loc: Iterable[str | int]) -> str:
    text = "spec"
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            text += f".{part}"
        else:
            text += f'["{part}"]'
    return text


def _explain(loc: Iterable[str | int]) -> str:
    """The `kubectl explain` argument for a field (it takes no list indices)."""
    return ".".join(["infd.spec", *(part for part in loc if isinstance(part, str))])


def _hint_key(loc: Iterable[str | int]) -> str:
    return ".".join("[]" if isinstance(part, int) else part for part in loc).replace(".[]", "[]")


def _known_fields(model: type[BaseModel] = InferenceDeploymentSpec) -> Iterator[str]:
    """Wire names of every field of the spec models (for 'did you mean' suggestions)."""
    for name, field in model.model_fields.items():
        yield field.alias or name
        for sub in _submodels(field.annotation):
            yield from _known_fields(sub)


def _submodels(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for argument in getattr(annotation, "__args__", ()):
        yield from _submodels(argument)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problem_from_error(error: Mapping[str, Any]) -> Problem:
    loc = tuple(error["loc"])
    kind, ctx = error["type"], error.get("ctx", {})
    field = str(loc[-1]) if loc else "spec"
    hint = _FIELD_HINTS.get(_hint_key(loc))
    message = error["msg"][0].lower() + error["msg"][1:]
    if kind not in ("missing", "extra_forbidden"):
        message += f", got {_short(error.get('input'))}"
    if kind == "missing":
        fix = hint or f"add `{field}` (see `kubectl explain {_explain(loc)}`)"
        return Problem(_path(loc), "is required but missing", fix)
    if kind == "extra_forbidden":
        return _unknown_field(loc, field)
    fixes: dict[str, Callable[[], str]] = {
        "too_short": lambda: f"give at least {ctx.get('min_length')} item(s)",
        "too_long": lambda: f"give at most {ctx.get('max_length')} item(s)",
        "string_too_short": lambda: f"use at least {ctx.get('min_length')} character(s)",
        "string_too_long": lambda: f"use at most {ctx.get('max_length')} characters",
        "greater_than_equal": lambda: f"use a value >= {ctx.get('ge')}",
        "greater_than": lambda: f"use a value > {ctx.get('gt')}",
        "less_than_equal": lambda: f"use a value <= {ctx.get('le')}",
        "less_than": lambda: f"use a value < {ctx.get('lt')}",
        "enum": lambda: f"use one of {ctx.get('expected')}",
        "literal_error": lambda: f"use one of {ctx.get('expected')}",
        "string_pattern_mismatch": lambda: f"use a value matching {ctx.get('pattern')}",
        "int_type": lambda: "use a whole number",
        "int_parsing": lambda: "use a whole number",
        "int_from_float": lambda: "use a whole number",
        "float_type": lambda: "use a number",
        "float_parsing": lambda: "use a number",
        "bool_type": lambda: "use true or false",
        "bool_parsing": lambda: "use true or false",
        "string_type": lambda: "use a string (quote it in YAML)",
        "list_type": lambda: "use a list",
        "dict_type": lambda: "use a mapping of key: value",
        "model_type": lambda: "use a mapping of key: value",
    }
    fix = hint or fixes.get(kind, lambda: f"see `kubectl explain {_explain(loc)}`")()
    return Problem(_path(loc), message, fix)


def _unknown_field(loc: tuple[str | int, ...], field: str) -> Problem:
    """A field the schema does not have: in `template.podSpec` (and the volume and env sources) that means a
    field outside the allow-list, with why and what to use instead; elsewhere a typo, with a suggestion."""
    parent = _hint_key(loc[:-1])
    if parent == "template.podSpec":
        allowed = ", ".join(f.alias or name for name, f in PodExtras.model_fields.items())
        fix = _FORBIDDEN_POD_FIELDS.get(field, f"remove it; allowed pod fields: {allowed}")
        return Problem(_path(loc), "is not an allowed pod field", fix)
    if parent in _EXTRA_FIELD_FIXES:
        message, fix = _EXTRA_FIELD_FIXES[parent]
        return Problem(_path(loc), message, fix)
    close = difflib.get_close_matches(field, sorted(set(_known_fields())), n=1)
    fix = f"rename it to `{close[0]}`" if close else "remove it"
    return Problem(_path(loc), "is not a field of InferenceDeployment", f"{fix} (field names are camelCase)")


# ----------------------------------------------------------------------------------------------- semantic rules


def _unique_names(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    counts = Counter(variant.name for variant in spec.variants)
    seen: set[str] = set()
    for index, variant in enumerate(spec.variants):
        if counts[variant.name] > 1 and variant.name in seen:
            yield Problem(
                f"spec.variants[{index}].name",
                f"variant name {variant.name!r} is used {counts[variant.name]} times",
                "give every variant its own name",
            )
        seen.add(variant.name)
    env_counts = Counter(env.name for env in spec.template.env)
    for name in sorted(name for name, count in env_counts.items() if count > 1):
        index = max(i for i, env in enumerate(spec.template.env) if env.name == name)
        yield Problem(
            f"spec.template.env[{index}].name", f"environment variable {name!r} is set more than once", "keep one entry"
        )


def _sizing(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    for index, variant in enumerate(spec.variants):
        at = f"spec.variants[{index}]"
        scaling = variant.autoscaling
        if scaling is None:
            continue
        if variant.replicas is not None:
            yield Problem(
                f"{at}.replicas",
                "a variant cannot have both a fixed `replicas` and `autoscaling`",
                f"remove {at}.replicas or {at}.autoscaling",
            )
        if scaling.min_replicas > scaling.max_replicas:
            yield Problem(
                f"{at}.autoscaling.minReplicas",
                f"minReplicas ({scaling.min_replicas}) is greater than maxReplicas ({scaling.max_replicas})",
                "make minReplicas <= maxReplicas",
            )
        targets = scaling.targets
        if (targets.queue_depth_per_replica, targets.kv_cache_utilization, targets.ttft_p95_seconds) == (None,) * 3:
            yield Problem(
                f"{at}.autoscaling.targets",
                "no autoscaling target is set, so no signal can drive the size",
                "set at least one of queueDepthPerReplica (e.g. 4), kvCacheUtilization (e.g. 0.8), ttftP95Seconds",
            )
        if scaling.scale_to_zero_after_seconds is not None and scaling.min_replicas > 0:
            yield Problem(
                f"{at}.autoscaling.scaleToZeroAfterSeconds",
                f"scale to zero is set but minReplicas is {scaling.min_replicas}",
                "set minReplicas: 0, or remove scaleToZeroAfterSeconds",
            )
        if scaling.scale_to_zero_after_seconds is None and scaling.min_replicas == 0:
            yield Problem(
                f"{at}.autoscaling.minReplicas",
                "minReplicas is 0 but scaleToZeroAfterSeconds is not set, so it is unclear when to go to zero",
                "set scaleToZeroAfterSeconds (e.g. 300), or minReplicas >= 1",
            )


def _traffic(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    if all(variant.weight == 0 for variant in spec.variants):
        yield Problem(
            "spec.variants",
            "every variant has weight 0, so requests naming no tier and no variant have nowhere to go",
            "give at least one variant a weight > 0",
        )


def _canary(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    if spec.rollout is None:
        return
    steps = spec.rollout.canary.steps
    for index in range(1, len(steps)):
        if steps[index].weight <= steps[index - 1].weight:
            yield Problem(
                f"spec.rollout.canary.steps[{index}].weight",
                f"canary weights must strictly increase, but step {index} has {steps[index].weight} after "
                f"{steps[index - 1].weight}",
                "order the steps by increasing weight and drop repeats, e.g. 10, 50, 100",
            )


# Quantizations engine vllm serves only from a pre-quantized checkpoint in the variant's `source` (see the module
# docstring), each with the checkpoint a fix should name.
_VLLM_PREQUANTIZED_ONLY: Mapping[Quantization, str] = {
    Quantization.INT8: "a compressed-tensors W8A8 / GPTQ 8-bit int8 checkpoint (e.g. hf://ORG/MODEL-W8A8)",
    Quantization.INT4: "an AWQ/GPTQ int4 checkpoint (e.g. hf://ORG/MODEL-AWQ)",
}


def _quantization(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    if spec.engine.type != Engine.VLLM:
        return
    for index, variant in enumerate(spec.variants):
        checkpoint = _VLLM_PREQUANTIZED_ONLY.get(variant.quantization)
        if checkpoint is not None and variant.source is None:
            yield Problem(
                f"spec.variants[{index}].quantization",
                f"engine vllm serves {variant.quantization.value} only from a pre-quantized checkpoint, and this "
                "variant names none",
                f"set spec.variants[{index}].source to {checkpoint}, or use quantization fp8, or engine builtin",
            )


def _engine_budget(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    engine = spec.engine
    budget = engine.max_num_batched_tokens
    if budget is None:
        return
    if budget < engine.max_num_seqs:
        yield Problem(
            "spec.engine.maxNumBatchedTokens",
            f"a step budget of {budget} tokens cannot hold maxNumSeqs ({engine.max_num_seqs}) decodes",
            f"raise maxNumBatchedTokens to at least {engine.max_num_seqs}, or lower maxNumSeqs",
        )
    max_len = spec.model.max_model_len
    if not engine.enable_chunked_prefill and max_len is not None and budget < max_len:
        yield Problem(
            "spec.engine.maxNumBatchedTokens",
            f"without chunked prefill a {max_len}-token prompt must fit one step, but the budget is {budget}",
            f"raise maxNumBatchedTokens to at least {max_len}, enable chunked prefill, or lower model.maxModelLen",
        )


def _speculative(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    speculative = spec.engine.speculative
    if speculative is not None and speculative.prompt_lookup_min > speculative.prompt_lookup_max:
        yield Problem(
            "spec.engine.speculative.promptLookupMin",
            f"promptLookupMin ({speculative.prompt_lookup_min}) is greater than promptLookupMax "
            f"({speculative.prompt_lookup_max})",
            "lower promptLookupMin or raise promptLookupMax (e.g. `promptLookupMin: 2, promptLookupMax: 4`)",
        )


def _adapters(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    """Adapters need LoRA on in the engine, and their names must say one thing in a request's `model`."""
    if spec.adapters and spec.engine.lora is None:
        yield Problem(
            "spec.adapters",
            "adapters are listed but the engine serves none (spec.engine.lora is unset)",
            "add `engine: {lora: {}}` (defaults: maxLoras 4, maxLoraRank 16); turning it on rolls the pods once, "
            "adapters added later load without restarts",
        )
    lora = spec.engine.lora
    if lora is not None and spec.engine.type == Engine.VLLM and lora.max_lora_rank not in VLLM_LORA_RANKS:
        higher = [r for r in VLLM_LORA_RANKS if r >= lora.max_lora_rank]
        yield Problem(
            "spec.engine.lora.maxLoraRank",
            f"the vllm engine takes a maxLoraRank of {', '.join(map(str, VLLM_LORA_RANKS))}, not {lora.max_lora_rank}",
            f"use {higher[0]}" if higher else "use 512 or less",
        )
    taken = {spec.model.name: "the model's name", **{v.name: f"the variant {v.name!r}" for v in spec.variants}}
    seen: set[str] = set()
    for index, adapter in enumerate(spec.adapters):
        at = f"spec.adapters[{index}].name"
        if adapter.name in seen:
            yield Problem(at, f"adapter name {adapter.name!r} is used twice", "give every adapter its own name")
        elif adapter.name in taken:
            yield Problem(
                at,
                f"adapter name {adapter.name!r} is {taken[adapter.name]} (a request's `model: "
                f"{spec.model.name}:{adapter.name}` could not say which it means)",
                "rename the adapter",
            )
        seen.add(adapter.name)


def _normalise_flag(name: str) -> str:
    return name.lstrip("-").replace("_", "-").lower()


def _engine_args(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    owners = [("spec.engine.extraArgs", spec.engine.extra_args)]
    owners += [(f"spec.variants[{i}].extraArgs", variant.extra_args) for i, variant in enumerate(spec.variants)]
    for at, args in owners:
        for key in args:
            fix = _RESERVED_ENGINE_ARGS.get(_normalise_flag(key))
            if fix is not None:
                yield Problem(f"{at}.{key}", f"engine flag {key!r} is managed by llmfleet", fix)


def _set_fields(model: BaseModel, names: Iterable[str]) -> list[str]:
    """Which of the fields `names` (wire names) of `model` are set."""
    wire = {field.alias or name: name for name, field in type(model).model_fields.items()}
    return [name for name in names if getattr(model, wire[name]) is not None]


def _exactly_one(at: str, model: BaseModel, names: tuple[str, ...], what: str) -> Iterator[Problem]:
    chosen = _set_fields(model, names)
    if len(chosen) != 1:
        got = f"sets {', '.join(chosen)}" if chosen else "sets none"
        yield Problem(at, f"a {what} needs exactly one of {', '.join(names)}, this one {got}", f"keep one {what}")


def _under(path: str, roots: Iterable[str]) -> str | None:
    return next((root for root in roots if path == root or path.startswith(root + "/")), None)


def _pod_spec(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    """The CEL rules of the pod template's volumes and mounts (see crds/models.py), for API servers and
    localkube that do not run them."""
    template = spec.template
    volumes = template.pod_spec.volumes or []
    for index, volume in enumerate(volumes):
        at = f"spec.template.podSpec.volumes[{index}]"
        yield from _exactly_one(at, volume, VOLUME_SOURCE_FIELDS, "volume source")
        if volume.name in OPERATOR_VOLUME_NAMES:
            yield Problem(
                f"{at}.name",
                f"volume name {volume.name!r} is the operator's ({', '.join(OPERATOR_VOLUME_NAMES)})",
                "choose another name",
            )
        for i, source in enumerate(volume.projected.sources if volume.projected else []):
            yield from _exactly_one(f"{at}.projected.sources[{i}]", source, PROJECTION_FIELDS, "projection")
            for j, item in enumerate(source.downward_api.items if source.downward_api else []):
                at_item = f"{at}.projected.sources[{i}].downwardAPI.items[{j}]"
                yield from _exactly_one(at_item, item, ("fieldRef", "resourceFieldRef"), "file source")
    names = {volume.name for volume in volumes}
    for index, mount in enumerate(template.volume_mounts or []):
        at = f"spec.template.volumeMounts[{index}]"
        if mount.name not in names:
            yield Problem(
                f"{at}.name",
                f"no volume {mount.name!r} in spec.template.podSpec.volumes",
                "add the volume to podSpec.volumes or mount one that is there",
            )
        root = _under(mount.mount_path, OPERATOR_MOUNT_PATHS)
        if root is not None:
            yield Problem(
                f"{at}.mountPath",
                f"{mount.mount_path!r} is at or below {root}, where the operator mounts its own volumes",
                "mount it somewhere else, e.g. /data",
            )
        if mount.sub_path is not None and (mount.sub_path.startswith("/") or ".." in mount.sub_path):
            yield Problem(f"{at}.subPath", "must be a relative path without '..'", "use a path inside the volume")


def _env(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    for index, env in enumerate(spec.template.env):
        at = f"spec.template.env[{index}]"
        if env.value is not None and env.value_from is not None:
            yield Problem(at, f"{env.name} has both value and valueFrom", "keep one of them")
        if env.value_from is not None:
            yield from _exactly_one(f"{at}.valueFrom", env.value_from, ENV_SOURCE_FIELDS, "value source")


def _metadata_keys(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    template = spec.template
    for kind, keys in (("labels", template.labels), ("annotations", template.annotations)):
        for key in keys:
            if key.startswith(OPERATOR_KEY_PREFIX):
                yield Problem(
                    f'spec.template.{kind}["{key}"]',
                    f"keys under {OPERATOR_KEY_PREFIX} are set by the operator (deployment, variant, revision, "
                    "draining)",
                    "remove it, or use another prefix",
                )
    for key in template.annotations:
        if key.startswith(CONFINEMENT_ANNOTATION_PREFIXES):
            yield Problem(
                f'spec.template.annotations["{key}"]',
                "AppArmor and seccomp annotations would change the worker's confinement",
                "remove it: worker pods run with the operator's security context (RuntimeDefault seccomp)",
            )


def _drain(spec: InferenceDeploymentSpec) -> Iterator[Problem]:
    drain = spec.drain
    if drain.timeout_seconds >= drain.termination_grace_period_seconds:
        yield Problem(
            "spec.drain.timeoutSeconds",
            f"drain timeout ({drain.timeout_seconds}s) is not below the termination grace period "
            f"({drain.termination_grace_period_seconds}s), so the kubelet would kill pods mid-drain",
            f"lower timeoutSeconds or raise terminationGracePeriodSeconds above {drain.timeout_seconds}",
        )


_RULES: tuple[Callable[[InferenceDeploymentSpec], Iterable[Problem]], ...] = (
    _unique_names,
    _sizing,
    _traffic,
    _canary,
    _quantization,
    _engine_budget,
    _speculative,
    _adapters,
    _engine_args,
    _pod_spec,
    _env,
    _metadata_keys,
    _drain,
)
