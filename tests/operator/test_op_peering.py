"""Two operator replicas with kopf peering (the chart's `operator.replicas: 2`): one works, one stands by, and the
standby takes over when the active one dies. Alertmanager's `POST /alerts` to the standby is a 503 that scales
nothing (Alertmanager retries, and the Service spreads retries over the replicas); to the active one it applies.
Each replica serves its /metrics on its own internal port, not on the /alerts port.

The peering CRD and the KopfPeering object come from the chart itself (`helm template` with peering enabled), so
this checks what a 2-replica install would run. The replicas get fixed priorities (20 active, 10 standby) and a
short keep-alive (LLMFLEET_OPERATOR_PEERING_LIFETIME_SECONDS=6) so the takeover happens within seconds.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from llmfleet.processes import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
PEERING = "llmfleet"
LIFETIME_S = 6
TOKEN = "peering-alerts-token"


def chart_peering_docs(namespace: str) -> list[dict[str, Any]]:
    """The kopf peering CRDs and this namespace's KopfPeering object, as the chart renders them."""
    helm = Path(sys.prefix) / "bin" / "helm"
    rendered = subprocess.run(
        [
            str(helm),
            "template",
            "llmfleet",
            str(REPO / "charts" / "llmfleet"),
            "--namespace",
            namespace,
            "--set",
            "operator.peering.enabled=true",
            "--set",
            "operator.replicaCount=2",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    wanted = [
        d
        for d in docs
        if d["kind"] in ("CustomResourceDefinition", "KopfPeering")
        and (d["kind"] != "CustomResourceDefinition" or d["spec"]["group"] == "kopf.dev")
    ]
    assert {d["kind"] for d in wanted} == {"CustomResourceDefinition", "KopfPeering"}, "chart renders no peering"
    return wanted


def whole_log(process: Any) -> str:
    return process.log_path.read_text(errors="replace")


def working(process: Any) -> bool:
    """kopf starts paused until peering says otherwise, then logs each change: "Resuming operations ..." when it
    may work, "Pausing operations ..." when a peer of higher priority shows up. The last one says where it is."""
    log = whole_log(process)
    return log.rfind("Resuming operations") > log.rfind("Pausing operations")


def exported(port: int) -> dict[str, float]:
    """The operator's `llmfleet_operator_active` and its summed `llmfleet_operator_replicas` of deployment "ha" from
    /metrics (on the metrics port)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = {"active": -1.0, "replicas": 0.0}
    for line in text.splitlines():
        if line.startswith("llmfleet_operator_active "):
            values["active"] = float(line.split()[-1])
        elif line.startswith("llmfleet_operator_replicas{") and 'deployment="ha"' in line:
            values["replicas"] += float(line.split()[-1])
    return values


def test_one_replica_works_the_standby_takes_over_when_it_dies(localkube_cluster, tmp_path, kit) -> None:
    namespace = "t-peering"
    admin = kit.Kube(localkube_cluster.kubeconfig, "default")
    admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kube = kit.Kube(localkube_cluster.kubeconfig, namespace)
    for doc in chart_peering_docs(namespace):
        for key in ("helm.sh/hook", "helm.sh/hook-delete-policy"):
            (doc["metadata"].get("annotations") or {}).pop(key, None)
        kube.apply(doc)
    peering_env = {"LLMFLEET_OPERATOR_PEERING": PEERING, "LLMFLEET_OPERATOR_PEERING_LIFETIME_SECONDS": str(LIFETIME_S)}
    active_port, standby_port, active_metrics, standby_metrics = free_ports(4)
    ports = {"active": active_port, "standby": standby_port}
    metrics_ports = {"active": active_metrics, "standby": standby_metrics}
    active = kit.OperatorProcess(
        localkube_cluster.kubeconfig,
        namespace,
        tmp_path / "active.log",
        {
            **peering_env,
            "LLMFLEET_OPERATOR_PRIORITY": "20",
            "LLMFLEET_OPERATOR_ALERTS_TOKEN": TOKEN,
            "LLMFLEET_OPERATOR_HTTP_PORT": str(ports["active"]),
            "LLMFLEET_OPERATOR_METRICS_PORT": str(metrics_ports["active"]),
        },
    )
    standby = kit.OperatorProcess(
        localkube_cluster.kubeconfig,
        namespace,
        tmp_path / "standby.log",
        {
            **peering_env,
            "LLMFLEET_OPERATOR_PRIORITY": "10",
            "LLMFLEET_OPERATOR_ALERTS_TOKEN": TOKEN,
            "LLMFLEET_OPERATOR_HTTP_PORT": str(ports["standby"]),
            "LLMFLEET_OPERATOR_METRICS_PORT": str(metrics_ports["standby"]),
        },
    )
    active.start()
    standby.start()
    try:
        kit.wait_until(lambda: working(active), "the active replica to work", timeout_s=60)
        kube.apply(kit.deployment("ha", replicas=1))
        kit.wait_until(lambda: len(kit.ready_pods(kube.pods("ha"))) == 1, "1 ready pod", timeout_s=60)
        assert working(active) and not working(standby)
        # only the working replica exports the fleet (a dashboard summing over replicas counts it once)
        kit.wait_until(
            lambda: exported(metrics_ports["active"]) == {"active": 1.0, "replicas": 1.0}, "the active's gauges"
        )
        assert exported(metrics_ports["standby"]) == {"active": 0.0, "replicas": 0.0}
        for port in ports.values():  # the public (Alertmanager) port serves no metrics
            assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 404
        assert f"{namespace}/ha: " in whole_log(active) and "action(s) in" in whole_log(
            active
        )  # the active one planned
        assert "action(s) in" not in whole_log(standby)  # the paused one did nothing
        first = {p["metadata"]["name"] for p in kube.pods("ha")}
        alerts_reach_only_the_active_replica(kube, kit, ports)

        active.kill()
        killed = time.monotonic()
        kube.run("scale", "inferencedeployment/ha", "--replicas=2")
        kit.wait_until(
            lambda: len(kit.ready_pods(kube.pods("ha"))) == 2, "the standby to scale up", timeout_s=LIFETIME_S + 60
        )
        takeover_s = time.monotonic() - killed
        assert working(standby) and "action(s) in" in whole_log(standby)
        kit.wait_until(lambda: exported(metrics_ports["standby"]) == {"active": 1.0, "replicas": 2.0}, "the new gauges")
        names = [p["metadata"]["name"] for p in kube.pods("ha")]
        assert len(names) == len(set(names)) == 2 and first <= set(names)
        print(
            f"standby took over and scaled 1 -> 2 {takeover_s:.1f} s after the active replica was SIGKILLed "
            f"(keep-alive {LIFETIME_S} s)"
        )
    finally:
        active.stop()
        standby.stop()
        kube.run("delete", "inferencedeployment", "ha", "--wait=false", check=False)
        kube.run("delete", "inferencedeployment", "alerted", "--wait=false", check=False)


def alerts_reach_only_the_active_replica(kube: Any, kit: Any, ports: dict[str, int]) -> None:
    """A firing scale-up alert (step 3) for an autoscaled deployment: the standby answers 503 and nothing is
    scaled; the active replica applies it (desired 1 -> 4)."""
    body = kit.deployment(
        "alerted",
        variants=[
            {
                "name": "default",
                "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targets": {"queueDepthPerReplica": 100}},
            }
        ],
    )
    del body["spec"]["replicas"]
    kube.apply(body)
    kit.wait_until(lambda: desired(kube, "alerted") == 1, "the autoscaled deployment at 1", timeout_s=60)
    alert = {
        "status": "firing",
        "labels": {
            "alertname": "QueueHigh",
            "llmfleet_scale": "up",
            "llmfleet_scale_step": "3",
            "deployment": "alerted",
        },
    }
    headers = {"Authorization": f"Bearer {TOKEN}"}
    payload = {"version": "4", "alerts": [alert]}
    refused = httpx.post(f"http://127.0.0.1:{ports['standby']}/alerts", json=payload, headers=headers, timeout=30)
    assert refused.status_code == 503, refused.text
    assert "this operator replica is a standby" in refused.json()["error"]["message"]
    assert desired(kube, "alerted") == 1 and len(kube.pods("alerted")) == 1  # the standby applied nothing
    applied = httpx.post(f"http://127.0.0.1:{ports['active']}/alerts", json=payload, headers=headers, timeout=30)
    assert applied.status_code == 200 and applied.json()["accepted"] == 1, applied.text
    kit.wait_until(lambda: desired(kube, "alerted") == 4, "the active replica to apply the alert", timeout_s=30)


def desired(kube: Any, name: str) -> int | None:
    """The autoscaler's desired size of the deployment's only variant, from its status."""
    status = (kube.get("infd", name) or {}).get("status") or {}
    variants = (status.get("autoscaling") or {}).get("variants") or [{}]
    return variants[0].get("desiredReplicas")
