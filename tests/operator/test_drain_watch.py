"""The pod watch the drain tests rely on (`fleet_operator.drain_watch`): it must see a restart of a pod marked
draining, or the restartCount assertions of the rollout and end-to-end tests could never fail."""

from __future__ import annotations

from typing import Any

import pytest
from fleet_operator.drain_watch import DrainedPodRestarts, restarts_of

pytestmark = pytest.mark.slow


def _pod(name: str, command: str, draining: bool) -> dict[str, Any]:
    labels = {"llmfleet.io/deployment": "watched", **({"llmfleet.io/draining": "true"} if draining else {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Always",
            "containers": [{"name": "worker", "image": "none", "command": ["sh", "-c", command]}],
        },
    }


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        (None, 0),
        ([], 0),
        ([{"restartCount": 2}], 2),
        ([{"restartCount": 1}, {"restartCount": 3}], 4),
        ([{"name": "c"}], 0),
    ],
)
def test_restarts_of(statuses, expected):
    assert restarts_of({"status": {"containerStatuses": statuses}}) == expected


def test_restarts_of_pods_marked_draining_are_seen(localkube_cluster, kit) -> None:
    namespace = "t-drain-watch"
    kit.Kube(localkube_cluster.kubeconfig, "default").apply(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    )
    kube = kit.Kube(localkube_cluster.kubeconfig, namespace)
    with DrainedPodRestarts(localkube_cluster.kubeconfig, namespace, "watched") as watch:
        kube.apply(_pod("exits", "exit 1", draining=True))  # restarted by the kubelet again and again
        kube.apply(_pod("stays", "sleep 60", draining=True))
        kube.apply(_pod("serves", "exit 1", draining=False))  # restarts, but was never draining
        kit.wait_until(lambda: watch.drained().get("exits", 0) >= 1, "the restart to be seen", timeout_s=60)
    seen = watch.drained()
    assert set(seen) == {"exits", "stays"} and seen["stays"] == 0 and seen["exits"] >= 1
    kube.run("delete", "pods", "--all", "--wait=false", check=False)
