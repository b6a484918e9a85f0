"""Kubernetes discovery on localkube: the gateway watches InferenceDeployments, their pods and the API-key Secret
and routes to the stub workers those pods point at, following readiness, draining, canary weights and key
rotation."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.sources import KubeConnection, KubeSource
from gateway.testing import chat, eventually, run_gateway, stubs

localkube = pytest.importorskip("localkube")
render = pytest.importorskip("crds.render")

NS = "default"
KEY, NEW_KEY = "sk-kube-key-0001", "sk-kube-key-0002"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    workdir = tmp_path_factory.mktemp("lk-gateway")
    with localkube.Cluster(kubeconfig=workdir / "kubeconfig", workdir=workdir, kubelet=False) as running:
        with httpx.Client(base_url=running.url, timeout=10) as api:
            crd = api.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=render.crd())
            assert crd.status_code == 201, crd.text
        yield running


def secret(key: str) -> dict[str, Any]:
    text = f"{key} premium\n".encode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "gw-keys"},
        "data": {"api-keys": base64.b64encode(text).decode()},
    }


def infd() -> dict[str, Any]:
    return {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "smol"},
        "spec": {
            "model": {"name": "smollm2", "source": "bundled://smollm2-135m-instruct"},
            "variants": [{"name": "full"}],
        },
    }


def pod(name: str, port: int, revision: str) -> dict[str, Any]:
    labels = {"llmfleet.io/deployment": "smol", "llmfleet.io/variant": "full", "llmfleet.io/revision": revision}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "containers": [
                {"name": "worker", "image": "llmfleet/worker", "ports": [{"name": "http", "containerPort": port}]}
            ]
        },
    }


READY = {"status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
MERGE = {"content-type": "application/merge-patch+json"}


def ok(r: httpx.Response) -> httpx.Response:
    assert r.status_code < 300, r.text
    return r


async def served_by(c: httpx.AsyncClient, n: int = 6) -> set[str]:
    """Which revisions answered n requests."""
    seen = set()
    for i in range(n):
        r = await c.post("/v1/chat/completions", json=chat(model="smollm2", content=f"q{i}"))
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-llmfleet-revision"])
    return seen


@pytest.mark.slow
async def test_kubernetes_discovery_follows_the_cluster(cluster: Any, tmp_path: Path) -> None:
    async with stubs(2, tokens=2) as (w1, w2), httpx.AsyncClient(base_url=cluster.url, timeout=10) as api:
        ok(await api.post(f"/api/v1/namespaces/{NS}/secrets", json=secret(KEY)))
        ok(await api.post(f"/apis/llmfleet.io/v1alpha1/namespaces/{NS}/inferencedeployments", json=infd()))
        ok(await api.post(f"/api/v1/namespaces/{NS}/pods", json=pod("smol-a", w1.port, "r1")))
        ok(await api.patch(f"/api/v1/namespaces/{NS}/pods/smol-a/status", json=READY, headers=MERGE))
        source = KubeSource(
            KubeConnection.load(str(cluster.kubeconfig)), namespace=NS, keys_secret=(NS, "gw-keys"), retry_delay_s=0.1
        )
        async with run_gateway(source) as gw, gw.client(headers={"authorization": f"Bearer {KEY}"}) as c:
            assert not gw.state.keys.open_mode  # keys came from the Secret
            assert (
                await c.post(
                    "/v1/chat/completions",
                    json=chat(model="smollm2"),
                    headers={"authorization": "Bearer nope-nope-nope"},
                )
            ).status_code == 401
            assert await served_by(c) == {"r1"} and w1.stats.requests == 6

            # a second pod (a new revision) becomes ready; status endpoints put all weight on it (canary promoted)
            ok(await api.post(f"/api/v1/namespaces/{NS}/pods", json=pod("smol-b", w2.port, "r2")))
            ok(await api.patch(f"/api/v1/namespaces/{NS}/pods/smol-b/status", json=READY, headers=MERGE))
            endpoints = [
                {"variant": "full", "revision": "r1", "weight": 0},
                {"variant": "full", "revision": "r2", "weight": 100, "canary": True},
            ]
            ok(
                await api.patch(
                    f"/apis/llmfleet.io/v1alpha1/namespaces/{NS}/inferencedeployments/smol/status",
                    json={"status": {"endpoints": endpoints}},
                    headers=MERGE,
                )
            )
            await eventually(
                lambda: {e.revision for e in gw.state.table.endpoints()} == {"r1", "r2"}, "both pods are routable"
            )
            await eventually(
                lambda: gw.state.table.deployments["smollm2"].variants[0].revisions[1].weight == 100, "weights seen"
            )
            assert await served_by(c) == {"r2"}

            # the new pod is marked draining: traffic goes back to the one left
            ok(
                await api.patch(
                    f"/api/v1/namespaces/{NS}/pods/smol-b",
                    json={"metadata": {"labels": {"llmfleet.io/draining": "true"}}},
                    headers=MERGE,
                )
            )
            await eventually(
                lambda: [e.name for e in gw.state.table.endpoints()] == ["smol-a"], "the draining pod left the table"
            )
            assert await served_by(c) == {"r1"}

            # the last pod is deleted: the model stays known (its requests would be held until it scales up)
            ok(await api.delete(f"/api/v1/namespaces/{NS}/pods/smol-a", params={"gracePeriodSeconds": "0"}))
            await eventually(lambda: gw.state.table.endpoints() == [], "no routable pod left")
            assert "smollm2" in gw.state.table.deployments

            # key rotation through the Secret
            ok(await api.put(f"/api/v1/namespaces/{NS}/secrets/gw-keys", json=secret(NEW_KEY)))
            await eventually(
                lambda: gw.state.keys.authenticate(f"Bearer {NEW_KEY}") is not None, "the new key is loaded"
            )
            assert gw.state.keys.authenticate(f"Bearer {KEY}") is None

            # the deployment is deleted: its model disappears
            ok(await api.delete(f"/apis/llmfleet.io/v1alpha1/namespaces/{NS}/inferencedeployments/smol"))
            await eventually(lambda: gw.state.table.deployments == {}, "the model is gone")
            r = await c.post(
                "/v1/chat/completions", json=chat(model="smollm2"), headers={"authorization": f"Bearer {NEW_KEY}"}
            )
            assert r.status_code == 404


def obj(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"namespace": NS, "name": name, "resourceVersion": rv}}


async def test_list_then_watch_events_and_410() -> None:
    from gateway.sources import _Collection, _Gone

    lines = [
        {"type": "ADDED", "object": obj("b", "11")},
        {"type": "MODIFIED", "object": {**obj("a", "12"), "spec": {"x": 1}}},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "13"}}},
        {"type": "DELETED", "object": obj("b", "14")},
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}},
    ]
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.url.params))
        if "watch" not in request.url.params:
            return httpx.Response(200, json={"metadata": {"resourceVersion": "10"}, "items": [obj("a", "9")]})
        return httpx.Response(200, content="\n".join(json.dumps(x) for x in lines).encode())

    coll = _Collection("/api/v1/pods", {"labelSelector": "llmfleet.io/deployment"})
    changes: list[list[str]] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://api") as c:
        await coll.relist(c, {})
        assert (list(coll.objects), coll.resource_version) == ([(NS, "a")], "10")
        with pytest.raises(_Gone):
            await coll.watch(c, {}, 5, lambda: changes.append(sorted(n for _, n in coll.objects)))
    assert changes == [["a", "b"], ["a", "b"], ["a"]]  # ADDED, MODIFIED, DELETED (not the bookmark)
    assert coll.objects[(NS, "a")]["spec"] == {"x": 1} and coll.resource_version == "14"
    assert seen[1] == {
        "labelSelector": "llmfleet.io/deployment",
        "watch": "1",
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "5",
        "resourceVersion": "10",
    }


@pytest.mark.slow
async def test_the_key_secret_fails_closed_missing_empty_and_deleted(cluster: Any) -> None:
    """Through the API server's watch: no Secret -> 503 and not ready; a Secret with no key -> still 503; a key ->
    401 without it, 200 with it; the Secret deleted -> 503 again (every key dropped)."""
    name, path = "gw-keys-closed", f"/api/v1/namespaces/{NS}/secrets"
    doc = {**secret(KEY), "metadata": {"name": name}}
    empty = {**doc, "data": {"api-keys": base64.b64encode(b"# none yet\n").decode()}}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as api:
        source = KubeSource(
            KubeConnection.load(str(cluster.kubeconfig)), namespace=NS, keys_secret=(NS, name), retry_delay_s=0.1
        )
        async with run_gateway(source) as gw, gw.client() as c:
            r = await c.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
            assert (
                r.status_code == 503
                and f"the Secret {NS}/{name} is missing or holds no keys" in r.json()["error"]["message"]
            )
            assert (await c.get("/ready")).status_code == 503 and (await c.get("/health")).status_code == 200

            before = gw.state.keys
            ok(await api.post(path, json=empty))
            await eventually(lambda: gw.state.keys is not before, "the empty Secret is seen")
            assert gw.state.keys.unavailable is not None
            assert (await c.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})).status_code == 503

            ok(await api.put(f"{path}/{name}", json=doc))
            await eventually(lambda: gw.state.keys.unavailable is None, "the key is loaded")
            assert (await c.get("/v1/models")).status_code == 401
            assert (await c.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})).status_code == 200
            assert (await c.get("/ready")).status_code == 200

            ok(await api.delete(f"{path}/{name}"))
            await eventually(lambda: gw.state.keys.unavailable is not None, "the deletion is seen")
            assert (await c.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})).status_code == 503
            assert (await c.get("/ready")).status_code == 503
