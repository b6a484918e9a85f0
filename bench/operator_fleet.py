"""Control-plane latency of the operator: from `kubectl apply` to all pods created, and to `Available=True`.

Why it exists: issue 6 asks how fast the operator turns InferenceDeployments into pods, alone and with many at
once. It starts localkube (API server + process kubelet) in this process, installs the CRD, runs the real
operator (`llmfleet operator` subprocess), then for each round applies N InferenceDeployments in one
`kubectl apply` and polls the API (every 50 ms, bounded) until (a) every pod exists and (b) every deployment
reports `Available=True`. Worker pods run a stub command (a stdlib HTTP server that answers /health and /ready at
once and exits on SIGTERM) so the figures measure the control plane, not model loading. Rounds start once the
operator answers its liveness probe; between rounds the deployments are deleted and the bench waits until their
pods are gone.

    .venv/bin/python bench/operator_fleet.py                  # rounds of 1 and 50 deployments, 1 pod each
    .venv/bin/python bench/operator_fleet.py --counts 1 10 --replicas 2

It prints one line per round and, as its LAST line, one JSON object:
`{"rounds": [{"deployments": N, "pods": P, "apply_s": a, "pods_created_s": c, "available_s": v}, ...]}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from fleet_operator.kube import KubeApi, load_credentials, namespaced

from crds.models import GROUP, PLURAL, VERSION
from llmfleet.processes import free_ports

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NAMESPACE = "bench"
POLL_S = 0.05

# The stub worker: binds $POD_IP:--port, answers 200 to everything, exits on SIGTERM. Stdlib only.
STUB = "\n".join(
    [
        "import http.server, os, signal, sys",
        "port = int(sys.argv[sys.argv.index('--port') + 1]) if '--port' in sys.argv else 8000",
        "class H(http.server.BaseHTTPRequestHandler):",
        "    def do_GET(self):",
        "        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers()",
        "        self.wfile.write(b'{}')",
        "    do_POST = do_GET",
        "    def log_message(self, *a): pass",
        "server = http.server.ThreadingHTTPServer((os.environ.get('POD_IP', '127.0.0.1'), port), H)",
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))",
        "server.serve_forever()",
    ]
)


def manifests(count: int, replicas: int) -> str:
    docs = [
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceDeployment",
            "metadata": {"name": f"bench-{i}", "namespace": NAMESPACE},
            "spec": {
                "model": {"name": f"bench-{i}", "source": "bundled://smollm2-135m-instruct"},
                "replicas": replicas,
                "variants": [{"name": "default"}],
                "drain": {"timeoutSeconds": 1, "terminationGracePeriodSeconds": 3},
            },
        }
        for i in range(count)
    ]
    return yaml.safe_dump_all(docs)


async def poll_round(api: KubeApi, count: int, pods_wanted: int, started: float, timeout_s: float) -> dict[str, Any]:
    """Poll until all pods exist and all deployments are Available; times are seconds since `started`."""
    created_at = available_at = None
    for _ in range(int(timeout_s / POLL_S)):
        if created_at is None:
            pods = await api.list(namespaced(NAMESPACE, "pods"), "llmfleet.io/deployment")
            if len(pods) >= pods_wanted:
                created_at = time.monotonic() - started
        items = await api.list(namespaced(NAMESPACE, PLURAL, group=GROUP, version=VERSION))
        ready = sum(
            any(
                c.get("type") == "Available" and c.get("status") == "True"
                for c in (item.get("status") or {}).get("conditions") or []
            )
            for item in items
        )
        if created_at is not None and ready >= count:
            available_at = time.monotonic() - started
            break
        await asyncio.sleep(POLL_S)
    if available_at is None:
        raise SystemExit(f"round of {count} did not become Available within {timeout_s:.0f} s")
    return {"pods_created_s": round(created_at, 3), "available_s": round(available_at, 3)}


async def wait_empty(api: KubeApi, timeout_s: float) -> None:
    for _ in range(int(timeout_s / 0.2)):
        crs = await api.list(namespaced(NAMESPACE, PLURAL, group=GROUP, version=VERSION))
        pods = await api.list(namespaced(NAMESPACE, "pods"), "llmfleet.io/deployment")
        if not crs and not pods:
            return
        await asyncio.sleep(0.2)
    raise SystemExit(f"deployments of the previous round were not gone within {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 50], help="deployments per round")
    parser.add_argument("--replicas", type=int, default=1, help="pods per deployment")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per round")
    args = parser.parse_args()

    from localkube import Cluster

    workdir = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    with Cluster(kubeconfig=workdir / "kubeconfig", workdir=workdir / "state") as cluster:
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}

        def kubectl(*argv: str, stdin: str | None = None) -> None:
            subprocess.run(
                [str(BIN / "kubectl"), *argv],
                env=env,
                input=stdin,
                text=True,
                check=True,
                capture_output=True,
                timeout=600,
            )

        kubectl("apply", "--validate=false", "-f", str(REPO / "crds" / "inferencedeployment.yaml"))
        kubectl(
            "apply",
            "--validate=false",
            "-f",
            "-",
            stdin=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}),
        )
        health_port, metrics_port = free_ports(2)
        operator_env = {
            **env,
            "LLMFLEET_OPERATOR_LIVENESS_ENDPOINT": f"http://127.0.0.1:{health_port}/healthz",
            "LLMFLEET_OPERATOR_WORKER_COMMAND": json.dumps(["python3", "-c", STUB]),
            "LLMFLEET_OPERATOR_WORKER_CACHE_DIR": "",
            "LLMFLEET_OPERATOR_DELETION_RETRY_SECONDS": "0.5",
            "LLMFLEET_OPERATOR_INSECURE_EPHEMERAL_DRAIN_KEY": "true",  # a benchmark: no drain-key file to manage
            "LLMFLEET_OPERATOR_METRICS_PORT": str(metrics_port),
        }
        with open(workdir / "operator.log", "wb") as log:
            operator = subprocess.Popen(
                [str(BIN / "llmfleet"), "operator", "--namespace", NAMESPACE],
                env=operator_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_healthy(health_port, operator)
            rounds = asyncio.run(_rounds(cluster.kubeconfig, args, kubectl))
        finally:
            operator.terminate()
            operator.wait(60)
    print(json.dumps({"rounds": rounds}))


def _wait_healthy(port: int, operator: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Rounds start once the operator answers its liveness probe (its start-up is not part of the figures)."""
    for _ in range(int(timeout_s / 0.1)):
        if operator.poll() is not None:
            raise SystemExit("the operator exited during start-up; see its log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"the operator did not become healthy within {timeout_s:.0f} s")


async def _rounds(kubeconfig: Path, args: argparse.Namespace, kubectl: Any) -> list[dict[str, Any]]:
    api = KubeApi(load_credentials(str(kubeconfig)))
    rounds = []
    try:
        for count in args.counts:
            started = time.monotonic()
            await asyncio.to_thread(
                kubectl, "apply", "--validate=false", "-f", "-", stdin=manifests(count, args.replicas)
            )
            applied = time.monotonic() - started
            result = {"deployments": count, "pods": count * args.replicas, "apply_s": round(applied, 3)}
            result |= await poll_round(api, count, count * args.replicas, started, args.timeout)
            rounds.append(result)
            print(
                f"{count:3d} deployment(s), {result['pods']:3d} pod(s): kubectl apply {result['apply_s']:.2f} s, "
                f"all pods created {result['pods_created_s']:.2f} s, all Available {result['available_s']:.2f} s",
                flush=True,
            )
            await asyncio.to_thread(kubectl, "delete", PLURAL, "--all", "-n", NAMESPACE, "--wait=false")
            await wait_empty(api, args.timeout)
    finally:
        await api.aclose()
    return rounds


if __name__ == "__main__":
    main()
