"""The object store: every object, one global resourceVersion, a bounded event log and the live watches.

Stored objects are never mutated in place (each write stores a fresh dict), so the event log and the watches can
share them without copying. All access happens on the API server's event loop thread, so no locking is needed.
"""

from __future__ import annotations

import asyncio
import builtins
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from localkube.selectors import FieldSelector, LabelSelector

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
StorageKey = tuple[str, str]  # (group, plural) of the storage


@dataclass(frozen=True)
class Event:
    rv: int
    storage: StorageKey
    type: str
    obj: dict
    prev: dict | None


@dataclass(eq=False)
class Watch:
    """A live watch: events for one storage, narrowed by namespace and selectors, queued for one client."""

    storage: StorageKey
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    max_queue: int = 100_000
    overflowed: bool = False

    def matches(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        meta = obj["metadata"]
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(obj)

    def translate(self, event: Event) -> tuple[str, dict] | None:
        """The event this watch sees, given selector transitions (a real watch cache's semantics)."""
        now = self.matches(event.obj)
        if event.type == ADDED:
            return (ADDED, event.obj) if now else None
        if event.type == DELETED:
            return (DELETED, event.obj) if now else None
        before = self.matches(event.prev)
        if before and now:
            return (MODIFIED, event.obj)
        if now:
            return (ADDED, event.obj)
        if before:
            return (DELETED, event.obj)
        return None

    def offer(self, event: Event) -> None:
        if self.overflowed:
            return
        seen = self.translate(event)
        if seen is None:
            return
        if self.queue.qsize() >= self.max_queue:
            self.overflowed = True
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait((seen[0], seen[1], event.rv))

    def close(self) -> None:
        self.queue.put_nowait(None)


class Store:
    def __init__(self, log_size: int = 20_000) -> None:
        self.rv = 0
        self._data: dict[StorageKey, dict[tuple[str, str], dict]] = {}
        self._by_uid: dict[str, tuple[StorageKey, str, str]] = {}
        self._log: deque[Event] = deque(maxlen=log_size)
        self.compacted_rv = 0  # watches asking for anything older get 410 Gone
        self._watches: dict[StorageKey, set[Watch]] = {}
        self._listeners: list[Callable[[Event], None]] = []

    # ------------------------------------------------------------------------------------------------ reads

    def get(self, storage: StorageKey, namespace: str, name: str) -> dict | None:
        return self._data.get(storage, {}).get((namespace, name))

    def list(self, storage: StorageKey, namespace: str | None = None) -> list[dict]:
        bucket = self._data.get(storage, {})
        if namespace is None:
            return [bucket[k] for k in sorted(bucket)]
        return [bucket[k] for k in sorted(k for k in bucket if k[0] == namespace)]

    def by_uid(self, uid: str) -> tuple[StorageKey, dict] | None:
        where = self._by_uid.get(uid)
        if where is None:
            return None
        obj = self.get(*where)
        return (where[0], obj) if obj is not None else None

    def storages(self) -> builtins.list[StorageKey]:
        return list(self._data)

    def count(self, storage: StorageKey) -> int:
        return len(self._data.get(storage, {}))

    # ----------------------------------------------------------------------------------------------- writes

    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def put(self, storage: StorageKey, obj: dict, event_type: str) -> dict:
        """Store ``obj`` (which the store now owns) under a fresh resourceVersion and tell every watch."""
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        bucket = self._data.setdefault(storage, {})
        prev = bucket.get(key)
        rv = self.next_rv()
        meta["resourceVersion"] = str(rv)
        bucket[key] = obj
        self._by_uid[meta["uid"]] = (storage, key[0], key[1])
        self._emit(Event(rv, storage, event_type, obj, prev))
        return obj

    def remove(self, storage: StorageKey, obj: dict) -> dict:
        """Delete the object; the DELETED event carries its last state under a fresh resourceVersion."""
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        bucket = self._data.get(storage, {})
        prev = bucket.pop(key, None)
        if not bucket:
            self._data.pop(storage, None)
        self._by_uid.pop(meta["uid"], None)
        final = dict(obj)
        final["metadata"] = dict(meta)
        rv = self.next_rv()
        final["metadata"]["resourceVersion"] = str(rv)
        self._emit(Event(rv, storage, DELETED, final, prev))
        return final

    def load(self, storage: StorageKey, obj: dict) -> None:
        """Put an object back from persisted state, without an event."""
        meta = obj["metadata"]
        self._data.setdefault(storage, {})[(meta.get("namespace", ""), meta["name"])] = obj
        self._by_uid[meta["uid"]] = (storage, meta.get("namespace", ""), meta["name"])

    def _emit(self, event: Event) -> None:
        if len(self._log) == self._log.maxlen:
            self.compacted_rv = self._log[0].rv
        self._log.append(event)
        for watch in list(self._watches.get(event.storage, ())):
            watch.offer(event)
        for listener in self._listeners:
            listener(event)

    # ------------------------------------------------------------------------------------------------ watch

    def add_listener(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def too_old(self, rv: int) -> bool:
        return rv < self.compacted_rv

    def events_since(self, storage: StorageKey, rv: int) -> builtins.list[Event]:
        return [e for e in self._log if e.rv > rv and e.storage == storage]

    def subscribe(self, watch: Watch) -> None:
        self._watches.setdefault(watch.storage, set()).add(watch)

    def unsubscribe(self, watch: Watch) -> None:
        watches = self._watches.get(watch.storage)
        if watches is not None:
            watches.discard(watch)

    def close_watches(self, storage: StorageKey | None = None) -> None:
        for key, watches in list(self._watches.items()):
            if storage is None or key == storage:
                for watch in list(watches):
                    watch.close()
                watches.clear()

    def watch_count(self) -> int:
        return sum(len(w) for w in self._watches.values())

    def snapshot(self) -> dict:
        return {
            "resourceVersion": self.rv,
            "objects": [[list(s), obj] for s, bucket in self._data.items() for obj in bucket.values()],
        }
