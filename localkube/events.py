"""Recording core/v1 Events the way kubelet and kube-scheduler do, so ``kubectl describe`` tells the story.

Repeats of the same (object, type, reason, message) bump ``count`` and ``lastTimestamp`` on one Event instead of
creating a new one, like client-go's event correlator.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from localkube.meta import clone, rfc3339
from localkube.services import Apis

_EVENTS = ("", "events")


class EventRecorder:
    def __init__(self, kube: Apis, component: str, host: str = "", max_tracked: int = 4096) -> None:
        self.kube = kube
        self.component = component
        self.host = host
        self._seen: OrderedDict[tuple, str] = OrderedDict()
        self._max = max_tracked

    def record(self, obj: dict, event_type: str, reason: str, message: str, field_path: str = "") -> None:
        meta = obj["metadata"]
        namespace = meta.get("namespace") or "default"
        key = (meta.get("uid"), event_type, reason, message, field_path)
        rt = self.kube.registry.builtin_storage(_EVENTS)
        now = rfc3339()
        name = self._seen.get(key)
        existing = self.kube.store.get(_EVENTS, namespace, name) if name else None
        if existing is not None:
            updated = clone(existing)
            updated["count"] = int(existing.get("count") or 1) + 1
            updated["lastTimestamp"] = now
            self.kube.core.put_system(rt, updated)
            self._seen.move_to_end(key)
            return
        name = f"{meta['name']}.{time.time_ns():x}"
        involved = {
            "kind": obj.get("kind", ""),
            "namespace": meta.get("namespace", ""),
            "name": meta["name"],
            "uid": meta.get("uid", ""),
            "apiVersion": obj.get("apiVersion", ""),
            "resourceVersion": meta.get("resourceVersion", ""),
        }
        if field_path:
            involved["fieldPath"] = field_path
        source = {"component": self.component}
        if self.host:
            source["host"] = self.host
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "source": source,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "type": event_type,
            "reportingComponent": self.component,
            "reportingInstance": self.host or self.component,
        }
        self.kube.core.put_system(rt, event)
        self._seen[key] = name
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
