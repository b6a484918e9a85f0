"""One localkube instance: store, registry, API semantics, controllers, kubelet, HTTP listener and persistence.

``LocalKube`` runs inside an asyncio event loop (``Cluster`` gives it its own thread; ``python -m localkube`` runs it
in the foreground). It bootstraps what every cluster has (namespaces ``default``, ``kube-system``, ``kube-public``,
``kube-node-lease``, the node, the ``kubernetes`` Service), registers CustomResourceDefinitions as they are
written, and answers the pod subresources that need the kubelet (``log``) or policy (``binding``, ``eviction``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
from pathlib import Path

from aiohttp import web

from localkube import errors
from localkube.api import ApiCore, DeleteOptions
from localkube.apiserver import SERVER_VERSION, ApiServer
from localkube.builtins import builtin_types
from localkube.controllers import CRDS, PDBS, Controllers, pod_is_ready
from localkube.custom import CRDStrategy, crd_resource_types
from localkube.errors import ApiError
from localkube.kubeconfig import write_kubeconfig
from localkube.kubelet import Kubelet
from localkube.meta import clone, rfc3339
from localkube.options import Options
from localkube.registry import Registry
from localkube.selectors import selector_from_object
from localkube.store import DELETED, Event, Store

log = logging.getLogger("localkube")
_SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class LocalKube:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.store = Store(options.event_log_size)
        self.registry = Registry()
        for rt in builtin_types(CRDStrategy()):
            self.registry.add(rt)
        self.core = ApiCore(self.store, self.registry)
        self.store.add_listener(self._on_event)
        self.http = ApiServer(self)
        self.controllers: Controllers | None = None
        self.kubelet: Kubelet | None = None
        self._runner: web.AppRunner | None = None
        self._state_dirty: asyncio.Event | None = None
        self._save_task: asyncio.Task | None = None
        self.port = 0

    # ------------------------------------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.port}"

    async def start(self) -> None:
        if self.options.state_file is not None and self.options.state_file.exists():
            self._load_state(self.options.state_file)
        self._bootstrap()
        self.controllers = Controllers(self)
        self.controllers.start()
        runner = web.AppRunner(
            self.http.app, handle_signals=False, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        site = web.TCPSite(runner, self.options.host, self.options.port)
        await site.start()
        self._runner = runner
        self.port = runner.addresses[0][1]
        self.http.server_address = f"{self.options.host}:{self.port}"
        self._bootstrap_kubernetes_service()
        if self.options.kubeconfig is not None:
            write_kubeconfig(self.options.kubeconfig, self.url)
        if self.options.state_file is not None:
            self._state_dirty = asyncio.Event()
            self._save_task = asyncio.get_running_loop().create_task(self._save_loop(), name="localkube-state")
        if self.options.kubelet:
            self.kubelet = Kubelet(self)
            await self.kubelet.start()
        log.info("localkube API server listening on %s", self.url)

    async def stop(self) -> None:
        if self.kubelet is not None:
            await self.kubelet.stop()
        if self.controllers is not None:
            await self.controllers.stop()
        self.store.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._save_task is not None:
            self._save_task.cancel()
            try:
                await self._save_task
            except asyncio.CancelledError:
                pass
            self._save_state()

    # ------------------------------------------------------------------------------------------- bootstrap

    def _bootstrap(self) -> None:
        ns_rt = self.registry.builtin("", "v1", "namespaces")
        for name in _SYSTEM_NAMESPACES:
            if self.store.get(ns_rt.storage, "", name) is None:
                self.core.create(ns_rt, "", {"metadata": {"name": name}})
        node_rt = self.registry.builtin("", "v1", "nodes")
        if self.store.get(node_rt.storage, "", self.options.node_name) is None:
            self.core.create(node_rt, "", self._node_object())

    def _node_object(self) -> dict:
        cpus = str(os.cpu_count() or 1)
        try:
            memory_kib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
        except (ValueError, OSError):
            memory_kib = 8 * 1024 * 1024
        capacity = {"cpu": cpus, "memory": f"{memory_kib}Ki", "pods": "110", "ephemeral-storage": "100Gi"}
        capacity.update(self.options.node_capacity)
        labels = {
            "kubernetes.io/hostname": self.options.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "beta.kubernetes.io/os": "linux",
            "beta.kubernetes.io/arch": "amd64",
        }
        labels.update(self.options.node_labels)
        now = rfc3339()

        def condition(kind: str, status: str, reason: str, message: str) -> dict:
            return {
                "type": kind,
                "status": status,
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
                "reason": reason,
                "message": message,
            }

        return {
            "metadata": {"name": self.options.node_name, "labels": labels},
            "spec": {"podCIDR": "127.0.0.0/8", "podCIDRs": ["127.0.0.0/8"]},
            "status": {
                "capacity": capacity,
                "allocatable": dict(capacity),
                "conditions": [
                    condition(
                        "MemoryPressure",
                        "False",
                        "KubeletHasSufficientMemory",
                        "kubelet has sufficient memory available",
                    ),
                    condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                    condition(
                        "PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"
                    ),
                    condition("Ready", "True", "KubeletReady", "localkube process kubelet is posting ready status"),
                ],
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.options.node_name},
                ],
                "nodeInfo": {
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                    "kernelVersion": platform.release(),
                    "osImage": "localkube (processes on the host)",
                    "containerRuntimeVersion": "localkube://processes",
                    "kubeletVersion": SERVER_VERSION["gitVersion"],
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            },
        }

    def _bootstrap_kubernetes_service(self) -> None:
        svc_rt = self.registry.builtin("", "v1", "services")
        ep_rt = self.registry.builtin("", "v1", "endpoints")
        self.core.put_system(
            svc_rt,
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": "kubernetes",
                    "namespace": "default",
                    "labels": {"component": "apiserver", "provider": "kubernetes"},
                },
                "spec": {
                    "type": "ClusterIP",
                    "clusterIP": "10.96.0.1",
                    "clusterIPs": ["10.96.0.1"],
                    "sessionAffinity": "None",
                    "ipFamilies": ["IPv4"],
                    "ipFamilyPolicy": "SingleStack",
                    "internalTrafficPolicy": "Cluster",
                    "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": self.port}],
                },
                "status": {"loadBalancer": {}},
            },
        )
        self.core.put_system(
            ep_rt,
            {
                "apiVersion": "v1",
                "kind": "Endpoints",
                "metadata": {"name": "kubernetes", "namespace": "default"},
                "subsets": [
                    {
                        "addresses": [{"ip": self.options.host}],
                        "ports": [{"name": "https", "port": self.port, "protocol": "TCP"}],
                    }
                ],
            },
        )

    # ------------------------------------------------------------------------------------------ CRD wiring

    def _on_event(self, event: Event) -> None:
        if event.storage == CRDS:
            self._register_crd(event)
        if self._state_dirty is not None:
            self._state_dirty.set()

    def _register_crd(self, event: Event) -> None:
        crd = event.obj
        spec = crd.get("spec") or {}
        storage = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
        self.registry.remove_storage(storage)
        if event.type == DELETED:
            self.store.close_watches(storage)
            return
        for rt in crd_resource_types(crd):
            self.registry.add(rt)

    # ---------------------------------------------------------------------------------------------- pods

    def bind_pod(self, namespace: str, name: str, binding: object) -> dict:
        if (
            not isinstance(binding, dict)
            or not isinstance(binding.get("target"), dict)
            or not binding["target"].get("name")
        ):
            raise errors.invalid("Binding", "", name, [errors.required_value("target.name")])
        pod_rt = self.registry.builtin("", "v1", "pods")
        pod = self.store.get(pod_rt.storage, namespace, name)
        if pod is None:
            raise errors.not_found("pods", "", name)
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            raise errors.conflict("pods/binding", "", name, f'pod {name} is already assigned to node "{node}"')
        self.assign_node(pod, binding["target"]["name"])
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def assign_node(self, pod: dict, node: str) -> dict:
        pod_rt = self.registry.builtin("", "v1", "pods")
        new = clone(pod)
        new["spec"]["nodeName"] = node
        status = new.setdefault("status", {})
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        conditions.insert(
            0, {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": rfc3339()}
        )
        status["conditions"] = conditions
        return self.core.put_system(pod_rt, new)

    def evict_pod(self, namespace: str, name: str, eviction: object, query) -> dict:
        pod_rt = self.registry.builtin("", "v1", "pods")
        pdb_rt = self.registry.builtin_storage(PDBS)
        pod = self.store.get(pod_rt.storage, namespace, name)
        if pod is None:
            raise errors.not_found("pods", "", name)
        options = (eviction or {}).get("deleteOptions") if isinstance(eviction, dict) else None
        terminal = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if not terminal and not pod["metadata"].get("deletionTimestamp"):
            for pdb in self.store.list(PDBS, namespace):
                selector = selector_from_object((pdb.get("spec") or {}).get("selector"))
                if selector is None or not selector.matches(pod["metadata"].get("labels")):
                    continue
                status = pdb.get("status") or {}
                healthy_enough = int(status.get("currentHealthy") or 0) >= int(status.get("desiredHealthy") or 0)
                if not pod_is_ready(pod) and healthy_enough:
                    continue
                if int(status.get("disruptionsAllowed") or 0) < 1:
                    raise ApiError(
                        429,
                        "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                        causes=[
                            errors.Cause(
                                "",
                                "DisruptionBudget",
                                f"The disruption budget {pdb['metadata']['name']} needs "
                                f"{status.get('desiredHealthy', 0)} healthy pods and has "
                                f"{status.get('currentHealthy', 0)} currently",
                            )
                        ],
                    )
                new = clone(pdb)
                new["status"]["disruptionsAllowed"] = int(status["disruptionsAllowed"]) - 1
                new["status"].setdefault("disruptedPods", {})[name] = rfc3339()
                self.core.put_system(pdb_rt, new)
        self.core.delete(pod_rt, namespace, name, DeleteOptions.from_body(options, query))
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    async def stream_log(self, pod: dict, request: web.Request) -> web.StreamResponse:
        if self.kubelet is None:
            raise errors.bad_request("this localkube runs without a kubelet; pod logs are not available")
        return await self.kubelet.stream_log(pod, request)

    # ------------------------------------------------------------------------------------------ persistence

    def _load_state(self, path: Path) -> None:
        data = json.loads(path.read_text())
        objects = [(tuple(s), o) for s, o in data.get("objects", [])]
        for storage, obj in objects:
            if storage == CRDS:
                self.store.load(storage, obj)
                for rt in crd_resource_types(obj):
                    self.registry.add(rt)
        for storage, obj in objects:
            if storage != CRDS:
                self.store.load(storage, obj)
        self.store.rv = int(data.get("resourceVersion", 0))
        self.store.compacted_rv = self.store.rv
        if self.options.pod_subnet is None and data.get("podSubnet"):
            self.options.pod_subnet = data["podSubnet"]  # pods keep their addresses across restarts
        log.info("loaded %d objects from %s", len(objects), path)

    def _save_state(self) -> None:
        path = self.options.state_file
        if path is None:
            return
        tmp = path.with_name(path.name + ".tmp")
        snapshot = self.store.snapshot()
        if self.kubelet is not None:
            snapshot["podSubnet"] = str(self.kubelet.ips.subnet)
        tmp.write_text(json.dumps(snapshot, separators=(",", ":")))
        os.replace(tmp, path)

    async def _save_loop(self) -> None:
        dirty = self._state_dirty
        assert dirty is not None  # start() creates it before this task
        while True:
            await dirty.wait()
            await asyncio.sleep(0.5)
            dirty.clear()
            try:
                self._save_state()
            except OSError:
                log.exception("could not save state to %s", self.options.state_file)
