"""One container of a pod as a local process: start, probes, restarts with back-off, stop, and its status.

The process runs ``command`` + ``args`` with the environment ``podenv`` builds, in its own process group (and with
``PR_SET_PDEATHSIG`` through ``setpriv`` when available, so it dies with localkube), writing stdout and stderr to a
log file per run. Startup, readiness and liveness probes run while it lives; ``stop`` runs ``preStop``, sends
SIGTERM to the group, waits until the pod's deadline and sends SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import aiohttp

from localkube.events import EventRecorder
from localkube.meta import clone, rfc3339
from localkube.podenv import ContainerConfigError, command_line, container_env
from localkube.probes import Result, kill_group, run_action, wait_process
from localkube.store import StorageKey

SECRETS = ("", "secrets")
CONFIGMAPS = ("", "configmaps")
_SETPRIV = shutil.which("setpriv")
_RESET_BACKOFF_AFTER = 600.0


class NodeServices(Protocol):
    """What a container runner asks of its kubelet (``Kubelet`` satisfies it)."""

    @property
    def recorder(self) -> EventRecorder: ...

    @property
    def session(self) -> aiohttp.ClientSession | None: ...

    @property
    def backoff(self) -> tuple[float, float]: ...

    def lookup(self, storage: StorageKey) -> Callable[[str, str], dict | None]: ...

    def node_capacity(self) -> dict: ...

    def base_env(self, pod: dict) -> dict[str, str]: ...

    def log_path(self, pod: dict, container: str, instance: int) -> Path: ...


class PodHost(Protocol):
    """What a container runner asks of the worker of its pod (``PodWorker`` satisfies it)."""

    @property
    def kubelet(self) -> NodeServices: ...

    @property
    def pod(self) -> dict: ...

    @property
    def uid(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def ip(self) -> str | None: ...

    @property
    def has_init(self) -> bool: ...

    def publish(self) -> None: ...


class ContainerRunner:
    """One container of one pod: its process, probes, restarts and status."""

    def __init__(self, worker: PodHost, spec: dict, init: bool) -> None:
        self.worker = worker
        self.spec = spec
        self.name = spec["name"]
        self.init = init
        self.restart_count = 0
        self.state: dict = {
            "waiting": {"reason": "PodInitializing" if init is False and worker.has_init else "ContainerCreating"}
        }
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
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": f"localkube://{self.spec.get('image', '')}",
            "ready": self.ready,
            "restartCount": self.restart_count,
            "started": self.started,
            "state": clone(self.state),
            "lastState": clone(self.last_state),
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
                self.state = {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off {delay:g}s restarting failed container={self.name} "
                        f"pod={self.worker.name}_{self.worker.namespace}({self.worker.uid})",
                    }
                }
                self._publish()
                kubelet.recorder.record(
                    self.worker.pod,
                    "Warning",
                    "BackOff",
                    "Back-off restarting failed container "
                    f"{self.name} in pod "
                    f"{self.worker.name}_{self.worker.namespace}({self.worker.uid})",
                    self._field_path(),
                )
                await self._pause(delay)
        self.done = True
        return self.exit_code if self.exit_code is not None else 0

    def _field_path(self) -> str:
        kind = "initContainers" if self.init else "containers"
        return f"spec.{kind}{{{self.name}}}"

    def _prepare(self) -> tuple[list[str], dict[str, str]]:
        kubelet = self.worker.kubelet
        pod = self.worker.pod
        defined = container_env(
            pod, self.spec, kubelet.lookup(SECRETS), kubelet.lookup(CONFIGMAPS), kubelet.node_capacity()
        )
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
            message = (
                f"failed to create containerd task: failed to create shim task: OCI runtime create failed: "
                f'exec: "{argv[0]}": executable file not found in $PATH'
            )
            log_path.write_text("")
            self.state = {
                "terminated": {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": message,
                    "startedAt": "1970-01-01T00:00:00Z",
                    "finishedAt": now,
                }
            }
            self._started_at = time.monotonic()
            self._publish()
            kubelet.recorder.record(self.worker.pod, "Warning", "Failed", f"Error: {message}", self._field_path())
            return 128
        cwd = (
            self.spec.get("workingDir")
            if self.spec.get("workingDir") and os.path.isdir(self.spec["workingDir"])
            else None
        )
        command = ([_SETPRIV, "--pdeathsig", "KILL", "--"] if _SETPRIV else []) + [executable or argv[0]] + argv[1:]
        with open(log_path, "ab") as out:
            try:
                self.proc = subprocess.Popen(
                    command,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                self.state = {
                    "terminated": {
                        "exitCode": 128,
                        "reason": "StartError",
                        "message": str(exc),
                        "startedAt": now,
                        "finishedAt": now,
                    }
                }
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
        kubelet.recorder.record(
            self.worker.pod,
            "Normal",
            "Pulled",
            f'Container image "{self.spec.get("image", "")}" already present on machine',
            self._field_path(),
        )
        kubelet.recorder.record(
            self.worker.pod, "Normal", "Created", f"Created container: {self.name}", self._field_path()
        )
        kubelet.recorder.record(
            self.worker.pod, "Normal", "Started", f"Started container {self.name}", self._field_path()
        )
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
        terminated = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": now,
            "finishedAt": finished,
            "containerID": self.container_id,
        }
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
        session = self.worker.kubelet.session
        assert session is not None  # the kubelet opens it before it starts any pod
        try:
            return await run_action(action, self.spec, self.worker.ip or "", self.env, timeout, session)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - a malformed probe or hook fails like a failing one; it must not stop the loop
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
        self.worker.kubelet.recorder.record(
            self.worker.pod, "Warning", "Unhealthy", f"{kind} probe failed: {result.message}", self._field_path()
        )

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
        pre_stop = (self.spec.get("lifecycle") or {}).get("preStop")
        if run_pre_stop and pre_stop:
            remaining = deadline - loop.time()
            if remaining > 0:
                result = await self._act(pre_stop, remaining)
                if not result.ok:
                    self.worker.kubelet.recorder.record(
                        self.worker.pod,
                        "Warning",
                        "FailedPreStopHook",
                        f"PreStopHook failed: {result.message}",
                        self._field_path(),
                    )
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
