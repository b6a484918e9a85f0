"""The worker-pod facts every component reads: labels, the draining marker, readiness, the container port.

Why it exists: the operator writes these names onto the worker pods (`controllers.pods`, `controllers.draining`)
and the planner (`controllers.observed`), the autoscaler and the metrics source (`fleet_operator`), the gateway's
discovery and the CLI's progress view (`llmfleet.progress`) all read them back. Each once kept its own copy, and
the copies disagreed (one read `llmfleet.io/draining: "false"` as draining, the others did not). This module is the
one place that spells the names and says what a value means; every reader imports it.

What a marker means: a pod is draining when its `llmfleet.io/draining` label or annotation holds anything but
empty, "false" or "0" (case and surrounding blanks ignored). The operator sets the label to "true" (the gateway
and the scrapers stop using the pod at once) and the annotation to when the drain started.

It lives in `crds` (the lowest layer: `controllers`, `fleet_operator`, `gateway` and `llmfleet` may all import
it) and, like the rest of `crds`, imports nothing of ours: only the standard library. The worker's own default
port (`worker.server.settings`) is the same number, kept in the worker image, which imports nothing of the fleet.
"""

from collections.abc import Mapping
from typing import Any

# Labels on every worker pod (the Service, PodDisruptionBudgets and NetworkPolicy select on the first).
LABEL_DEPLOYMENT = "llmfleet.io/deployment"
LABEL_VARIANT = "llmfleet.io/variant"
LABEL_REVISION = "llmfleet.io/revision"
# A pod being drained carries this label ("true") and this annotation (when the drain started), plus the deadline
# and reason annotations below; see `controllers.draining`.
DRAINING = "llmfleet.io/draining"
DRAIN_DEADLINE = "llmfleet.io/drain-deadline"
DRAIN_REASON = "llmfleet.io/drain-reason"

CONTAINER_NAME = "worker"  # the worker container of a worker pod
PORT_NAME = "http"  # the name of its serving port (probes and the Service target it by name)
WORKER_PORT = 8000  # the port it listens on unless the operator's settings say otherwise

_NOT_MARKED = ("", "false", "0")


def marked(value: Any) -> bool:
    """Whether a draining label/annotation value means "draining" (anything but absent, empty, "false" or "0")."""
    return value is not None and str(value).strip().lower() not in _NOT_MARKED


def labels(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The pod's labels ({} when it has none)."""
    return ((pod.get("metadata") or {}).get("labels")) or {}


def annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The pod's annotations ({} when it has none)."""
    return ((pod.get("metadata") or {}).get("annotations")) or {}


def is_draining(pod: Mapping[str, Any]) -> bool:
    """The pod is marked draining, by label or by annotation."""
    return marked(labels(pod).get(DRAINING)) or marked(annotations(pod).get(DRAINING))


def ready_condition(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's Ready condition when it is True (it carries `lastTransitionTime`: when the pod became ready)."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready" and condition.get("status") == "True":
            return condition
    return None


def is_ready(pod: Mapping[str, Any]) -> bool:
    """The kubelet reports the pod Ready (its readiness probe, `GET /ready`, passes)."""
    return ready_condition(pod) is not None


def named_port(pod: Mapping[str, Any]) -> int | None:
    """The container port named `http` (the first one, over the pod's containers); None without one."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == PORT_NAME and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


def host_port(ip: str, port: int) -> str:
    """`ip:port`, an IPv6 address in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
