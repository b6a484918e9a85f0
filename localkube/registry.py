"""Which resources the API server serves, under which group/version, and the discovery documents that list them.

Built-in types are registered at start-up; CustomResourceDefinitions add and remove their own types while running.
Several served versions can share one storage (a CRD's versions, ``events`` in ``v1`` and ``events.k8s.io/v1``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from localkube.store import StorageKey
from localkube.strategy import Strategy

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    strategy: Strategy
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ALL_VERBS
    subresources: dict[str, tuple[str, ...]] = field(default_factory=dict)
    storage: StorageKey = ("", "")  # ("", "") until __post_init__: (group, plural), unless versions share one
    storage_version: str = ""
    list_kind: str = ""
    preferred: bool = True  # the group's preferred version

    def __post_init__(self):
        if self.storage == ("", ""):
            self.storage = (self.group, self.plural)
        if not self.storage_version:
            self.storage_version = self.api_version
        if not self.list_kind:
            self.list_kind = f"{self.kind}List"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def discovery_entries(self) -> list[dict]:
        entry = {
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(self.verbs),
        }
        if self.short_names:
            entry["shortNames"] = list(self.short_names)
        if self.categories:
            entry["categories"] = list(self.categories)
        entries = [entry]
        for sub, verbs in self.subresources.items():
            sub_kind = {"scale": "Scale", "log": "Pod", "binding": "Binding", "eviction": "Eviction"}.get(
                sub, self.kind
            )
            item = {
                "name": f"{self.plural}/{sub}",
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": sub_kind,
                "verbs": list(verbs),
            }
            if sub == "scale":
                item["group"] = "autoscaling"
                item["version"] = "v1"
            elif sub == "eviction":
                item["group"] = "policy"
                item["version"] = "v1"
            entries.append(item)
        return entries


class Registry:
    """The served resource types, looked up by URL parts, by storage or by kind."""

    def __init__(self) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._group_order: list[str] = []

    def add(self, rt: ResourceType) -> None:
        self._types[(rt.group, rt.version, rt.plural)] = rt
        if rt.group not in self._group_order:
            self._group_order.append(rt.group)

    def remove_storage(self, storage: StorageKey) -> None:
        for key in [k for k, rt in self._types.items() if rt.storage == storage]:
            del self._types[key]

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def builtin(self, group: str, version: str, plural: str) -> ResourceType:
        """A type localkube always serves (namespaces, nodes, pods, ...): a KeyError here is a bug of ours."""
        rt = self.lookup(group, version, plural)
        if rt is None:
            raise KeyError(f"built-in resource {group}/{version}/{plural} is not registered")
        return rt

    def builtin_storage(self, storage: StorageKey) -> ResourceType:
        """The canonical type of a storage localkube always has (events, poddisruptionbudgets, ...)."""
        rt = self.storage_type(storage)
        if rt is None:
            raise KeyError(f"built-in storage {storage} is not registered")
        return rt

    def for_storage(self, storage: StorageKey) -> list[ResourceType]:
        return [rt for rt in self._types.values() if rt.storage == storage]

    def storage_type(self, storage: StorageKey) -> ResourceType | None:
        """The type whose version is the storage version (the canonical view)."""
        views = self.for_storage(storage)
        for rt in views:
            if rt.api_version == rt.storage_version:
                return rt
        return views[0] if views else None

    def all(self) -> list[ResourceType]:
        return list(self._types.values())

    def group_versions(self) -> dict[str, list[str]]:
        """group -> served versions, preferred first."""
        out: dict[str, list[str]] = {}
        for group in self._group_order:
            versions = []
            for rt in self._types.values():
                if rt.group == group and rt.version not in versions:
                    versions.append(rt.version)
            if versions:
                versions.sort(key=lambda v: (not self._preferred(group, v), version_priority(v)))
                out[group] = versions
        return out

    def _preferred(self, group: str, version: str) -> bool:
        return any(rt.preferred for rt in self._types.values() if rt.group == group and rt.version == version)

    def types_in(self, group: str, version: str) -> list[ResourceType]:
        return [rt for rt in self._types.values() if rt.group == group and rt.version == version]

    # ------------------------------------------------------------------------------------------- discovery

    def api_versions(self, server_address: str) -> dict:
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
        }

    def api_group(self, group: str) -> dict | None:
        versions = self.group_versions().get(group)
        if not versions or not group:
            return None
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": group,
            "versions": entries,
            "preferredVersion": entries[0],
        }

    def api_group_list(self) -> dict:
        groups = [group for g in self.group_versions() if g and (group := self.api_group(g)) is not None]
        for g in groups:
            del g["kind"], g["apiVersion"]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def api_resource_list(self, group: str, version: str) -> dict | None:
        types = self.types_in(group, version)
        if not types:
            return None
        resources = []
        for rt in sorted(types, key=lambda t: t.plural):
            resources.extend(rt.discovery_entries())
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }


def version_priority(version: str) -> tuple:
    """Kubernetes version ordering: GA > beta > alpha, higher numbers first."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (3, version)
    major = int(m.group(1))
    stage = {None: 0, "beta": 1, "alpha": 2}[m.group(2)]
    minor = int(m.group(3) or 0)
    return (stage, -major, -minor)
