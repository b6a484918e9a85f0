"""Revision ids: a short hash of everything that goes into a worker pod, so only pod-relevant edits roll pods.

The revision of a (deployment, variant) is the hash of its pod template as `controllers.pods.pod_template` builds
it: the same function that builds the pods, so what is hashed is exactly what runs. Fields that never reach a pod
(weights, tiers, replica counts, autoscaling, rollout steps) cannot change the revision; changing the model, the
engine flags, the resources, the image, the env or the drain settings does. The hash is canonical JSON (sorted
keys) through SHA-256, cut to 10 hex digits: a valid label value, stable across processes and restarts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

REVISION_LENGTH = 10


def revision_of(template: Mapping[str, Any]) -> str:
    """The revision id of a pod template (10 lowercase hex digits)."""
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]
