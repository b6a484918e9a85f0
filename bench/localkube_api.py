"""localkube figures: watch delivery latency, create throughput, and how fast the kubelet runs and stops pods.

    python bench/localkube_api.py [--objects 100] [--pods 50]

Creates ``--objects`` custom objects one by one while one watch, then ``--watchers`` watches are open (latency =
event received minus the moment the create request was sent), then ``--pods`` pods running ``sleep 3600`` (create throughput, time until all are
Ready, time until all are deleted). Every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from localkube import Cluster

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "benches.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"plural": "benches", "singular": "bench", "kind": "Bench"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}
TIME_LIMIT = 120.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def watch_latency(http: httpx.Client, url: str, count: int, watchers: int) -> dict:
    """Create ``count`` objects one by one while ``watchers`` watches are open; latency per (watch, object)."""
    base = f"{url}/apis/example.com/v1/namespaces/default/benches"
    rv = http.get(base).json()["metadata"]["resourceVersion"]
    received: list[dict[str, float]] = [{} for _ in range(watchers)]
    opened = threading.Barrier(watchers + 1, timeout=TIME_LIMIT)

    def follow(index: int) -> None:
        with (
            httpx.Client(timeout=None) as watcher,
            watcher.stream(
                "GET", base, params={"watch": "1", "resourceVersion": rv, "timeoutSeconds": str(int(TIME_LIMIT))}
            ) as stream,
        ):
            opened.wait()
            for line in stream.iter_lines():
                event = json.loads(line)
                if event["type"] == "ADDED":
                    received[index][event["object"]["metadata"]["name"]] = time.perf_counter()
                    if len(received[index]) >= count:
                        break

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(watchers)]
    for thread in threads:
        thread.start()
    opened.wait()
    sent: dict[str, float] = {}
    start = time.perf_counter()
    for n in range(count):
        name = f"b{n}"
        sent[name] = time.perf_counter()
        http.post(
            base, json={"apiVersion": "example.com/v1", "kind": "Bench", "metadata": {"name": name}, "spec": {"n": n}}
        ).raise_for_status()
        if time.perf_counter() - start > TIME_LIMIT:
            break
    elapsed = time.perf_counter() - start
    for thread in threads:
        thread.join(TIME_LIMIT)
    latencies = [(got[k] - sent[k]) * 1000 for got in received for k in sent if k in got]
    return {
        "created": len(sent),
        "create_per_s": len(sent) / elapsed,
        "delivered": len(latencies),
        "expected": len(sent) * watchers,
        "p50_ms": statistics.median(latencies),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": max(latencies),
    }


def pods(http: httpx.Client, url: str, count: int) -> dict:
    base = f"{url}/api/v1/namespaces/default/pods"
    start = time.perf_counter()
    for n in range(count):
        http.post(
            base,
            json={
                "metadata": {"name": f"sleep-{n}", "labels": {"bench": "yes"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{"name": "c", "image": "busybox", "command": ["sleep", "3600"]}],
                },
            },
        ).raise_for_status()
    created = time.perf_counter() - start

    def ready_count() -> int:
        items = http.get(base, params={"labelSelector": "bench=yes"}).json()["items"]
        return sum(
            1
            for p in items
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
        )

    deadline = time.perf_counter() + TIME_LIMIT
    while ready_count() < count and time.perf_counter() < deadline:
        time.sleep(0.05)
    all_ready = time.perf_counter() - start
    delete_start = time.perf_counter()
    http.request("DELETE", base, params={"labelSelector": "bench=yes"}).raise_for_status()
    while (
        http.get(base, params={"labelSelector": "bench=yes"}).json()["items"]
        and time.perf_counter() < deadline + TIME_LIMIT
    ):
        time.sleep(0.05)
    return {
        "pods": count,
        "create_per_s": count / created,
        "all_ready_s": all_ready,
        "all_deleted_s": time.perf_counter() - delete_start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=100)
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--watchers", type=int, default=20, help="concurrent watches on the custom objects")
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory() as tmp,
        Cluster(kubeconfig=Path(tmp) / "kc", workdir=Path(tmp)) as cluster,
        httpx.Client(timeout=30) as http,
    ):
        http.post(f"{cluster.url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=CRD).raise_for_status()
        for watchers in sorted({1, args.watchers}):
            w = watch_latency(http, cluster.url, args.objects, watchers)
            print(
                f"custom objects: {w['created']} created at {w['create_per_s']:.0f}/s (sequential HTTP) with "
                f"{watchers} watch(es) open; delivery p50 {w['p50_ms']:.2f} ms, p99 {w['p99_ms']:.2f} ms, "
                f"max {w['max_ms']:.2f} ms ({w['delivered']}/{w['expected']} events)"
            )
            http.request("DELETE", f"{cluster.url}/apis/example.com/v1/namespaces/default/benches").raise_for_status()
        p = pods(http, cluster.url, args.pods)
        print(
            f"pods: {p['pods']} created at {p['create_per_s']:.0f}/s; all Ready after {p['all_ready_s']:.2f} s; "
            f"all deleted (SIGTERM, grace) after {p['all_deleted_s']:.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
