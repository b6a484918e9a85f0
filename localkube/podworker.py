"""Everything the kubelet does for one pod: its address, init containers, containers, status and termination."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Protocol

from localkube.api import DeleteOptions
from localkube.containers import ContainerRunner, NodeServices
from localkube.errors import ApiError
from localkube.meta import clone, rfc3339
from localkube.registry import ResourceType
from localkube.services import ClusterContext

log = logging.getLogger("localkube.kubelet")

PODS = ("", "pods")


class AddressPool(Protocol):
    def allocate(self, preferred: str | None = None) -> str: ...

    def release(self, ip: str | None) -> None: ...


class KubeletServices(NodeServices, Protocol):
    """What a pod worker asks of its kubelet, beyond what its containers ask (``Kubelet`` satisfies it)."""

    @property
    def kube(self) -> ClusterContext: ...

    @property
    def ips(self) -> AddressPool: ...

    @property
    def pod_rt(self) -> ResourceType: ...


def _condition(kind: str, ok: bool, previous: dict, reason: str = "", message: str = "") -> dict:
    status = "True" if ok else "False"
    old = previous.get(kind)
    since = (
        old["lastTransitionTime"]
        if old and old.get("status") == status and old.get("lastTransitionTime")
        else rfc3339()
    )
    cond = {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": since}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


class PodWorker:
    """Everything the kubelet does for one pod (keyed by uid)."""

    def __init__(self, kubelet: KubeletServices, pod: dict) -> None:
        self.kubelet = kubelet
        self.pod = pod
        meta = pod["metadata"]
        self.uid, self.namespace, self.name = meta["uid"], meta["namespace"], meta["name"]
        spec = pod.get("spec") or {}
        self.has_init = bool(spec.get("initContainers"))
        self.init_runners = [ContainerRunner(self, c, True) for c in spec.get("initContainers") or []]
        self.runners = [ContainerRunner(self, c, False) for c in spec.get("containers") or []]
        previous = {s.get("name"): s for s in (pod.get("status") or {}).get("containerStatuses") or []}
        for runner in self.runners:
            old = previous.get(runner.name)
            if old is not None and old.get("containerID"):
                runner.restart_count = int(old.get("restartCount") or 0) + 1  # node restart: containers start again
                runner.instance = runner.restart_count - 1
        self.ip: str | None = None
        self.initialized = not self.has_init
        self.init_failed = False
        self.terminating = False
        self.deadline = 0.0
        self.gone = False
        self._task: asyncio.Task | None = None
        self._terminate_task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"pod-{self.namespace}/{self.name}")

    async def _run(self) -> None:
        try:
            self.ip = self.kubelet.ips.allocate((self.pod.get("status") or {}).get("podIP"))
            self.publish()
            for runner in self.init_runners:
                code = await runner.run()
                if runner.stopping:
                    return
                if code != 0:
                    self.init_failed = True
                    self.publish()
                    return
            self.initialized = True
            self.publish()
            await asyncio.gather(*(r.run() for r in self.runners))
            self.publish()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod worker %s/%s failed", self.namespace, self.name)

    # -------------------------------------------------------------------------------------------- status

    def _phase(self) -> str:
        if self.init_failed:
            return "Failed"
        if not self.initialized:
            return "Pending"
        if self.runners and all(r.done and not r.stopping for r in self.runners):
            return "Succeeded" if all(r.exit_code == 0 for r in self.runners) else "Failed"
        if self.terminating and all(r.proc is None and r.ever_ran for r in self.runners):
            return "Succeeded" if all(r.exit_code == 0 for r in self.runners) else "Failed"
        if all(r.ever_ran for r in self.runners):
            return "Running"
        return "Pending"

    def build_status(self, current: dict) -> dict:
        status = clone(current.get("status") or {})
        previous = {c.get("type"): c for c in status.get("conditions") or []}
        phase = self._phase()
        not_ready = [r.name for r in self.runners if not r.ready]
        containers_ready = not not_ready and phase == "Running"
        message = f"containers with unready status: [{' '.join(not_ready)}]" if not_ready else ""
        reason = (
            "" if containers_ready else ("PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady")
        )
        gates = [g.get("conditionType") for g in (current.get("spec") or {}).get("readinessGates") or []]
        closed_gates = [g for g in gates if (previous.get(g) or {}).get("status") != "True"]
        ready = containers_ready and not closed_gates
        ready_reason, ready_message = reason, message
        if containers_ready and closed_gates:
            ready_reason = "ReadinessGatesNotReady"
            ready_message = (
                f"corresponding condition of pod readiness gate {json.dumps(closed_gates[0])} does not exist."
            )
        init_pending = [r.name for r in self.init_runners if not (r.done and r.exit_code == 0)]
        conditions = [
            _condition("PodReadyToStartContainers", self.ip is not None, previous),
            _condition(
                "Initialized",
                self.initialized,
                previous,
                "" if self.initialized else "ContainersNotInitialized",
                "" if self.initialized else f"containers with incomplete status: [{' '.join(init_pending)}]",
            ),
            _condition("Ready", ready, previous, ready_reason, ready_message),
            _condition("ContainersReady", containers_ready, previous, reason, message),
        ]
        if "PodScheduled" in previous:
            conditions.append(previous["PodScheduled"])
        ours = {c["type"] for c in conditions}
        conditions += [c for c in status.get("conditions") or [] if c.get("type") not in ours]  # set by others
        status["conditions"] = conditions
        status["phase"] = phase
        host = self.kubelet.kube.options.host
        status["hostIP"] = host
        status["hostIPs"] = [{"ip": host}]
        if self.ip:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        status.setdefault("startTime", rfc3339())
        if self.init_runners:
            status["initContainerStatuses"] = [r.status() for r in self.init_runners]
        status["containerStatuses"] = [r.status() for r in self.runners]
        return status

    def publish(self) -> None:
        if self.gone:
            return
        current = self.kubelet.kube.store.get(PODS, self.namespace, self.name)
        if current is None or current["metadata"]["uid"] != self.uid:
            return
        new = clone(current)
        new["status"] = self.build_status(current)
        self.kubelet.kube.core.put_system(self.kubelet.pod_rt, new)

    # ---------------------------------------------------------------------------------------- termination

    def request_termination(self, grace: float, delete_object: bool) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if self._terminate_task is None:
            self.deadline = deadline
            self.terminating = True
            self._terminate_task = loop.create_task(
                self._terminate(delete_object), name=f"stop-{self.namespace}/{self.name}"
            )
        elif deadline < self.deadline:
            self.deadline = deadline

    async def _terminate(self, delete_object: bool) -> None:
        try:
            runners = self.init_runners + self.runners
            if any(r.proc is not None for r in runners):
                self.kubelet.recorder.record(
                    self.pod,
                    "Normal",
                    "Killing",
                    "Stopping container " + ", ".join(r.name for r in runners if r.proc is not None),
                )
            await asyncio.gather(*(self._stop_runner(r) for r in runners))
            if self._task is not None and not self._task.done():
                self._task.cancel()
                try:
                    await self._task
                except asyncio.CancelledError:
                    pass
            for runner in runners:
                runner.ready = False
            self.publish()
            if delete_object and not self.gone:
                try:
                    self.kubelet.kube.core.delete(
                        self.kubelet.pod_rt,
                        self.namespace,
                        self.name,
                        DeleteOptions(grace_period=0, precondition_uid=self.uid),
                    )
                except ApiError as exc:
                    if exc.code not in (404, 409):
                        log.warning("could not remove pod %s/%s: %s", self.namespace, self.name, exc)
        finally:
            self.kubelet.ips.release(self.ip)

    async def _stop_runner(self, runner: ContainerRunner) -> None:
        await runner.stop(self.deadline, run_pre_stop=not self.gone)

    async def wait_stopped(self) -> None:
        if self._terminate_task is not None:
            await asyncio.shield(self._terminate_task)
