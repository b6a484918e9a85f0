"""A process kubelet for the single localkube node (plus the scheduling decision for it).

It binds pending pods to the node, gives each pod its own loopback address, runs init containers then containers
as local processes (``command`` + ``args``, the pod's ``env``, each in its own process group, output to log files),
runs startup/readiness/liveness probes, restarts containers per ``restartPolicy`` with a crash-loop back-off, and
reports ``phase``, ``conditions`` and ``containerStatuses``. Deleting a pod runs ``preStop``, sends SIGTERM to the
process group, waits the grace period, sends SIGKILL and then removes the pod object. Container images are ignored:
processes run with the Python (and virtualenv) localkube runs with.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from localkube import errors
from localkube.api import DeleteOptions
from localkube.errors import ApiError
from localkube.events import EventRecorder
from localkube.meta import clone, rfc3339
from localkube.podenv import ContainerConfigError, command_line, container_env
from localkube.probes import Result, kill_group, run_action, wait_process
from localkube.scheduler import fits
from localkube.store import DELETED, Event

if TYPE_CHECKING:
    from localkube.server import LocalKube

log = logging.getLogger("localkube.kubelet")

PODS = ("", "pods")
NODES = ("", "nodes")
SECRETS = ("", "secrets")
CONFIGMAPS = ("", "configmaps")
_SETPRIV = shutil.which("setpriv")
_RESET_BACKOFF_AFTER = 600.0


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
        if not self.subnet.subnet_of(ipaddress.ip_network("127.0.0.0/8")):
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


def _condition(kind: str, ok: bool, previous: dict, reason: str = "", message: str = "") -> dict:
    status = "True" if ok else "False"
    old = previous.get(kind)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else rfc3339()
    cond = {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": since}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


class ContainerRunner:
    """One container of one pod: its process, probes, restarts and status."""

    def __init__(self, worker: PodWorker, spec: dict, init: bool) -> None:
        self.worker = worker
        self.spec = spec
        self.name = spec["name"]
        self.init = init
        self.restart_count = 0
        self.state: dict = {"waiting": {"reason": "PodInitializing" if init is False and worker.has_init else "ContainerCreating"}}
        self.last_state: dict = {}
        self.ready = False
        self.started = False
        self.ever_ran = False
        self.done = False
        self.exit_code: int | None = None
        self.proc: subprocess.Popen | None = None
        self.instance = -1
        self.container_id = ""
        self.env: dict[str, str] = {}
        self.stopping = False
        self.kill_reason = ""
        self._wake = asyncio.Event()
        self._exited: asyncio.Future | None = None
        self._probe_task: asyncio.Task | None = None
        self._started_at = 0.0

    # ---------------------------------------------------------------------------------------------- status

    def status(self) -> dict:
        status = {
            "name": self.name, "image": self.spec.get("image", ""),
            "imageID": f"localkube://{self.spec.get('image', '')}",
            "ready": self.ready, "restartCount": self.restart_count, "started": self.started,
            "state": clone(self.state), "lastState": clone(self.last_state),
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status

    @property
    def running(self) -> bool:
        return "running" in self.state

    def _publish(self) -> None:
        self.worker.publish()

    # ----------------------------------------------------------------------------------------------- loop

    def _restart_wanted(self, code: int) -> bool:
        policy = (self.worker.pod.get("spec") or {}).get("restartPolicy", "Always")
        if self.init:
            return policy != "Never" and code != 0
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    async def _pause(self, seconds: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass

    async def run(self) -> int:
        """Run until the container is finished for good (or the pod stops); returns the last exit code."""
        kubelet = self.worker.kubelet
        failures_in_row = 0
        while not self.stopping:
            try:
                argv, env = self._prepare()
            except (ContainerConfigError, ValueError) as exc:  # ValueError: a malformed quantity
                self.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                self._publish()
                kubelet.recorder.record(self.worker.pod, "Warning", "Failed", f"Error: {exc}", self._field_path())
                await self._pause(min(kubelet.backoff[1], max(kubelet.backoff[0], 1.0)))
                continue
            code = await self._run_process(argv, env)
            self.exit_code = code
            if self.stopping:
                break
            if not self._restart_wanted(code):
                self.done = True
                self._publish()
                return code
            ran_for = time.monotonic() - self._started_at
            failures_in_row = 0 if ran_for > _RESET_BACKOFF_AFTER else failures_in_row + 1
            base, cap = kubelet.backoff
            delay = 0.0 if failures_in_row <= 1 else min(cap, base * 2 ** (failures_in_row - 2))
            self.last_state = {"terminated": self.state.get("terminated", {})}
            self.restart_count += 1
            if delay > 0:
                self.state = {"waiting": {"reason": "CrashLoopBackOff",
                                          "message": f"back-off {delay:g}s restarting failed container={self.name} "
                                                     f"pod={self.worker.name}_{self.worker.namespace}({self.worker.uid})"}}
                self._publish()
                kubelet.recorder.record(self.worker.pod, "Warning", "BackOff",
                                        "Back-off restarting failed container " f"{self.name} in pod "
                                        f"{self.worker.name}_{self.worker.namespace}({self.worker.uid})", self._field_path())
                await self._pause(delay)
        self.done = True
        return self.exit_code if self.exit_code is not None else 0

    def _field_path(self) -> str:
        kind = "initContainers" if self.init else "containers"
        return f"spec.{kind}{{{self.name}}}"

    def _prepare(self) -> tuple[list[str], dict[str, str]]:
        kubelet = self.worker.kubelet
        pod = self.worker.pod
        defined = container_env(pod, self.spec, kubelet.lookup(SECRETS), kubelet.lookup(CONFIGMAPS), kubelet.node_capacity())
        argv = command_line(self.spec, defined)
        env = kubelet.base_env(pod)
        env.update(defined)
        self.env = env
        return argv, env

    async def _run_process(self, argv: list[str], env: dict[str, str]) -> int:
        kubelet = self.worker.kubelet
        self.instance += 1
        log_path = kubelet.log_path(self.worker.pod, self.name, self.instance)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        now = rfc3339()
        executable = shutil.which(argv[0], path=env.get("PATH"))
        if executable is None and not os.path.isfile(argv[0]):
            message = (f'failed to create containerd task: failed to create shim task: OCI runtime create failed: '
                       f'exec: "{argv[0]}": executable file not found in $PATH')
            log_path.write_text("")
            self.state = {"terminated": {"exitCode": 128, "reason": "StartError", "message": message,
                                         "startedAt": "1970-01-01T00:00:00Z", "finishedAt": now}}
            self._started_at = time.monotonic()
            self._publish()
            kubelet.recorder.record(self.worker.pod, "Warning", "Failed", f"Error: {message}", self._field_path())
            return 128
        cwd = self.spec.get("workingDir") if self.spec.get("workingDir") and os.path.isdir(self.spec["workingDir"]) else None
        command = ([_SETPRIV, "--pdeathsig", "KILL", "--"] if _SETPRIV else []) + [executable or argv[0]] + argv[1:]
        with open(log_path, "ab") as out:
            try:
                self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
            except OSError as exc:
                self.state = {"terminated": {"exitCode": 128, "reason": "StartError", "message": str(exc),
                                             "startedAt": now, "finishedAt": now}}
                self._publish()
                return 128
        proc = self.proc
        self._started_at = time.monotonic()
        self.container_id = f"localkube://{self.worker.uid[:8]}-{self.name}-{proc.pid}"
        self.ever_ran = True
        self.kill_reason = ""
        self.state = {"running": {"startedAt": now}}
        self.started = self.spec.get("startupProbe") is None
        self.ready = False
        kubelet.recorder.record(self.worker.pod, "Normal", "Pulled", f'Container image "{self.spec.get("image", "")}" already present on machine', self._field_path())
        kubelet.recorder.record(self.worker.pod, "Normal", "Created", f"Created container: {self.name}", self._field_path())
        kubelet.recorder.record(self.worker.pod, "Normal", "Started", f"Started container {self.name}", self._field_path())
        if not self.init:
            self._probe_task = asyncio.get_running_loop().create_task(self._probes())
        self._publish()
        self._exited = asyncio.ensure_future(wait_process(proc))
        try:
            code = await asyncio.shield(self._exited)
        finally:
            if self._probe_task is not None:
                self._probe_task.cancel()
                self._probe_task = None
        kill_group(proc.pid, signal.SIGKILL)  # the container is its process group: nothing outlives the main process
        self.proc = None
        self.ready = False
        finished = rfc3339()
        terminated = {"exitCode": code if code >= 0 else 128 - code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": now, "finishedAt": finished, "containerID": self.container_id}
        if code < 0:
            terminated["signal"] = -code
        if self.kill_reason:
            terminated["message"] = self.kill_reason
        self.state = {"terminated": terminated}
        self._publish()
        return terminated["exitCode"]

    # --------------------------------------------------------------------------------------------- probes

    async def _probes(self) -> None:
        startup = self.spec.get("startupProbe")
        if startup is not None:
            if not await self._probe_until(startup, "Startup"):
                return
            self.started = True
            self._publish()
        tasks = []
        readiness = self.spec.get("readinessProbe")
        liveness = self.spec.get("livenessProbe")
        if readiness is None:
            self.ready = True
            self._publish()
        else:
            tasks.append(self._readiness(readiness))
        if liveness is not None:
            tasks.append(self._liveness(liveness))
        if tasks:
            await asyncio.gather(*tasks)

    async def _wait_initial_delay(self, probe: dict) -> None:
        delay = float(probe.get("initialDelaySeconds") or 0) - (time.monotonic() - self._started_at)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _check(self, probe: dict) -> Result:
        return await self._act(probe, float(probe.get("timeoutSeconds") or 1))

    async def _act(self, action: dict, timeout: float) -> Result:
        try:
            return await run_action(action, self.spec, self.worker.ip or "", self.env, timeout, self.worker.kubelet.session)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # a malformed probe or hook fails like a failing one; it must not stop the loop
            return Result(False, f"error: {exc}")

    async def _probe_until(self, probe: dict, kind: str) -> bool:
        await self._wait_initial_delay(probe)
        failures = 0
        threshold = int(probe.get("failureThreshold") or 3)
        while True:
            result = await self._check(probe)
            if result.ok:
                return True
            failures += 1
            self._unhealthy(kind, result)
            if failures >= threshold:
                await self._kill_for(f"Container {self.name} failed {kind.lower()} probe, will be restarted")
                return False
            await asyncio.sleep(float(probe.get("periodSeconds") or 10))

    async def _readiness(self, probe: dict) -> None:
        await self._wait_initial_delay(probe)
        successes = failures = 0
        need_ok = int(probe.get("successThreshold") or 1)
        need_fail = int(probe.get("failureThreshold") or 3)
        while True:
            result = await self._check(probe)
            if result.ok:
                successes, failures = successes + 1, 0
                if not self.ready and successes >= need_ok:
                    self.ready = True
                    self._publish()
            else:
                successes, failures = 0, failures + 1
                self._unhealthy("Readiness", result)
                if self.ready and failures >= need_fail:
                    self.ready = False
                    self._publish()
            await asyncio.sleep(float(probe.get("periodSeconds") or 10))

    async def _liveness(self, probe: dict) -> None:
        await self._wait_initial_delay(probe)
        failures = 0
        threshold = int(probe.get("failureThreshold") or 3)
        while True:
            result = await self._check(probe)
            if result.ok:
                failures = 0
            else:
                failures += 1
                self._unhealthy("Liveness", result)
                if failures >= threshold:
                    await self._kill_for(f"Container {self.name} failed liveness probe, will be restarted")
                    return
            await asyncio.sleep(float(probe.get("periodSeconds") or 10))

    def _unhealthy(self, kind: str, result: Result) -> None:
        self.worker.kubelet.recorder.record(self.worker.pod, "Warning", "Unhealthy", f"{kind} probe failed: {result.message}", self._field_path())

    async def _kill_for(self, reason: str) -> None:
        proc = self.proc
        if proc is None:
            return
        self.kill_reason = reason
        self.ready = False
        self._publish()
        self.worker.kubelet.recorder.record(self.worker.pod, "Normal", "Killing", reason, self._field_path())
        grace = float((self.worker.pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
        kill_group(proc.pid, signal.SIGTERM)
        exited = self._exited
        if exited is not None:
            try:
                await asyncio.wait_for(asyncio.shield(exited), grace)
            except TimeoutError:
                kill_group(proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------------------------------------- stopping

    async def stop(self, deadline: float, run_pre_stop: bool) -> None:
        """preStop, SIGTERM, wait until ``deadline`` (loop time), SIGKILL."""
        self.stopping = True
        self._wake.set()
        if self._probe_task is not None:
            self._probe_task.cancel()
        proc = self.proc
        if proc is None:
            return
        loop = asyncio.get_running_loop()
        pre_stop = ((self.spec.get("lifecycle") or {}).get("preStop"))
        if run_pre_stop and pre_stop:
            remaining = deadline - loop.time()
            if remaining > 0:
                result = await self._act(pre_stop, remaining)
                if not result.ok:
                    self.worker.kubelet.recorder.record(self.worker.pod, "Warning", "FailedPreStopHook",
                                                        f"PreStopHook failed: {result.message}", self._field_path())
        kill_group(proc.pid, signal.SIGTERM)
        exited = self._exited
        while exited is not None and not exited.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                kill_group(proc.pid, signal.SIGKILL)
                break
            try:
                await asyncio.wait_for(asyncio.shield(exited), min(remaining, 0.5))
            except TimeoutError:
                continue
        if exited is not None:
            await asyncio.shield(exited)


class PodWorker:
    """Everything the kubelet does for one pod (keyed by uid)."""

    def __init__(self, kubelet: Kubelet, pod: dict) -> None:
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
        reason = "" if containers_ready else ("PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady")
        gates = [g.get("conditionType") for g in (current.get("spec") or {}).get("readinessGates") or []]
        closed_gates = [g for g in gates if (previous.get(g) or {}).get("status") != "True"]
        ready = containers_ready and not closed_gates
        ready_reason, ready_message = reason, message
        if containers_ready and closed_gates:
            ready_reason = "ReadinessGatesNotReady"
            ready_message = f"corresponding condition of pod readiness gate {json.dumps(closed_gates[0])} does not exist."
        init_pending = [r.name for r in self.init_runners if not (r.done and r.exit_code == 0)]
        conditions = [
            _condition("PodReadyToStartContainers", self.ip is not None, previous),
            _condition("Initialized", self.initialized, previous,
                       "" if self.initialized else "ContainersNotInitialized",
                       "" if self.initialized else f"containers with incomplete status: [{' '.join(init_pending)}]"),
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
            self._terminate_task = loop.create_task(self._terminate(delete_object), name=f"stop-{self.namespace}/{self.name}")
        elif deadline < self.deadline:
            self.deadline = deadline

    async def _terminate(self, delete_object: bool) -> None:
        try:
            runners = self.init_runners + self.runners
            if any(r.proc is not None for r in runners):
                self.kubelet.recorder.record(self.pod, "Normal", "Killing", "Stopping container " + ", ".join(r.name for r in runners if r.proc is not None))
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
                    self.kubelet.kube.core.delete(self.kubelet.pod_rt, self.namespace, self.name,
                                                  DeleteOptions(grace_period=0, precondition_uid=self.uid))
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


class Kubelet:
    def __init__(self, kube: LocalKube) -> None:
        self.kube = kube
        self.node_name = kube.options.node_name
        self.backoff = kube.options.restart_backoff
        self.ips = IPAllocator(kube.options.pod_subnet)
        root = kube.options.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / f"localkube-{os.getpid()}"
        self.log_root = Path(root) / "pods"
        self.pod_rt = kube.registry.lookup("", "v1", "pods")
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
        worker._terminate_task.add_done_callback(lambda _t: self._retired.discard(worker))

    def _finish_terminal(self, pod: dict) -> None:
        try:
            self.kube.core.delete(self.pod_rt, pod["metadata"]["namespace"], pod["metadata"]["name"],
                                  DeleteOptions(grace_period=0, precondition_uid=pod["metadata"]["uid"]))
        except ApiError:
            pass

    def _schedule(self, key: tuple[str, str], pod: dict) -> None:
        spec = pod.get("spec") or {}
        if spec.get("schedulerName", "default-scheduler") != "default-scheduler" or pod["metadata"].get("deletionTimestamp"):
            return
        if spec.get("schedulingGates"):
            self._mark_unschedulable(key, pod, "SchedulingGated", "Scheduling is blocked due to non-empty scheduling gates")
            return
        node = self.kube.store.get(NODES, "", self.node_name)
        if node is None:
            return
        bound = [p for p in self.kube.store.list(PODS) if (p.get("spec") or {}).get("nodeName") == self.node_name
                 and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        fit = fits(pod, node, bound)
        if not fit.ok:
            self._mark_unschedulable(key, pod, "Unschedulable", fit.message)
            self.scheduler_events.record(pod, "Warning", "FailedScheduling", fit.message)
            return
        self._unschedulable.discard(key)
        bound_pod = self.kube.assign_node(pod, self.node_name)
        self.scheduler_events.record(bound_pod, "Normal", "Scheduled",
                                     f"Successfully assigned {key[0]}/{key[1]} to {self.node_name}")

    def _mark_unschedulable(self, key, pod: dict, reason: str, message: str) -> None:
        self._unschedulable.add(key)
        new = clone(pod)
        status = new.setdefault("status", {})
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        old = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
        if old is not None and old.get("reason") == reason and old.get("message") == message:
            return
        conditions.append({"type": "PodScheduled", "status": "False", "lastProbeTime": None,
                           "lastTransitionTime": rfc3339(), "reason": reason, "message": message})
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
                    + (f" or one of the init containers: [{' '.join(init_names)}]" if init_names else ""))
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
        status = next((s for s in ((pod.get("status") or {}).get("containerStatuses") or [])
                       + ((pod.get("status") or {}).get("initContainerStatuses") or []) if s.get("name") == name), {})
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
            data = b"".join(lines[-int(query["tailLines"]):]) if int(query["tailLines"]) > 0 else b""
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
                alive = runner is not None and runner.instance == instance and runner.proc is not None \
                    and (self.workers.get((pod["metadata"]["namespace"], pod_name)) is worker)
                if not alive:
                    break
                await asyncio.sleep(0.1)
        await response.write_eof()
        return response
