"""The control-plane controllers a real cluster runs next to its API server, reduced to what clients observe.

- garbage collector: ownerReference cascading (background and foreground), the ``orphan`` and
  ``foregroundDeletion`` finalizers, dangling references;
- namespace lifecycle: a deleted namespace empties itself, then disappears; each namespace gets a ``default``
  ServiceAccount;
- CRD cleanup: deleting a CRD deletes its custom resources first;
- endpoints: Endpoints and EndpointSlices for every Service with a selector, from the pods it selects;
- disruption: PodDisruptionBudget status (healthy pods, allowed disruptions), which the eviction API honours;
- event expiry: Events older than the TTL (one hour, as a real API server's default) are deleted.

They react to store events: each event marks work dirty and one task does the work shortly after, so bursts of
writes cost one pass. Every write goes through ``ApiCore`` and skips no-op writes, so passes converge.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
from typing import Any

from localkube.api import DeleteOptions
from localkube.custom import CLEANUP_FINALIZER
from localkube.errors import ApiError
from localkube.meta import clone, generate_suffix, parse_time, rfc3339, utcnow
from localkube.selectors import selector_from_map, selector_from_object
from localkube.services import ClusterContext
from localkube.store import DELETED, Event

log = logging.getLogger("localkube.controllers")

PODS = ("", "pods")
SERVICES = ("", "services")
ENDPOINTS = ("", "endpoints")
SLICES = ("discovery.k8s.io", "endpointslices")
PDBS = ("policy", "poddisruptionbudgets")
NAMESPACES = ("", "namespaces")
CRDS = ("apiextensions.k8s.io", "customresourcedefinitions")
EVENTS = ("", "events")
SERVICE_ACCOUNTS = ("", "serviceaccounts")
SLICE_MANAGER = "endpointslice-controller.k8s.io"
ENDPOINTS_MANAGER = "endpoint-controller"


def pod_is_ready(pod: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _resolve_port(pod: dict, target) -> int | None:
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return port.get("containerPort")
    return None


def _scaled(value, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        fraction = int(value[:-1]) * total / 100
        return math.ceil(fraction) if round_up else math.floor(fraction)
    return int(value)


class Controllers:
    def __init__(self, kube: ClusterContext) -> None:
        self.kube = kube
        self._wake = asyncio.Event()
        self._gc = True
        self._namespaces = True
        self._crds = True
        self._endpoint_ns: set[str] = set()
        self._pdb_ns: set[str] = set()
        self._task: asyncio.Task | None = None
        self._expiry: asyncio.Task | None = None
        kube.store.add_listener(self._on_event)

    # --------------------------------------------------------------------------------------------- dirtying

    def _on_event(self, event: Event) -> None:
        storage, obj = event.storage, event.obj
        if storage == EVENTS:
            return
        meta = obj["metadata"]
        ns = meta.get("namespace", "")
        if event.type == DELETED or meta.get("ownerReferences") or meta.get("deletionTimestamp"):
            self._gc = True
        if storage == NAMESPACES or meta.get("deletionTimestamp") or event.type == DELETED:
            self._namespaces = True
        if storage == CRDS:
            self._crds = True
        if storage in (PODS, SERVICES):
            self._endpoint_ns.add(ns)
        if storage in (PODS, PDBS):
            self._pdb_ns.add(ns)
        self._wake.set()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="localkube-controllers")
        self._expiry = loop.create_task(self._expire_events(), name="localkube-event-expiry")

    async def stop(self) -> None:
        for task in (self._task, self._expiry):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass

    async def _expire_events(self) -> None:
        ttl = self.kube.options.event_ttl
        while True:
            await asyncio.sleep(min(60.0, ttl / 2))
            try:
                self.expire_events(utcnow() - dt.timedelta(seconds=ttl))
            except Exception:
                log.exception("event expiry failed")

    def expire_events(self, older_than: dt.datetime) -> int:
        """Delete Events whose last activity is before ``older_than``; returns how many went."""
        expired = 0
        for event in self.kube.store.list(EVENTS):
            stamp = parse_time(
                event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp")
            )
            if stamp is not None and stamp < older_than:
                self._delete(EVENTS, event)
                expired += 1
        return expired

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(0.01)  # let a burst of writes land, then do one pass
            self._wake.clear()
            for step in (self._run_gc, self._run_namespaces, self._run_crds, self._run_endpoints, self._run_pdbs):
                try:
                    step()
                except Exception:  # a controller bug must not stop the others
                    log.exception("controller pass failed")

    # ------------------------------------------------------------------------------------ garbage collector

    def _rt(self, storage):
        return self.kube.registry.storage_type(storage)

    def _delete(self, storage, obj: dict, propagation: str = "Background") -> None:
        rt = self._rt(storage)
        if rt is None:
            return
        try:
            self.kube.core.delete(
                rt,
                obj["metadata"].get("namespace", ""),
                obj["metadata"]["name"],
                DeleteOptions(propagation=propagation),
            )
        except ApiError as exc:
            if exc.code != 404:
                log.warning(
                    "could not delete %s/%s: %s", obj["metadata"].get("namespace"), obj["metadata"]["name"], exc
                )

    def _put(self, storage, obj: dict) -> None:
        rt = self._rt(storage)
        if rt is not None:
            self.kube.core.put_system(rt, obj)

    def _run_gc(self) -> None:
        if not self._gc:
            return
        self._gc = False
        store = self.kube.store
        dependents: dict[str, list[tuple]] = {}
        everything = [(s, o) for s in store.storages() if s != EVENTS for o in store.list(s)]
        for storage, obj in everything:
            for ref in obj["metadata"].get("ownerReferences") or []:
                dependents.setdefault(ref.get("uid"), []).append((storage, obj))
        for storage, obj in everything:
            meta = obj["metadata"]
            finalizers = meta.get("finalizers") or []
            if meta.get("deletionTimestamp") and "orphan" in finalizers:
                self._orphan(meta["uid"], dependents.get(meta["uid"], []))
                self.kube.core.remove_finalizer(self._rt(storage), obj, "orphan")
        for storage, obj in everything:
            self._collect(storage, obj)
        for storage, obj in everything:
            meta = obj["metadata"]
            foreground = meta.get("deletionTimestamp") and "foregroundDeletion" in (meta.get("finalizers") or [])
            if foreground and not self._blocked(meta["uid"], dependents.get(meta["uid"], [])):
                self.kube.core.remove_finalizer(self._rt(storage), obj, "foregroundDeletion")

    def _blocked(self, owner_uid: str, deps: list[tuple]) -> bool:
        """Whether a dependent that blocks its owner's deletion still exists (deleting ones included)."""
        for storage, dep in deps:
            current = self.kube.store.get(storage, dep["metadata"].get("namespace", ""), dep["metadata"]["name"])
            if current is not None and any(
                r.get("uid") == owner_uid and r.get("blockOwnerDeletion")
                for r in current["metadata"].get("ownerReferences") or []
            ):
                return True
        return False

    def _orphan(self, owner_uid: str, deps: list[tuple]) -> None:
        for storage, dep in deps:
            current = self.kube.store.get(storage, dep["metadata"].get("namespace", ""), dep["metadata"]["name"])
            if current is None:
                continue
            new = clone(current)
            refs = [r for r in new["metadata"].get("ownerReferences") or [] if r.get("uid") != owner_uid]
            if refs:
                new["metadata"]["ownerReferences"] = refs
            else:
                new["metadata"].pop("ownerReferences", None)
            self._put(storage, new)

    def _collect(self, storage, obj: dict) -> None:
        store = self.kube.store
        current = store.get(storage, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if current is None:
            return
        meta = current["metadata"]
        refs = meta.get("ownerReferences") or []
        if not refs:
            return
        absent, waiting, solid = [], [], []
        for ref in refs:
            found = store.by_uid(ref.get("uid", ""))
            if found is None:
                absent.append(ref)
                continue
            owner_meta = found[1]["metadata"]
            if meta.get("namespace") and owner_meta.get("namespace") not in (None, "", meta.get("namespace")):
                absent.append(ref)  # a namespaced dependent cannot be owned from another namespace
            elif owner_meta.get("deletionTimestamp") and "foregroundDeletion" in (owner_meta.get("finalizers") or []):
                waiting.append(ref)
            else:
                solid.append(ref)
        if not absent and not waiting:
            return
        if solid:
            if absent:
                new = clone(current)
                new["metadata"]["ownerReferences"] = [r for r in refs if r not in absent]
                self._put(storage, new)
            return
        if meta.get("deletionTimestamp"):
            return
        self._delete(storage, current, "Foreground" if waiting else "Background")

    # ------------------------------------------------------------------------------------------ namespaces

    def _run_namespaces(self) -> None:
        if not self._namespaces:
            return
        self._namespaces = False
        store = self.kube.store
        for ns_obj in store.list(NAMESPACES):
            name = ns_obj["metadata"]["name"]
            if not ns_obj["metadata"].get("deletionTimestamp"):
                if store.get(SERVICE_ACCOUNTS, name, "default") is None:
                    self._put(
                        SERVICE_ACCOUNTS,
                        {
                            "apiVersion": "v1",
                            "kind": "ServiceAccount",
                            "metadata": {"name": "default", "namespace": name},
                        },
                    )
                continue
            remaining = 0
            for storage in store.storages():
                rt = self._rt(storage)
                if rt is None or not rt.namespaced:
                    continue
                for obj in store.list(storage, name):
                    remaining += 1
                    if not obj["metadata"].get("deletionTimestamp"):
                        self._delete(storage, obj)
            if remaining == 0:
                new = clone(ns_obj)
                new.setdefault("spec", {})["finalizers"] = []
                rt = self._rt(NAMESPACES)
                self.kube.core.update(rt, "", name, new, "finalize")

    # ------------------------------------------------------------------------------------------------ CRDs

    def _run_crds(self) -> None:
        if not self._crds:
            return
        self._crds = False
        store = self.kube.store
        for crd in store.list(CRDS):
            meta = crd["metadata"]
            if not meta.get("deletionTimestamp") or CLEANUP_FINALIZER not in (meta.get("finalizers") or []):
                continue
            spec = crd.get("spec") or {}
            storage = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
            instances = store.list(storage)
            for obj in instances:
                if not obj["metadata"].get("deletionTimestamp"):
                    self._delete(storage, obj)
            if not store.list(storage):
                self.kube.core.remove_finalizer(self._rt(CRDS), crd, CLEANUP_FINALIZER)
            else:
                self._crds = True  # finish once the instances' own finalizers are gone

    # ------------------------------------------------------------------------------------------- endpoints

    def _run_endpoints(self) -> None:
        namespaces, self._endpoint_ns = self._endpoint_ns, set()
        store = self.kube.store
        for ns in namespaces:
            services = {s["metadata"]["name"]: s for s in store.list(SERVICES, ns)}
            pods = store.list(PODS, ns)
            for service in services.values():
                selector = selector_from_map((service.get("spec") or {}).get("selector"))
                if selector is None:
                    continue
                selected = [
                    p
                    for p in pods
                    if selector.matches(p["metadata"].get("labels"))
                    and (p.get("status") or {}).get("podIP")
                    and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
                ]
                self._write_endpoints(service, selected)
                self._write_slice(service, selected)
            for ep in store.list(ENDPOINTS, ns):
                labels = ep["metadata"].get("labels") or {}
                if (
                    ep["metadata"]["name"] not in services
                    and labels.get("endpoints.kubernetes.io/managed-by") == ENDPOINTS_MANAGER
                ):
                    self._delete(ENDPOINTS, ep)
            for sl in store.list(SLICES, ns):
                labels = sl["metadata"].get("labels") or {}
                if (
                    labels.get("endpointslice.kubernetes.io/managed-by") == SLICE_MANAGER
                    and labels.get("kubernetes.io/service-name") not in services
                ):
                    self._delete(SLICES, sl)

    def _service_ports(self, service: dict, pod: dict) -> list[dict]:
        ports = []
        for port in (service.get("spec") or {}).get("ports") or []:
            target = _resolve_port(pod, port.get("targetPort", port.get("port")))
            if target is None:
                continue
            entry = {"port": target, "protocol": port.get("protocol", "TCP")}
            if port.get("name"):
                entry["name"] = port["name"]
            ports.append(entry)
        return ports

    def _write_endpoints(self, service: dict, pods: list[dict]) -> None:
        meta = service["metadata"]
        publish_not_ready = bool((service.get("spec") or {}).get("publishNotReadyAddresses"))
        groups: dict[str, dict] = {}
        for pod in sorted(pods, key=lambda p: p["status"]["podIP"]):
            ports = self._service_ports(service, pod)
            if (service.get("spec") or {}).get("ports") and not ports:
                continue  # none of the service's target ports exists on this pod
            key = repr(sorted((p.get("name", ""), p["port"], p["protocol"]) for p in ports))
            subset = groups.setdefault(key, {"addresses": [], "notReadyAddresses": [], "ports": ports})
            address = {
                "ip": pod["status"]["podIP"],
                "nodeName": (pod.get("spec") or {}).get("nodeName", ""),
                "targetRef": {
                    "kind": "Pod",
                    "namespace": pod["metadata"]["namespace"],
                    "name": pod["metadata"]["name"],
                    "uid": pod["metadata"]["uid"],
                },
            }
            terminating = bool(pod["metadata"].get("deletionTimestamp"))
            if (pod_is_ready(pod) or publish_not_ready) and not terminating:
                subset["addresses"].append(address)
            elif not terminating:
                subset["notReadyAddresses"].append(address)
        subsets = []
        for subset in groups.values():
            entry = {k: v for k, v in subset.items() if v}
            if entry.get("addresses") or entry.get("notReadyAddresses"):
                subsets.append(entry)
        current = self.kube.store.get(ENDPOINTS, meta["namespace"], meta["name"])
        labels = dict(meta.get("labels") or {})
        labels["endpoints.kubernetes.io/managed-by"] = ENDPOINTS_MANAGER
        if (
            current is not None
            and current.get("subsets", []) == subsets
            and current["metadata"].get("labels") == labels
        ):
            return
        new: dict[str, Any] = (
            clone(current)
            if current is not None
            else {
                "apiVersion": "v1",
                "kind": "Endpoints",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            }
        )
        new["metadata"]["labels"] = labels
        new["metadata"].setdefault("annotations", {})["endpoints.kubernetes.io/last-change-trigger-time"] = rfc3339()
        if subsets:
            new["subsets"] = subsets
        else:
            new.pop("subsets", None)
        self._put(ENDPOINTS, new)

    def _write_slice(self, service: dict, pods: list[dict]) -> None:
        meta = service["metadata"]
        store = self.kube.store
        existing = [
            s
            for s in store.list(SLICES, meta["namespace"])
            if (s["metadata"].get("labels") or {}).get("kubernetes.io/service-name") == meta["name"]
            and (s["metadata"].get("labels") or {}).get("endpointslice.kubernetes.io/managed-by") == SLICE_MANAGER
        ]
        endpoints = []
        ports: list[dict] = []
        for pod in sorted(pods, key=lambda p: p["status"]["podIP"]):
            if (service.get("spec") or {}).get("ports") and not self._service_ports(service, pod):
                continue
            ready = pod_is_ready(pod)
            terminating = bool(pod["metadata"].get("deletionTimestamp"))
            endpoints.append(
                {
                    "addresses": [pod["status"]["podIP"]],
                    "conditions": {"ready": ready and not terminating, "serving": ready, "terminating": terminating},
                    "nodeName": (pod.get("spec") or {}).get("nodeName", ""),
                    "targetRef": {
                        "kind": "Pod",
                        "namespace": pod["metadata"]["namespace"],
                        "name": pod["metadata"]["name"],
                        "uid": pod["metadata"]["uid"],
                    },
                }
            )
            if not ports:
                ports = self._service_ports(service, pod)
        labels = {"kubernetes.io/service-name": meta["name"], "endpointslice.kubernetes.io/managed-by": SLICE_MANAGER}
        owner = {
            "apiVersion": "v1",
            "kind": "Service",
            "name": meta["name"],
            "uid": meta["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        current = existing[0] if existing else None
        for extra in existing[1:]:
            self._delete(SLICES, extra)
        if current is not None and current.get("endpoints", []) == endpoints and current.get("ports", []) == ports:
            return
        new = (
            clone(current)
            if current is not None
            else {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "addressType": "IPv4",
                "metadata": {
                    "name": f"{meta['name']}-{generate_suffix()}",
                    "namespace": meta["namespace"],
                    "generateName": f"{meta['name']}-",
                    "labels": labels,
                    "ownerReferences": [owner],
                },
            }
        )
        new["endpoints"] = endpoints
        new["ports"] = ports
        self._put(SLICES, new)

    # ------------------------------------------------------------------------------------------ disruption

    def _run_pdbs(self) -> None:
        namespaces, self._pdb_ns = self._pdb_ns, set()
        store = self.kube.store
        for ns in namespaces:
            pods = store.list(PODS, ns)
            for pdb in store.list(PDBS, ns):
                self._write_pdb_status(pdb, pods)

    def _write_pdb_status(self, pdb: dict, pods: list[dict]) -> None:
        spec = pdb.get("spec") or {}
        selector = selector_from_object(spec.get("selector"))
        selected = [
            p
            for p in pods
            if selector is not None
            and selector.matches(p["metadata"].get("labels"))
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        expected = len(selected)
        healthy = sum(1 for p in selected if pod_is_ready(p) and not p["metadata"].get("deletionTimestamp"))
        if "minAvailable" in spec:
            desired = _scaled(spec["minAvailable"], expected, round_up=True)
        elif "maxUnavailable" in spec:
            desired = max(0, expected - _scaled(spec["maxUnavailable"], expected, round_up=True))
        else:
            desired = expected
        allowed = max(0, healthy - desired)
        status = dict(pdb.get("status") or {})
        status.update(
            {
                "observedGeneration": pdb["metadata"].get("generation", 1),
                "currentHealthy": healthy,
                "desiredHealthy": desired,
                "expectedPods": expected,
                "disruptionsAllowed": allowed,
            }
        )
        old_cond = next((c for c in status.get("conditions") or [] if c.get("type") == "DisruptionAllowed"), None)
        state = "True" if allowed > 0 else "False"
        if old_cond is None or old_cond.get("status") != state:
            status["conditions"] = [
                {
                    "type": "DisruptionAllowed",
                    "status": state,
                    "lastTransitionTime": rfc3339(),
                    "reason": "SufficientPods" if allowed > 0 else "InsufficientPods",
                    "message": "",
                    "observedGeneration": pdb["metadata"].get("generation", 1),
                }
            ]
        if status == pdb.get("status"):
            return
        new = clone(pdb)
        new["status"] = status
        self._put(PDBS, new)
