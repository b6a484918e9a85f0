"""A process kubelet for the single localkube node (plus the scheduling decision for it).

It binds pending pods to the node, gives each pod its own loopback address, and hands each pod to a ``PodWorker``
(``podworker.py``) that runs init containers then containers as local processes (``containers.py``: command, env,
process groups, log files, probes, restarts with a crash-loop back-off) and reports ``phase``, ``conditions`` and
``containerStatuses``. Deleting a pod runs ``preStop``, sends SIGTERM to the process group, waits the grace period,
sends SIGKILL and then removes the pod object. It also serves ``kubectl logs``. Container images are ignored:
processes run with the Python (and virtualenv) localkube runs with.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import random
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

from localkube import errors
from localkube.api import DeleteOptions
from localkube.errors import ApiError
from localkube.events import EventRecorder
from localkube.meta import clone, rfc3339
from localkube.podworker import PodWorker
from localkube.scheduler import fits
from localkube.services import KubeletHost
from localkube.store import DELETED, Event

log = logging.getLogger("localkube.kubelet")

PODS = ("", "pods")
NODES = ("", "nodes")


def listening_ips() -> set[str]:
    """IPv4 addresses that have a listening TCP socket on this machine (from /proc/net/tcp)."""
    found: set[str] = set()
    try:
        with open("/proc/net/tcp") as table:
            next(table)
            for line in table:
                fields = line.split()
                if len(fields) > 3 and fields[3] == "0A":
                    hex_ip = fields[1].split(":")[0]
                    found.add(str(ipaddress.IPv4Address(int.from_bytes(bytes.fromhex(hex_ip), "little"))))
    except (OSError, ValueError, StopIteration):
        pass
    return found


class IPAllocator:
    """Hands out pod addresses from a loopback subnet, round-robin, skipping addresses something listens on."""

    def __init__(self, subnet: str | None) -> None:
        if subnet is None:
            subnet = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.0/24"
        self.subnet = ipaddress.ip_network(subnet)
        if not isinstance(self.subnet, ipaddress.IPv4Network) or not self.subnet.subnet_of(
            ipaddress.IPv4Network("127.0.0.0/8")
        ):
            raise ValueError(f"pod subnet {subnet} must lie in 127.0.0.0/8")
        hosts = [str(h) for h in self.subnet.hosts()]
        self._hosts = [h for h in hosts[1:] if h != "127.0.0.1"] or hosts  # .1 stays free, as a gateway's would
        self._in_use: set[str] = set()
        self._next = 0

    def allocate(self, preferred: str | None = None) -> str:
        if preferred and preferred in self._hosts and preferred not in self._in_use:
            self._in_use.add(preferred)
            return preferred
        busy = listening_ips()
        for _ in range(len(self._hosts)):
            ip = self._hosts[self._next % len(self._hosts)]
            self._next += 1
            if ip not in self._in_use and ip not in busy:
                self._in_use.add(ip)
                return ip
        raise RuntimeError(f"no free pod address left in {self.subnet}")

    def release(self, ip: str | None) -> None:
        self._in_use.discard(ip)


class Kubelet:
    def __init__(self, kube: KubeletHost) -> None:
        self.kube = kube
        self.node_name = kube.options.node_name
        self.backoff = kube.options.restart_backoff
        self.ips = IPAllocator(kube.options.pod_subnet)
        root = kube.options.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / f"localkube-{os.getpid()}"
        self.log_root = Path(root) / "pods"
        self.pod_rt = kube.registry.builtin("", "v1", "pods")
        self.recorder = EventRecorder(kube, "kubelet", self.node_name)
        self.scheduler_events = EventRecorder(kube, "default-scheduler")
        self.workers: dict[tuple[str, str], PodWorker] = {}
        self.session: aiohttp.ClientSession | None = None
        self._dirty: set[tuple[str, str]] = set()
        self._unschedulable: set[tuple[str, str]] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._retired: set[PodWorker] = set()
        kube.store.add_listener(self._on_event)

    # ----------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))
        for pod in self.kube.store.list(PODS):
            self._dirty.add((pod["metadata"]["namespace"], pod["metadata"]["name"]))
        self._wake.set()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="localkube-kubelet")

    async def stop(self, grace_cap: float = 5.0) -> None:
        """Stop every pod process (the node shuts down; pod objects stay)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        workers = list(self.workers.values()) + list(self._retired)
        for worker in workers:
            grace = min(float((worker.pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)), grace_cap)
            worker.gone = True  # node shutdown: keep the objects as they are
            worker.request_termination(grace, delete_object=False)
        await asyncio.gather(*(w.wait_stopped() for w in workers), return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    # ---------------------------------------------------------------------------------------------- sync

    def _on_event(self, event: Event) -> None:
        if event.storage != PODS:
            return
        meta = event.obj["metadata"]
        self._dirty.add((meta["namespace"], meta["name"]))
        phase = (event.obj.get("status") or {}).get("phase")
        if event.type == DELETED or phase in ("Succeeded", "Failed"):
            self._dirty |= self._unschedulable
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            for key in sorted(dirty):
                try:
                    self._sync(key)
                except Exception:
                    log.exception("kubelet sync of %s/%s failed", *key)

    def _sync(self, key: tuple[str, str]) -> None:
        pod = self.kube.store.get(PODS, *key)
        worker = self.workers.get(key)
        if worker is not None and (pod is None or pod["metadata"]["uid"] != worker.uid):
            self._retire(worker)
            worker = None
        if pod is None:
            self._unschedulable.discard(key)
            return
        spec = pod.get("spec") or {}
        node = spec.get("nodeName")
        if not node:
            self._schedule(key, pod)
            return
        self._unschedulable.discard(key)
        if node != self.node_name:
            return
        meta = pod["metadata"]
        if worker is None:
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed"):
                if meta.get("deletionTimestamp"):
                    self._finish_terminal(pod)
                return
            worker = PodWorker(self, pod)
            self.workers[key] = worker
            if meta.get("deletionTimestamp"):
                worker.request_termination(0, delete_object=True)
                return
            worker.start()
        worker.pod = pod
        if spec.get("readinessGates"):
            worker.publish()  # a gate's condition may have changed: Ready follows it
        if meta.get("deletionTimestamp"):
            worker.request_termination(float(meta.get("deletionGracePeriodSeconds") or 0), delete_object=True)

    def _retire(self, worker: PodWorker) -> None:
        """The pod object is gone (force deletion): stop its processes quickly."""
        del self.workers[(worker.namespace, worker.name)]
        worker.gone = True
        grace = min(float((worker.pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)), 2.0)
        worker.request_termination(grace, delete_object=False)
        self._retired.add(worker)
        task = worker._terminate_task
        assert task is not None  # request_termination started it
        task.add_done_callback(lambda _t: self._retired.discard(worker))

    def _finish_terminal(self, pod: dict) -> None:
        try:
            self.kube.core.delete(
                self.pod_rt,
                pod["metadata"]["namespace"],
                pod["metadata"]["name"],
                DeleteOptions(grace_period=0, precondition_uid=pod["metadata"]["uid"]),
            )
        except ApiError:
            pass

    def _schedule(self, key: tuple[str, str], pod: dict) -> None:
        spec = pod.get("spec") or {}
        if spec.get("schedulerName", "default-scheduler") != "default-scheduler" or pod["metadata"].get(
            "deletionTimestamp"
        ):
            return
        if spec.get("schedulingGates"):
            self._mark_unschedulable(
                key, pod, "SchedulingGated", "Scheduling is blocked due to non-empty scheduling gates"
            )
            return
        node = self.kube.store.get(NODES, "", self.node_name)
        if node is None:
            return
        bound = [
            p
            for p in self.kube.store.list(PODS)
            if (p.get("spec") or {}).get("nodeName") == self.node_name
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        fit = fits(pod, node, bound)
        if not fit.ok:
            self._mark_unschedulable(key, pod, "Unschedulable", fit.message)
            self.scheduler_events.record(pod, "Warning", "FailedScheduling", fit.message)
            return
        self._unschedulable.discard(key)
        bound_pod = self.kube.assign_node(pod, self.node_name)
        self.scheduler_events.record(
            bound_pod, "Normal", "Scheduled", f"Successfully assigned {key[0]}/{key[1]} to {self.node_name}"
        )

    def _mark_unschedulable(self, key, pod: dict, reason: str, message: str) -> None:
        self._unschedulable.add(key)
        new = clone(pod)
        status = new.setdefault("status", {})
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        old = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
        if old is not None and old.get("reason") == reason and old.get("message") == message:
            return
        conditions.append(
            {
                "type": "PodScheduled",
                "status": "False",
                "lastProbeTime": None,
                "lastTransitionTime": rfc3339(),
                "reason": reason,
                "message": message,
            }
        )
        status["conditions"] = conditions
        self.kube.core.put_system(self.pod_rt, new)

    # --------------------------------------------------------------------------------------------- helpers

    def lookup(self, storage):
        def get(namespace: str, name: str) -> dict | None:
            return self.kube.store.get(storage, namespace, name)

        return get

    def node_capacity(self) -> dict:
        node = self.kube.store.get(NODES, "", self.node_name) or {}
        return (node.get("status") or {}).get("capacity") or {}

    def base_env(self, pod: dict) -> dict[str, str]:
        """The host environment a container inherits, with the localkube additions."""
        env = dict(os.environ)
        bin_dir = os.path.dirname(sys.executable)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        meta = pod["metadata"]
        env["HOSTNAME"] = meta["name"]
        env["LOCALKUBE_POD_NAME"] = meta["name"]
        env["LOCALKUBE_POD_NAMESPACE"] = meta["namespace"]
        env["LOCALKUBE_POD_IP"] = (pod.get("status") or {}).get("podIP") or self._ip_of(pod) or ""
        env["KUBERNETES_SERVICE_HOST"] = self.kube.options.host
        env["KUBERNETES_SERVICE_PORT"] = str(self.kube.port)
        if self.kube.options.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kube.options.kubeconfig)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _ip_of(self, pod: dict) -> str | None:
        worker = self.workers.get((pod["metadata"]["namespace"], pod["metadata"]["name"]))
        return worker.ip if worker is not None else None

    def log_path(self, pod: dict, container: str, instance: int) -> Path:
        meta = pod["metadata"]
        return self.log_root / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container / f"{instance}.log"

    # ----------------------------------------------------------------------------------------------- logs

    async def stream_log(self, pod: dict, request: web.Request) -> web.StreamResponse:
        query = request.query
        spec = pod.get("spec") or {}
        names = [c["name"] for c in spec.get("containers") or []]
        init_names = [c["name"] for c in spec.get("initContainers") or []]
        name = query.get("container")
        pod_name = pod["metadata"]["name"]
        if not name:
            if len(names) != 1:
                raise errors.bad_request(
                    f"a container name must be specified for pod {pod_name}, choose one of: [{' '.join(names)}]"
                    + (f" or one of the init containers: [{' '.join(init_names)}]" if init_names else "")
                )
            name = names[0]
        if name not in names + init_names:
            raise errors.bad_request(f"container {name} is not valid for pod {pod_name}")
        worker = self.workers.get((pod["metadata"]["namespace"], pod_name))
        if worker is not None and worker.uid != pod["metadata"]["uid"]:
            worker = None
        runner = None
        if worker is not None:
            runner = next((r for r in worker.init_runners + worker.runners if r.name == name), None)
        previous = query.get("previous", "").lower() in ("1", "true")
        status: dict = next(
            (
                s
                for s in ((pod.get("status") or {}).get("containerStatuses") or [])
                + ((pod.get("status") or {}).get("initContainerStatuses") or [])
                if s.get("name") == name
            ),
            {},
        )
        instance = runner.instance if runner is not None else int(status.get("restartCount") or 0)
        if previous:
            instance -= 1
            if instance < 0:
                raise errors.bad_request(f'previous terminated container "{name}" in pod "{pod_name}" not found')
        path = self.log_path(pod, name, instance)
        if not path.exists():
            waiting = ((status.get("state") or {}).get("waiting") or {}).get("reason", "ContainerCreating")
            raise errors.bad_request(f'container "{name}" in pod "{pod_name}" is waiting to start: {waiting}')
        follow = query.get("follow", "").lower() in ("1", "true") and not previous
        data = path.read_bytes()
        if query.get("tailLines"):
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(query["tailLines"]) :]) if int(query["tailLines"]) > 0 else b""
        limit = int(query["limitBytes"]) if query.get("limitBytes") else None
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        sent = 0
        chunk = data if limit is None else data[:limit]
        if chunk:
            await response.write(chunk)
            sent += len(chunk)
        if follow:
            offset = path.stat().st_size
            while limit is None or sent < limit:
                size = path.stat().st_size if path.exists() else offset
                if size > offset:
                    with open(path, "rb") as handle:
                        handle.seek(offset)
                        more = handle.read(size - offset)
                    offset = size
                    if limit is not None:
                        more = more[: limit - sent]
                    await response.write(more)
                    sent += len(more)
                    continue
                alive = (
                    runner is not None
                    and runner.instance == instance
                    and runner.proc is not None
                    and (self.workers.get((pod["metadata"]["namespace"], pod_name)) is worker)
                )
                if not alive:
                    break
                await asyncio.sleep(0.1)
        await response.write_eof()
        return response
