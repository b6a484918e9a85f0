"""The drain token of one InferenceDeployment, derived from the operator's key: no Secret to create or read.

Why it exists: `POST /drain` on a worker needs a bearer token that the operator knows and the worker's pod holds.
Keeping one random token per deployment in a Secret meant the operator needed `secrets` create and get rights
(namespace- or cluster-wide: RBAC cannot restrict `create` by name). Instead the token is
HMAC-SHA256(operator key, "llmfleet-drain-v1/NAMESPACE/NAME/UID"): the operator holds one key (a file or
variable from the chart's Secret, mounted into its own pod), derives the same token after every restart, and
needs no Secret rights at all. The uid makes a deleted-and-recreated deployment of the same name get a new
token. The token is placed in the worker pod at identity time (`controllers.pods.pod_manifest`), never in the
pod template, so it never enters a revision hash: rotating the key does not roll the fleet (running pods keep
the token they started with; see docs/security.md).

Pure: imports only the standard library.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

CONTEXT = "llmfleet-drain-v1"
MIN_KEY_BYTES = 32


def drain_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The bearer token of `POST /drain` for the workers of one deployment (43 URL-safe characters)."""
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the drain key has {len(key)} bytes; it needs at least {MIN_KEY_BYTES}")
    if not (namespace and name and uid):
        raise ValueError("a drain token needs the deployment's namespace, name and uid")
    message = f"{CONTEXT}/{namespace}/{name}/{uid}".encode()
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def deployment_drain_token(key: bytes | None, meta: Mapping[str, Any]) -> str | None:
    """The token of the deployment whose metadata is `meta`; None without a key (POST /drain stays disabled)."""
    if key is None:
        return None
    return drain_token(key, str(meta.get("namespace") or "default"), str(meta["name"]), str(meta["uid"]))
