"""The typed actions a reconcile pass asks the operator to perform, and the `Plan` that carries them.

Actions are data, not calls: the planner stays pure and tests compare plans, while the operator's executor maps
each action to one idempotent API call (AlreadyExists/NotFound tolerated, conflicts retried). Every action says
why it exists (`reason`, a `controllers.reasons.Reason`, and `message`) so the executor can record an Event for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar

from controllers.reasons import Reason

T = TypeVar("T")


class EventType(StrEnum):
    """Kubernetes Event types."""

    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True)
class CreatePod:
    """Create one worker pod. The name is deterministic: a second create of the same pod is AlreadyExists."""

    manifest: Mapping[str, Any]
    variant: str
    revision: str
    reason: Reason  # ScaleUp, Replace, Rollout or Canary
    message: str

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class DeletePod:
    """Delete one worker pod (only the incarnation with `uid`: a recreated pod of the same name is left alone).

    A pod that may still serve requests is drained first (`StartDrain`, see `controllers.draining`); a delete is
    planned directly only for pods that serve nothing (unready, ended) and for drained ones.
    """

    name: str
    uid: str
    variant: str | None
    revision: str | None
    reason: Reason  # ScaleDown, Rollout, Replace, Deletion (as drained) or Failed
    message: str


@dataclass(frozen=True)
class StartDrain:
    """Drain one worker pod: mark it (label + annotations, so routing stops at once and a restart resumes the
    drain), then `POST /drain` to the worker at `address`. Both steps are idempotent: with `mark=False` (the pod
    is already marked) the executor only sends the POST again."""

    name: str
    uid: str
    address: str | None  # host:port of the worker; None when the pod has no IP (then only the mark is written)
    variant: str | None
    revision: str | None
    reason: Reason  # a DrainReason value: ScaleDown, Rollout, Replace, Deletion
    message: str
    started_at: datetime
    deadline: datetime
    mark: bool = True


@dataclass(frozen=True)
class LoadAdapter:
    """Load LoRA adapter `adapter` from `source` into the worker at `address` (`replace`: unload the old copy
    first); the worker's answer reaches the next pass as an `AdapterResult` (see `controllers.adapters`)."""

    pod: str
    address: str
    adapter: str
    source: str
    replace: bool = False


@dataclass(frozen=True)
class UnloadAdapter:
    """Unload LoRA adapter `adapter` from the worker at `address` (one already gone is fine)."""

    pod: str
    address: str
    adapter: str


@dataclass(frozen=True)
class EnsurePdb:
    """Create the PodDisruptionBudget of a variant, or update its spec to match `manifest`."""

    manifest: Mapping[str, Any]

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class DeletePdb:
    """Delete the PodDisruptionBudget of a variant that is no longer in the spec."""

    name: str


@dataclass(frozen=True)
class RemoveAnnotations:
    """Remove annotations from the InferenceDeployment (one-shot commands such as `llmfleet.io/promote` once
    acted on)."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class EnsureService:
    """Create the workers' Service, or update its selector and ports to match `manifest`."""

    manifest: Mapping[str, Any]


@dataclass(frozen=True)
class EnsureNetworkPolicy:
    """Create the NetworkPolicy admitting only the configured peers to the workers, or update its spec to match
    `manifest` (see `controllers.network`)."""

    manifest: Mapping[str, Any]

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class PatchStatus:
    """Merge-patch these top-level status fields (only the ones this controller owns; others are left alone)."""

    status: Mapping[str, Any]


@dataclass(frozen=True)
class EmitEvent:
    """Record a Kubernetes Event on the InferenceDeployment."""

    type: EventType
    reason: Reason
    message: str


Action = (
    CreatePod
    | DeletePod
    | StartDrain
    | LoadAdapter
    | UnloadAdapter
    | EnsureService
    | EnsureNetworkPolicy
    | EnsurePdb
    | DeletePdb
    | RemoveAnnotations
    | PatchStatus
    | EmitEvent
)


@dataclass(frozen=True)
class Plan:
    """The outcome of one reconcile pass.

    `actions` run in order (the executor may batch pod creates/deletes); `requeue_after` asks for another pass
    after that many seconds even if nothing changes in the cluster; `finished` is True for a deployment being
    deleted once nothing of it is left running, so its finalizer may go.
    """

    actions: tuple[Action, ...] = ()
    requeue_after: float | None = None
    finished: bool = False
    notes: tuple[str, ...] = ()  # human-readable summary of the decisions, for logs

    def of_type(self, kind: type[T]) -> list[T]:
        """The actions of one type, in order."""
        return [action for action in self.actions if isinstance(action, kind)]
