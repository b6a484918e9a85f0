"""A container's process environment and command line, built from the pod spec as the kubelet would.

Resolves ``env`` (values, ``$(VAR)`` references, ``valueFrom`` fieldRef / resourceFieldRef / secretKeyRef /
configMapKeyRef) and ``envFrom``, then expands ``$(VAR)`` in ``command`` and ``args``. Missing secrets or config
maps raise ``ContainerConfigError`` (the kubelet reports ``CreateContainerConfigError`` and retries).
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable

from localkube.scheduler import parse_quantity

Lookup = Callable[[str, str], "dict | None"]  # (namespace, name) -> object or None
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


class ContainerConfigError(Exception):
    pass


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: unknown references stay as written, ``$$`` escapes a ``$``."""

    def repl(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(repl, text)


def field_ref(pod: dict, path: str) -> str:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(i.get("ip", "") for i in status.get("hostIPs") or []),
        "status.podIPs": ",".join(i.get("ip", "") for i in status.get("podIPs") or []),
    }
    if path in simple:
        return str(simple[path] or "")
    if path in ("metadata.labels", "metadata.annotations"):
        return "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get(path.split(".")[1]) or {}).items()))
    raise ContainerConfigError(f"unsupported fieldRef fieldPath {path!r}")


def resource_ref(container: dict, ref: dict, node_capacity: dict) -> str:
    resource = ref.get("resource", "")
    kind, _, name = resource.partition(".")
    resources = container.get("resources") or {}
    value = (resources.get(kind) or {}).get(name)
    if value is None and kind == "requests":
        value = (resources.get("limits") or {}).get(name)
    if value is None:
        value = node_capacity.get(name, 0) if kind == "limits" else 0
    divisor = parse_quantity(ref.get("divisor") or 1)
    return str(math.ceil(parse_quantity(value) / divisor))


def _secret_value(secret: dict, key: str) -> str | None:
    data = secret.get("data") or {}
    if key in data:
        return base64.b64decode(data[key]).decode("utf-8", "replace")
    return None


def container_env(
    pod: dict, container: dict, get_secret: Lookup, get_configmap: Lookup, node_capacity: dict | None = None
) -> dict[str, str]:
    """The variables the pod spec defines for ``container`` (without the host environment)."""
    namespace = pod["metadata"].get("namespace", "default")
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if source.get("configMapRef"):
            ref = source["configMapRef"]
            cm = get_configmap(namespace, ref.get("name", ""))
            if cm is None:
                if ref.get("optional"):
                    continue
                raise ContainerConfigError(f'configmap "{ref.get("name")}" not found')
            for key, value in (cm.get("data") or {}).items():
                env[prefix + key] = value
        elif source.get("secretRef"):
            ref = source["secretRef"]
            secret = get_secret(namespace, ref.get("name", ""))
            if secret is None:
                if ref.get("optional"):
                    continue
                raise ContainerConfigError(f'secret "{ref.get("name")}" not found')
            for key in secret.get("data") or {}:
                env[prefix + key] = _secret_value(secret, key) or ""
    for item in container.get("env") or []:
        name = item.get("name", "")
        if "value" in item or "valueFrom" not in item:
            env[name] = expand(str(item.get("value", "")), env)
            continue
        source = item["valueFrom"] or {}
        if source.get("fieldRef"):
            env[name] = field_ref(pod, source["fieldRef"].get("fieldPath", ""))
        elif source.get("resourceFieldRef"):
            env[name] = resource_ref(container, source["resourceFieldRef"], node_capacity or {})
        elif source.get("secretKeyRef"):
            ref = source["secretKeyRef"]
            secret = get_secret(namespace, ref.get("name", ""))
            value = _secret_value(secret, ref.get("key", "")) if secret is not None else None
            if value is None:
                if ref.get("optional"):
                    continue
                if secret is None:
                    raise ContainerConfigError(f'secret "{ref.get("name")}" not found')
                raise ContainerConfigError(
                    f"couldn't find key {ref.get('key')} in Secret {namespace}/{ref.get('name')}"
                )
            env[name] = value
        elif source.get("configMapKeyRef"):
            ref = source["configMapKeyRef"]
            cm = get_configmap(namespace, ref.get("name", ""))
            value = (cm.get("data") or {}).get(ref.get("key", "")) if cm is not None else None
            if value is None:
                if ref.get("optional"):
                    continue
                if cm is None:
                    raise ContainerConfigError(f'configmap "{ref.get("name")}" not found')
                raise ContainerConfigError(
                    f"couldn't find key {ref.get('key')} in ConfigMap {namespace}/{ref.get('name')}"
                )
            env[name] = value
    return env


def command_line(container: dict, env: dict[str, str]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expanded; localkube has no images, so a command is required."""
    command = list(container.get("command") or [])
    if not command:
        raise ContainerConfigError(
            "localkube runs containers as local processes and cannot use an image's entrypoint: set `command`"
        )
    return [expand(str(part), env) for part in command + list(container.get("args") or [])]
