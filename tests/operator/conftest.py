"""Integration harness: a localkube cluster with the CRD, the real operator (`llmfleet operator` subprocess) and
real `llmfleet worker` pods on the fake engine (starts in about a second: these tests measure the control plane).

Tests reach the helpers through fixtures (pytest runs with --import-mode=importlib: modules cannot import this
file by name). Every wait is bounded in time and in polls; a timeout fails with what was last seen.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from llmfleet.processes import free_ports

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
KUBECTL = str(BIN / "kubectl")
LLMFLEET = str(BIN / "llmfleet")


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0, poll_s: float = 0.25) -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout_s` with the last value seen."""
    last: Any = None
    for _ in range(int(timeout_s / poll_s) + 1):
        last = predicate()
        if last:
            return last
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen: {last!r}")


class Kube:
    """kubectl against the test cluster, in one namespace."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self.namespace = namespace

    def run(self, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [KUBECTL, "-n", self.namespace, *args],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def apply(self, manifest: dict[str, Any]) -> None:
        self.run("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(manifest))

    def get(self, kind: str, name: str | None = None, selector: str | None = None) -> Any:
        args = ["get", kind, *([name] if name else []), "-o", "json", *(["-l", selector] if selector else [])]
        result = self.run(*args, check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        data = json.loads(result.stdout)
        return data["items"] if name is None else data

    def pods(self, deployment: str) -> list[dict[str, Any]]:
        return self.get("pods", selector=f"llmfleet.io/deployment={deployment}") or []

    def events(self, deployment: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.get("events") or []
            if e.get("involvedObject", {}).get("kind") == "InferenceDeployment"
            and e["involvedObject"].get("name") == deployment
        ]


def ready_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pods that are Running, Ready and not being deleted."""
    return [
        p
        for p in pods
        if p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    ]


def condition(resource: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for entry in ((resource or {}).get("status") or {}).get("conditions") or []:
        if entry["type"] == kind:
            return entry
    return {}


def container_pids(pods: list[dict[str, Any]]) -> set[int]:
    """PIDs of the pods' worker processes (localkube's container ids end in the pid)."""
    pids = set()
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses") or []:
            container_id = status.get("containerID") or ""
            if container_id.startswith("localkube://"):
                pids.add(int(container_id.rsplit("-", 1)[1]))
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by localkube) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def deployment(name: str, replicas: int = 1, **spec: Any) -> dict[str, Any]:
    """A small InferenceDeployment for tests (fast drain so deletions finish quickly)."""
    return {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "source": "bundled://smollm2-135m-instruct"},
            "replicas": replicas,
            "variants": [{"name": "default"}],
            "drain": {"timeoutSeconds": 2, "terminationGracePeriodSeconds": 5},
            **spec,
        },
    }


class OperatorProcess:
    """`llmfleet operator` as a subprocess, restartable, logging to a file."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log_path = log_path
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        # The drain-token key, as the chart mounts it: one file kept across restarts of this operator.
        self.drain_key_file = log_path.with_name("drain.key")
        if not self.drain_key_file.exists():
            self.drain_key_file.write_text(secrets.token_urlsafe(32))

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "LLMFLEET_OPERATOR_WORKER_EXTRA_ARGS": "--engine fake",
            "LLMFLEET_OPERATOR_WORKER_CACHE_DIR": "",
            "LLMFLEET_OPERATOR_RESYNC_SECONDS": "5",
            "LLMFLEET_OPERATOR_DELETION_RETRY_SECONDS": "1",
            "LLMFLEET_OPERATOR_DRAIN_KEY_FILE": str(self.drain_key_file),
            **self.extra_env,
        }
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [LLMFLEET, "operator", "--namespace", self.namespace], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def kill(self) -> None:
        """SIGKILL: no cleanup, like a crashed or evicted operator pod."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
            self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def localkube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from localkube import Cluster

    workdir = tmp_path_factory.mktemp("localkube")
    with Cluster(kubeconfig=workdir / "kubeconfig", workdir=workdir / "state") as cluster:
        kube = Kube(cluster.kubeconfig, "default")
        kube.run("apply", "--validate=false", "-f", str(REPO / "crds" / "inferencedeployment.yaml"))
        yield cluster


@pytest.fixture
def fleet(localkube_cluster: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh namespace with its own operator process; yields helpers."""
    namespace = "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    admin = Kube(localkube_cluster.kubeconfig, "default")
    admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kube = Kube(localkube_cluster.kubeconfig, namespace)
    operator = OperatorProcess(localkube_cluster.kubeconfig, namespace, tmp_path / "operator.log")
    operator.start()
    helpers = type("Fleet", (), {})()
    helpers.kube, helpers.operator, helpers.namespace = kube, operator, namespace
    try:
        yield helpers
    finally:
        operator.stop()


@pytest.fixture
def kit() -> Any:
    return type(
        "Kit",
        (),
        {
            "wait_until": staticmethod(wait_until),
            "ready_pods": staticmethod(ready_pods),
            "condition": staticmethod(condition),
            "container_pids": staticmethod(container_pids),
            "alive": staticmethod(alive),
            "deployment": staticmethod(deployment),
            "OperatorProcess": OperatorProcess,
            "Kube": Kube,
        },
    )()


@pytest.fixture
def gateway(fleet: Any, localkube_cluster: Any, tmp_path: Path) -> Iterator[str]:
    """`llmfleet gateway` in Kubernetes mode for the test's namespace; yields its base URL."""
    port, metrics_port = free_ports(2)
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            LLMFLEET,
            "gateway",
            "--port",
            str(port),
            "--kubeconfig",
            str(localkube_cluster.kubeconfig),
            "--namespace",
            fleet.namespace,
            "--log-level",
            "warning",
            "--metrics-port",
            str(metrics_port),
            "--insecure-open-mode",
        ],  # these tests send no API key
        env={**os.environ},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise AssertionError(f"the gateway exited: {(tmp_path / 'gateway.log').read_text()[-2000:]}")
            time.sleep(0.25)
        else:
            raise AssertionError("the gateway did not come up")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(20)
        log.close()
