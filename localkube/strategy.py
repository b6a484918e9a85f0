"""Per-resource behaviour of the API server (the ``rest.RESTCreateStrategy`` & co. of a real kube-apiserver).

A ``Strategy`` decides defaults, validation, what the status subresource may change, how generation moves, how a
deletion is made graceful, which field selectors are supported and how ``kubectl get`` renders a row. The API core
(``api.py``) is generic and asks the strategy at each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from localkube.errors import Cause
from localkube.meta import age, clone
from localkube.store import StorageKey

BASE_FIELD_SELECTORS = frozenset({"metadata.name", "metadata.namespace"})


class StoredObjects(Protocol):
    def list(self, storage: StorageKey, namespace: str | None = None) -> list[dict]: ...


class StrategyContext(Protocol):
    """What a strategy may consult besides the object itself: the stored objects (a Service's strategy picks a
    free cluster IP and node port). ``ApiCore`` passes itself; the strategy never sees the rest of the API core."""

    @property
    def store(self) -> StoredObjects: ...


@dataclass(frozen=True)
class Column:
    name: str
    type: str = "string"
    format: str = ""
    description: str = ""
    priority: int = 0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "type": self.type,
            "format": self.format,
            "description": self.description,
            "priority": self.priority,
        }


NAME_COLUMN = Column("Name", format="name", description="Name must be unique within a namespace.")
AGE_COLUMN = Column(
    "Age", description="CreationTimestamp is a timestamp representing the server time when this object was created."
)


@dataclass
class Strategy:
    """Defaults for a plain object kind without spec/status semantics (ConfigMap-like)."""

    has_generation: bool = False
    status_subresource: bool = False
    field_selectors: frozenset[str] = field(default=BASE_FIELD_SELECTORS)
    strategic_merge: bool = True  # custom resources answer 415 to strategic merge patches
    virtual: bool = False  # create-only kinds that answer a question and store nothing (access reviews)

    def prepare_create(self, obj: dict, core: StrategyContext) -> None:
        if self.status_subresource and "status" in obj:
            del obj["status"]

    def validate(self, obj: dict, old: dict | None, core: StrategyContext) -> list[Cause]:
        return []

    def prepare_update(self, new: dict, old: dict, core: StrategyContext) -> None:
        if self.status_subresource:
            if "status" in old:
                new["status"] = clone(old["status"])
            else:
                new.pop("status", None)

    def prepare_status_update(self, new: dict, old: dict, core: StrategyContext) -> dict:
        """Only ``status`` comes from the request; everything else is the stored object's."""
        result = clone(old)
        if "status" in new:
            result["status"] = clone(new["status"])
        else:
            result.pop("status", None)
        return result

    def prepare_subresource_update(self, sub: str, new: dict, old: dict) -> dict:
        """Other writable subresources (a namespace's ``finalize``)."""
        return clone(old)

    def holds_deletion(self, obj: dict) -> bool:
        """Whether something besides metadata.finalizers keeps a deleted object (a namespace's spec.finalizers)."""
        return False

    def begin_deletion(self, obj: dict) -> None:
        """Adjust an object as its deletion starts (a namespace turns Terminating)."""

    def generation_changed(self, new: dict, old: dict) -> bool:
        skip = {"metadata", "status"} if self.status_subresource else {"metadata"}
        keys = (set(new) | set(old)) - skip - {"apiVersion", "kind"}
        return any(new.get(k) != old.get(k) for k in keys)

    def grace_period(self, obj: dict, requested: int | None) -> int:
        return 0

    def columns(self) -> list[Column]:
        return [NAME_COLUMN, AGE_COLUMN]

    def cells(self, obj: dict, now) -> list:
        return [obj["metadata"]["name"], age(obj["metadata"].get("creationTimestamp"), now)]

    def to_external(self, obj: dict, api_version: str) -> dict:
        """The stored object as a client of ``api_version`` sees it (version views share one storage)."""
        if obj.get("apiVersion") == api_version:
            return obj
        out = dict(obj)
        out["apiVersion"] = api_version
        return out

    def to_internal(self, obj: dict, storage_api_version: str) -> dict:
        obj["apiVersion"] = storage_api_version
        return obj

    def respond(self, obj: dict) -> dict:
        """The answer of a virtual kind to a create request."""
        raise NotImplementedError

    def prune_and_default(self, obj: dict, api_version: str) -> list[str]:
        """Drop unknown fields and apply schema defaults; returns the pruned paths (custom resources only)."""
        return []

    def validate_schema(self, obj: dict, api_version: str) -> list[Cause]:
        return []
