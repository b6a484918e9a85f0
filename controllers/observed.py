"""What the operator saw in the cluster, as plain immutable data: the planner's only view of the world.

The operator's shell reads the worker pods (by label), the Service and the drain-token Secret of one
InferenceDeployment and turns them into an `Observed` with `Observed.from_objects`; `reconcile` never touches the
API. Pods are summarised into `PodInfo` (phase, readiness, revision, age, failure signs) so that the planning rules
read like the rules they implement, and so that tests can build observations in one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

LABEL_DEPLOYMENT = "llmfleet.io/deployment"
LABEL_VARIANT = "llmfleet.io/variant"
LABEL_REVISION = "llmfleet.io/revision"
# Set by the drain path (issue 7) on a pod the gateway must stop routing to; read here only to count such pods.
DRAINING = "llmfleet.io/draining"

# Container waiting reasons that mean the pod will not become ready without help.
STUCK_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


class PodPhase(StrEnum):
    """Kubernetes pod phases."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


@dataclass(frozen=True)
class PodInfo:
    """One worker pod, reduced to what planning needs."""

    name: str
    uid: str = ""
    variant: str | None = None
    revision: str | None = None
    phase: PodPhase = PodPhase.PENDING
    ready: bool = False
    created_at: datetime | None = None
    deleting: bool = False  # metadata.deletionTimestamp is set: the pod is already going away
    draining: bool = False  # marked llmfleet.io/draining
    restarts: int = 0
    waiting_reason: str | None = None  # e.g. CrashLoopBackOff
    message: str = ""  # why the pod failed, when it did
    owner_uid: str | None = None  # uid of its controller ownerReference
    in_flight: int | None = None  # requests in flight, when the shell measured them

    @property
    def failed(self) -> bool:
        """The pod has ended (Failed or Succeeded) and will never serve again: it must be replaced."""
        return self.phase in (PodPhase.FAILED, PodPhase.SUCCEEDED)

    @property
    def live(self) -> bool:
        """The pod counts towards its variant's size: not going away and not ended."""
        return not self.deleting and not self.failed

    @property
    def stuck(self) -> bool:
        """A container is waiting for a reason that does not clear by itself (crash loop, bad image, config)."""
        return self.waiting_reason in STUCK_REASONS

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodInfo:
        """Summarise a Pod object (a dict as the API returns it)."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        status = pod.get("status") or {}
        conditions = status.get("conditions") or []
        containers = status.get("containerStatuses") or []
        waiting = [
            ((c.get("state") or {}).get("waiting") or {}).get("reason") for c in containers if isinstance(c, Mapping)
        ]
        owner_uid = next(
            (ref.get("uid") for ref in meta.get("ownerReferences") or [] if ref.get("controller")),
            None,
        )
        try:
            phase = PodPhase(status.get("phase") or PodPhase.PENDING)
        except ValueError:
            phase = PodPhase.UNKNOWN
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            variant=labels.get(LABEL_VARIANT),
            revision=labels.get(LABEL_REVISION),
            phase=phase,
            ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
            created_at=parse_time(meta.get("creationTimestamp")),
            deleting=meta.get("deletionTimestamp") is not None,
            draining=DRAINING in labels or DRAINING in annotations,
            restarts=sum(int(c.get("restartCount") or 0) for c in containers if isinstance(c, Mapping)),
            waiting_reason=next((reason for reason in waiting if reason), None),
            message=str(status.get("message") or status.get("reason") or ""),
            owner_uid=owner_uid,
        )


@dataclass(frozen=True)
class Observed:
    """Everything observed about one InferenceDeployment's children, plus what went wrong last time."""

    pods: tuple[PodInfo, ...] = ()
    service: Mapping[str, Any] | None = None  # the workers' Service, if it exists
    secret_exists: bool = False  # the drain-token Secret exists
    errors: tuple[str, ...] = ()  # API errors of the previous pass (shown as the Degraded condition)

    @classmethod
    def from_objects(
        cls,
        pods: Iterable[Mapping[str, Any]],
        service: Mapping[str, Any] | None = None,
        secret: Mapping[str, Any] | None = None,
        errors: Iterable[str] = (),
    ) -> Observed:
        """Build from API objects (dicts): the labelled pods, the Service and the Secret (None when absent)."""
        return cls(
            pods=tuple(PodInfo.from_pod(pod) for pod in pods),
            service=service,
            secret_exists=secret is not None,
            errors=tuple(errors),
        )


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp from the API (`2024-05-01T12:00:00Z`) -> aware datetime; None when absent or bad."""
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
