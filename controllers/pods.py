"""The worker pod, Service and PodDisruptionBudgets of an InferenceDeployment, as manifests (plain dicts).

`pod_template(deployment, spec, variant, defaults)` is everything about a variant's pods that does not depend on
which pod it is. The revision that labels them is not its hash but the hash of what the user and the operator's
administrator chose (`controllers.revision`), so a new operator version that renders pods differently does not roll
running pods: new pods get the new rendering.
`pod_manifest` adds the identity: a deterministic name `DEPLOYMENT-VARIANT-REVISION-SLOT`, the revision label,
the controller ownerReference and the deployment's drain token (`controllers.drain_token`: derived from the
operator's key, so it is identity, never part of a revision; a key rotation does not roll pods). Deterministic names make creation idempotent: after an operator restart or a stale
read, creating "the next pod" again is an AlreadyExists answer, never a duplicate.

The container runs `llmfleet worker --model SOURCE --engine ... --port 8000 ...` and binds to `$POD_IP` (downward
API), probes `/health` (startup, liveness) and `/ready` (readiness), and drains in `preStop`: a stdlib-only
Python snippet POSTs `/drain` with the bearer token from `$LLMFLEET_DRAIN_TOKEN` (a literal value in the pod spec,
readable by whoever may read pods of the namespace; see docs/security.md), then polls `GET /drain` until
nothing is in flight, the worker has exited, or the drain timeout passes. The worker also drains on SIGTERM, so
the hook is a belt to SIGTERM's braces. Pods run non-root, without privilege escalation or capabilities, on a
read-only root filesystem with `emptyDir` scratch space at /tmp and a model cache.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from crds.helpers import parse_quantity
from crds.models import (
    API_VERSION,
    DEFAULT_CACHE_DIR,
    KIND,
    MODELS_MOUNT,
    OPERATOR_VOLUME_NAMES,
    TMP_MOUNT,
    InferenceDeploymentSpec,
    SpeculativeSpec,
    VariantSpec,
)
from crds.pods import (
    CONTAINER_NAME,
    LABEL_DEPLOYMENT,
    LABEL_REVISION,
    LABEL_VARIANT,
    PORT_NAME,
    WORKER_PORT,
)

DRAIN_TOKEN_ENV = "LLMFLEET_DRAIN_TOKEN"
MANAGED_BY = "llmfleet-operator"


@dataclass(frozen=True)
class PodDefaults:
    """Operator-wide choices for worker pods (from the operator's settings). Which of them are part of the
    revision (image, command, extra_args, port, render_epoch) and which reach new pods only is decided in
    `controllers.revision`."""

    image: str = "ghcr.io/llmfleet/llmfleet-worker:0.1.0"
    # The worker entrypoint; the engine flags follow it.
    command: tuple[str, ...] = ("llmfleet", "worker")
    port: int = WORKER_PORT
    run_as_user: int = 1000
    # Longest model load before the kubelet restarts the pod (startup probe budget).
    startup_timeout_seconds: int = 1800
    probe_period_seconds: int = 2
    # Writable emptyDir for converted/downloaded models, with HOME=/tmp; None = leave HOME and caches to the image
    # (e.g. on localkube, where pods share the host's model cache).
    cache_dir: str | None = DEFAULT_CACHE_DIR
    # Appended to every worker command, e.g. ("--engine", "fake") for control-plane tests; later flags win.
    extra_args: tuple[str, ...] = field(default=())
    # Extra environment (name, value) of worker pods, before the CR's env. Rendering only: running pods keep theirs
    # until they are replaced for another reason (or render_epoch changes).
    extra_env: tuple[tuple[str, str], ...] = field(default=())
    # Part of every revision: raising it rolls every worker pod (drained) onto the current rendering.
    render_epoch: int = 0


# ------------------------------------------------------------------------------------------------------- naming


def pod_name(deployment: str, variant: str, revision: str, slot: int) -> str:
    """Deterministic pod name of one slot of a (variant, revision)."""
    return f"{deployment}-{variant}-{revision}-{slot}"


def service_name(deployment: str) -> str:
    return f"{deployment}-workers"


def pdb_name(deployment: str, variant: str) -> str:
    return f"{deployment}-{variant}"


def selector(deployment: str) -> dict[str, str]:
    """Labels selecting all worker pods of a deployment."""
    return {LABEL_DEPLOYMENT: deployment}


def label_selector(deployment: str) -> str:
    """The same selector as a string (`.status.labelSelector`, list calls)."""
    return ",".join(f"{key}={value}" for key, value in selector(deployment).items())


def owner_reference(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The controller ownerReference pointing at the InferenceDeployment (garbage collection, adoption checks)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


# ------------------------------------------------------------------------------------------------------ command


def model_path(source: str) -> str:
    """What the worker gets as `--model`: `pvc://CLAIM/PATH` becomes the mount path, the rest pass through."""
    if source.startswith("pvc://"):
        claim, _, path = source.removeprefix("pvc://").partition("/")
        return f"{MODELS_MOUNT}/{claim}/{path}".rstrip("/")
    return source


def worker_args(spec: InferenceDeploymentSpec, variant: VariantSpec, defaults: PodDefaults) -> list[str]:
    """Arguments of `llmfleet worker` for this variant (after the command itself)."""
    engine = spec.engine
    args = [
        "--model",
        model_path(variant.source or spec.model.source),
        "--served-model-name",
        spec.model.name,
        "--engine",
        engine.type.value,
        "--quantization",
        variant.quantization.value,
        "--dtype",
        engine.dtype.value,
        "--port",
        str(defaults.port),
        "--max-num-seqs",
        str(engine.max_num_seqs),
    ]
    if spec.model.revision is not None:
        args += ["--revision", spec.model.revision]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if engine.kv_cache_bytes is not None:
        args += ["--kv-cache-bytes", str(int(parse_quantity(engine.kv_cache_bytes)))]
    args.append("--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching")
    args.append("--enable-chunked-prefill" if engine.enable_chunked_prefill else "--no-enable-chunked-prefill")
    if engine.speculative is not None:
        args += ["--speculative-config", speculative_config(engine.speculative)]
    if engine.lora is not None:  # the adapters themselves are loaded into running pods (controllers.adapters)
        args += ["--enable-lora", "--max-loras", str(engine.lora.max_loras)]
        args += ["--max-lora-rank", str(engine.lora.max_lora_rank)]
    args += ["--drain-timeout", str(spec.drain.timeout_seconds)]
    args += extra_engine_args({**_normalised(engine.extra_args), **_normalised(variant.extra_args)})
    return args + list(defaults.extra_args)


def speculative_config(spec: SpeculativeSpec) -> str:
    """`engine.speculative` as the worker's `--speculative-config` JSON, in vLLM's spelling (the worker maps it
    to either engine; `disable_by_batch_size` only when set)."""
    config: dict[str, Any] = {
        "method": spec.method.value,
        "num_speculative_tokens": spec.num_tokens,
        "prompt_lookup_max": spec.prompt_lookup_max,
        "prompt_lookup_min": spec.prompt_lookup_min,
    }
    if spec.disable_by_batch_size is not None:
        config["disable_by_batch_size"] = spec.disable_by_batch_size
    return json.dumps(config, separators=(",", ":"))


def extra_engine_args(extra: Mapping[str, Any]) -> list[str]:
    """Free-form engine flags -> argv, sorted by flag: `true` = bare flag, `false`/null = left out, a list =
    the flag repeated, anything else = `--flag value` (mappings as JSON)."""
    argv: list[str] = []
    for key in sorted(extra):
        value = extra[key]
        flag = "--" + str(key).lstrip("-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            for item in value:
                argv += [flag, _scalar(item)]
        elif isinstance(value, Mapping):
            argv += [flag, json.dumps(value, sort_keys=True, separators=(",", ":"))]
        else:
            argv += [flag, _scalar(value)]
    return argv


def _scalar(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _normalised(extra: Mapping[str, Any]) -> dict[str, Any]:
    return {str(key).lstrip("-"): value for key, value in extra.items()}


def prestop_script(port: int, timeout_seconds: int) -> str:
    """Stdlib-only Python run by the preStop hook: start the worker's drain and wait for it (bounded)."""
    return "\n".join(
        [
            "import json, os, time, urllib.request as r",
            f"url = 'http://' + os.environ.get('POD_IP', '127.0.0.1') + ':{port}/drain'",
            f"token = os.environ.get('{DRAIN_TOKEN_ENV}', '')",
            "try:",
            "    r.urlopen(r.Request(url, method='POST', headers={'Authorization': 'Bearer ' + token}), timeout=5)",
            "except Exception:",
            "    raise SystemExit(0)",
            f"end = time.monotonic() + {timeout_seconds}",
            "while time.monotonic() < end:",
            "    try:",
            "        state = json.load(r.urlopen(url, timeout=5))",
            "    except Exception:",
            "        break",
            "    if not state.get('inflight'):",
            "        break",
            "    time.sleep(1)",
        ]
    )


# ----------------------------------------------------------------------------------------------------- manifests


def pod_template(
    deployment: str, spec: InferenceDeploymentSpec, variant: VariantSpec, defaults: PodDefaults
) -> dict[str, Any]:
    """The pod of a (deployment, variant) without its identity (name, namespace, revision, owner)."""
    template = spec.template
    labels = {
        **template.labels,
        "app.kubernetes.io/name": "llmfleet-worker",
        "app.kubernetes.io/instance": deployment,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_DEPLOYMENT: deployment,
        LABEL_VARIANT: variant.name,
    }
    annotations = {
        **template.annotations,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(defaults.port),
        "prometheus.io/path": "/metrics",
    }
    volumes, mounts = _volumes(variant.source or spec.model.source, defaults)
    # The CR's extra pod fields come from an allow-list (crds.models.PodExtras); the operator's own fields below
    # are written after them, so none of them can be overridden.
    extras = template.pod_spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    pod_spec: dict[str, Any] = {
        **extras,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": spec.drain.termination_grace_period_seconds,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": defaults.run_as_user,
            "runAsGroup": defaults.run_as_user,
            "fsGroup": defaults.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(spec, variant, defaults, mounts)],
    }
    pod_spec["volumes"] = list(extras.get("volumes") or []) + volumes
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in template.tolerations
        ]
    if template.service_account_name:
        pod_spec["serviceAccountName"] = template.service_account_name
    if template.priority_class_name:
        pod_spec["priorityClassName"] = template.priority_class_name
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}


def pod_manifest(
    meta: Mapping[str, Any],
    template: Mapping[str, Any],
    variant: str,
    revision: str,
    slot: int,
    *,
    drain_token: str | None = None,
) -> dict[str, Any]:
    """A full Pod: `template` (from `pod_template`) plus name, namespace, revision label, ownerReference and,
    when given, the drain token as `$LLMFLEET_DRAIN_TOKEN` of the worker container (without one the worker
    refuses `POST /drain` and drains on SIGTERM only)."""
    spec = dict(template["spec"])
    if drain_token is not None:
        token = {"name": DRAIN_TOKEN_ENV, "value": drain_token}
        spec["containers"] = [
            {**c, "env": [token, *(e for e in c.get("env") or [] if e.get("name") != DRAIN_TOKEN_ENV)]}
            if c.get("name") == CONTAINER_NAME
            else c
            for c in spec["containers"]
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **template["metadata"],
            "name": pod_name(meta["name"], variant, revision, slot),
            "namespace": meta.get("namespace", "default"),
            "labels": {**template["metadata"]["labels"], LABEL_REVISION: revision},
            "ownerReferences": [owner_reference(meta)],
        },
        "spec": spec,
    }


def service_manifest(meta: Mapping[str, Any], defaults: PodDefaults) -> dict[str, Any]:
    """The headless Service of the workers: stable DNS per pod and one target for scrapers."""
    name = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(name),
            "namespace": meta.get("namespace", "default"),
            "labels": {LABEL_DEPLOYMENT: name, "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [owner_reference(meta)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": selector(name),
            "ports": [{"name": PORT_NAME, "port": defaults.port, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def service_matches(observed: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether an existing Service already has the selector and ports we want (other fields are not ours)."""
    have, want = observed.get("spec") or {}, wanted["spec"]
    ports = [{k: p.get(k) for k in ("name", "port", "targetPort", "protocol")} for p in have.get("ports") or []]
    return bool(have.get("selector") == want["selector"] and ports == want["ports"])


def pdb_manifest(meta: Mapping[str, Any], variant: str) -> dict[str, Any]:
    """The PodDisruptionBudget of one variant: voluntary evictions (node drains, cluster autoscaler) may take at
    most one of its pods at a time.

    `maxUnavailable: 1` rather than a `minAvailable`: a variant of one pod must still let a node drain proceed
    (minAvailable 1 would block it forever), and a variant of many pods is protected from losing more than one
    at a time whatever its size, which the autoscaler changes. Unhealthy pods may always be evicted
    (`unhealthyPodEvictionPolicy: AlwaysAllow`): a crash-looping pod must not block a node drain. The budget
    covers evictions only; the operator's own removals are paced by its planner (surge and availability) and
    drained (`controllers.draining`), and a pod that is draining is unready, so it already counts as the one
    unavailable pod.
    """
    name = meta["name"]
    labels = {LABEL_DEPLOYMENT: name, LABEL_VARIANT: variant}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": pdb_name(name, variant),
            "namespace": meta.get("namespace", "default"),
            "labels": {**labels, "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [owner_reference(meta)],
        },
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": labels},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def pdb_matches(observed: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether an existing PodDisruptionBudget already has the spec we want."""
    have, want = observed.get("spec") or {}, wanted["spec"]
    return all(have.get(key) == value for key, value in want.items())


def _container(
    spec: InferenceDeploymentSpec,
    variant: VariantSpec,
    defaults: PodDefaults,
    mounts: list[dict[str, Any]],
) -> dict[str, Any]:
    template = spec.template
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if defaults.cache_dir is not None:  # writable places on a read-only root filesystem
        env += [
            {"name": "HOME", "value": "/tmp"},
            {"name": "LLMFLEET_CACHE_DIR", "value": f"{defaults.cache_dir}/models"},
            {"name": "HF_HOME", "value": f"{defaults.cache_dir}/hf"},
        ]
    env += [{"name": name, "value": value} for name, value in defaults.extra_env]
    user_env = [e.model_dump(mode="json", by_alias=True, exclude_none=True) for e in template.env]
    threads = cpu_threads(variant)
    if threads is not None and not any(e["name"] == "OMP_NUM_THREADS" for e in user_env):
        env.append({"name": "OMP_NUM_THREADS", "value": str(threads)})
    env += user_env
    probe = {"httpGet": {"path": "/health", "port": PORT_NAME}, "periodSeconds": defaults.probe_period_seconds}
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": template.image or defaults.image,
        "command": list(defaults.command),
        "args": worker_args(spec, variant, defaults),
        "env": env,
        "ports": [{"name": PORT_NAME, "containerPort": defaults.port, "protocol": "TCP"}],
        "startupProbe": {
            **probe,
            "timeoutSeconds": 3,
            "failureThreshold": max(1, math.ceil(defaults.startup_timeout_seconds / defaults.probe_period_seconds)),
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": PORT_NAME},
            "periodSeconds": defaults.probe_period_seconds,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
        "livenessProbe": {**probe, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "lifecycle": {
            "preStop": {
                "exec": {
                    "command": ["python3", "-c", prestop_script(defaults.port, spec.drain.timeout_seconds)],
                }
            }
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts
        + [m.model_dump(mode="json", by_alias=True, exclude_none=True) for m in template.volume_mounts or []],
    }
    resources = _resources(variant)
    if resources:
        container["resources"] = resources
    if template.image_pull_policy is not None:
        container["imagePullPolicy"] = template.image_pull_policy.value
    return container


def cpu_threads(variant: VariantSpec) -> int | None:
    """The worker's CPU thread count: its CPU request rounded up (torch would otherwise use every core of the
    node, whatever the pod asked for; see worker/cpu_threads.py). None when no CPU is requested."""
    if variant.resources.cpu is None:
        return None
    return max(1, math.ceil(parse_quantity(variant.resources.cpu)))


def _resources(variant: VariantSpec) -> dict[str, dict[str, str]]:
    wanted = variant.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if wanted.cpu is not None:
        requests["cpu"] = wanted.cpu
    if wanted.memory is not None:
        requests["memory"] = limits["memory"] = wanted.memory
    if wanted.gpu:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(wanted.gpu)
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _volumes(source: str, defaults: PodDefaults) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    tmp, cache, model = OPERATOR_VOLUME_NAMES
    volumes: list[dict[str, Any]] = [{"name": tmp, "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": tmp, "mountPath": TMP_MOUNT}]
    if defaults.cache_dir is not None:
        volumes.append({"name": cache, "emptyDir": {}})
        mounts.append({"name": cache, "mountPath": defaults.cache_dir})
    if source.startswith("pvc://"):
        claim = source.removeprefix("pvc://").partition("/")[0]
        volumes.append({"name": model, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": model, "mountPath": f"{MODELS_MOUNT}/{claim}", "readOnly": True})
    return volumes, mounts
