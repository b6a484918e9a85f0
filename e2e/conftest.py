"""The whole-system suite: one `LocalFleet` (localkube, Prometheus, operator, gateway) shared by the session.

Choices, for CI's 2-core budget (the suite should stay within a few minutes):
- One fleet for the session (`fleet`): starting localkube, Prometheus, the operator and the gateway costs ~10 s,
  so every scenario shares them and works in its own namespace (`ns`), with its own model name; the gateway and
  the operator watch all namespaces. Each scenario deletes its deployment when it ends.
- The real bundled model (SmolLM2-135M) serves where the answer matters: `test_e2e_up.py` runs `llmfleet up`
  (the `make demo` path: model pull, fleet, example, a streamed answer that must say "Paris"). Scenarios about the
  control plane (draining, canaries, restarts, autoscaling) run workers on the fake engine, chosen per deployment
  with `engine.extraArgs: {engine: fake}` (a later `--engine` flag wins), which start in about a second and stream
  at a set pace, so their figures measure the control plane rather than the CPU.
- Prometheus scrapes every second and the operator resyncs every 5 s; analysis intervals are 5 s (the minimum).

Every wait is bounded in polls and time and fails with what it saw last. Each scenario records the figures it
observed with the `figures` fixture; they are printed in the terminal summary (and with `-s` as they happen).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet_operator.drain_watch import DrainedPodRestarts

from llmfleet.kube import INFD, Kube
from llmfleet.localfleet import FleetSettings, LocalFleet
from llmfleet.progress import pod_ready

REPO = Path(__file__).resolve().parents[1]
E2E_DIR = Path(__file__).resolve().parent
# Fake engine: 50 ms to the first token, then 20 ms per token (a 24-token stream lasts about half a second).
FAKE_ENGINE = {"extraArgs": {"engine": "fake", "fake-ttft-ms": 50, "fake-itl-ms": 20}}
FIGURES = pytest.StashKey[list[tuple[str, str]]]()  # (test, line) in config.stash, printed in the summary


def pytest_configure(config: pytest.Config) -> None:
    config.stash[FIGURES] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("timeout") is None:  # a scenario may ask for more
                item.add_marker(pytest.mark.timeout(300))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    figures = config.stash.get(FIGURES, [])
    if figures:
        terminalreporter.section("e2e figures")
        for test, line in figures:
            terminalreporter.write_line(f"{test}: {line}")


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0, poll_s: float = 0.5) -> Any:
    """Poll until `predicate()` is truthy and return it; fail after `timeout_s` with the last value seen."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    for _ in range(int(timeout_s / poll_s) + 2):
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen: {last!r}"[:3000])


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[LocalFleet]:
    started = time.monotonic()
    settings = FleetSettings(
        work_dir=tmp_path_factory.mktemp("fleet"),
        scrape_interval_s=1,
        operator_resync_s=5,
        restart_backoff=(1.0, 5.0),
        gateway_settings={"seed": 1},
    )
    with LocalFleet(settings) as local:
        pytestconfig.stash[FIGURES].append(
            ("fleet", f"localkube + Prometheus + operator + gateway up in {time.monotonic() - started:.1f} s")
        )
        yield local
        local.check_running()  # no part died during the session


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    name = request.node.name

    def record(line: str) -> None:
        print(f"[figures] {name}: {line}", flush=True)
        request.config.stash[FIGURES].append((name, line))

    return record


class Scene:
    """One scenario's namespace on the shared fleet, with the helpers the scenarios use."""

    repo = REPO
    wait_until = staticmethod(wait_until)

    def __init__(self, fleet: LocalFleet, namespace: str) -> None:
        self.fleet = fleet
        self.kube: Kube = fleet.kube  # type: ignore[assignment]
        self.ns = namespace
        self.names: list[str] = []

    def deployment(self, name: str, replicas: int | None = 1, engine: dict | None = None, **spec: Any) -> dict:
        """A small InferenceDeployment on the fake engine with a fast drain."""
        body: dict[str, Any] = {
            "model": {"name": name, "source": "bundled://smollm2-135m-instruct"},
            "engine": engine or FAKE_ENGINE,
            "variants": [{"name": "default"}],
            "drain": {"timeoutSeconds": 10, "terminationGracePeriodSeconds": 15},
            **spec,
        }
        if replicas is not None:
            body["replicas"] = replicas
        return {
            "apiVersion": "llmfleet.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": body,
        }

    def apply(self, doc: dict) -> dict:
        if doc.get("kind") == "InferenceDeployment":
            self.names.append(doc["metadata"]["name"])
        return self.kube.apply(doc, self.ns)

    def infd(self, name: str) -> dict | None:
        return self.kube.infd(name, self.ns)

    def patch(self, name: str, patch: dict) -> dict:
        return self.kube.merge_patch(*INFD, name, patch, self.ns)

    def pods(self, name: str) -> list[dict]:
        return self.kube.pods(name, self.ns)

    def ready_pods(self, name: str) -> list[dict]:
        return [p for p in self.pods(name) if pod_ready(p)]

    def events(self, name: str) -> list[dict]:
        return self.kube.events(name, self.ns)

    def rollout(self, name: str) -> dict:
        return ((self.infd(name) or {}).get("status") or {}).get("rollout") or {}

    def settled(self, name: str, replicas: int) -> str | None:
        """The single revision of a settled deployment: Available, `replicas` ready pods of one revision, no drain
        left, rollout Stable. None otherwise."""
        resource = self.infd(name) or {}
        pods = self.pods(name)
        revisions = {p["metadata"]["labels"].get("llmfleet.io/revision") for p in pods}
        status = resource.get("status") or {}
        available = any(c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions") or [])
        ok = (
            available
            and len(pods) == replicas == sum(pod_ready(p) for p in pods)
            and len(revisions) == 1
            and not status.get("drains")
            and (status.get("rollout") or {}).get("phase", "Stable") == "Stable"
        )
        return next(iter(revisions)) if ok else None

    def watch_drains(self, name: str) -> DrainedPodRestarts:
        """`with scene.watch_drains(name) as watch:` sees every version of the deployment's pods (restartCount)."""
        return DrainedPodRestarts(self.fleet.kubeconfig, self.ns, name)

    def assert_drained_without_restarts(self, name: str, watch: DrainedPodRestarts, at_least: int) -> dict[str, int]:
        """Every pod marked draining kept restartCount 0 until it was deleted, and its DeletedPod Event says it
        drained (a worker that exits after draining is restarted by the kubelet, then deleted as unreachable)."""
        restarts = watch.drained()
        assert len(restarts) >= at_least, restarts
        assert {pod: n for pod, n in restarts.items() if n} == {}, f"drained pods restarted: {restarts}"
        deleted = {e["message"].split()[2]: e["message"] for e in self.events(name) if e["reason"] == "DeletedPod"}
        for pod in restarts:
            assert "drained: 0 in flight after" in deleted.get(pod, ""), (pod, deleted.get(pod))
        return restarts

    def cleanup(self) -> None:
        for name in self.names:
            try:
                self.kube.delete(*INFD, name, self.ns)
            except Exception:
                pass
        for name in self.names:
            try:
                wait_until(lambda n=name: self.infd(n) is None, f"{self.ns}/{name} deleted", timeout_s=40)
            except AssertionError:
                pass


@pytest.fixture
def scene(fleet: LocalFleet, request: pytest.FixtureRequest) -> Iterator[Scene]:
    namespace = ("e2e-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower().removeprefix("test_")))[:40].strip("-")
    fleet.ensure_namespace(namespace)
    current = Scene(fleet, namespace)
    try:
        yield current
    finally:
        current.cleanup()
