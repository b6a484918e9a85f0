"""Writing the kubeconfig that points kubectl, the kubernetes client and kopf at a localkube API server."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

CONTEXT = "localkube"


def kubeconfig_document(url: str, namespace: str = "default") -> dict:
    """A kubeconfig for ``url``; localkube accepts any credentials, the token only keeps clients that insist happy."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": url}}],
        "users": [{"name": CONTEXT, "user": {"token": "localkube"}}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": namespace}}],
        "current-context": CONTEXT,
        "preferences": {},
    }


def write_kubeconfig(path: Path, url: str, namespace: str = "default") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(kubeconfig_document(url, namespace), sort_keys=False))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path
