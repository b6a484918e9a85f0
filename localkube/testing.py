"""Helpers for tests that drive a localkube ``Cluster`` with real clients (kubectl, kubernetes client).

Shared by the conformance suite and by other packages' end-to-end tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from localkube.cluster import Cluster

KUBECTL = Path(sys.executable).parent / "kubectl"


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy (bounded in time) and return that value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


class Kubectl:
    """Runs the real kubectl binary (the venv's, never the system one) against one cluster."""

    def __init__(self, cluster: Cluster, cache_dir: Path, binary: Path = KUBECTL) -> None:
        self.binary = Path(binary)
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "KUBECACHEDIR": str(cache_dir)}

    def run(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(self.binary), *args],
            input=input,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )  # the return code is checked below, with the output
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [str(self.binary), *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def __call__(self, *args: str, **kwargs) -> str:
        return self.run(*args, **kwargs).stdout

    def json(self, *args: str) -> dict:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def apply(self, manifest: dict | str, *extra: str) -> str:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self("apply", "-f", "-", *extra, input=text)
