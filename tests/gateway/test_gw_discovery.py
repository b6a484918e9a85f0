"""Routing tables from static backends and from InferenceDeployments + pods (pure functions, as tables)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from gateway.discovery import StaticBackend, kube_table, parse_backend, pod_is_routable, pod_url, static_table


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("smollm2=http://127.0.0.1:8000", StaticBackend("smollm2", "default", ("http://127.0.0.1:8000",))),
        (
            "smollm2:int4=http://127.0.0.2:8000/, http://127.0.0.3:9000",
            StaticBackend("smollm2", "int4", ("http://127.0.0.2:8000", "http://127.0.0.3:9000")),
        ),
    ],
)
def test_parse_backend(arg: str, expected: StaticBackend) -> None:
    assert parse_backend(arg) == expected


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("smollm2", "expected MODEL[:VARIANT]=URL"),
        ("=http://a:1", "expected MODEL[:VARIANT]=URL"),
        ("m=", "expected MODEL[:VARIANT]=URL"),
        ("m:a:b=http://a:1", "MODEL or MODEL:VARIANT"),
        ("m=ftp://a:1", "not an http(s)://HOST[:PORT] URL"),
        ("m=http://a:1/v1", "without a path"),
    ],
)
def test_parse_backend_errors(arg: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_backend(arg)


def test_static_table_routes_only_healthy_urls_and_merges_repeats() -> None:
    backends = [
        StaticBackend("m", "default", ("http://a:1", "http://b:1")),
        StaticBackend("m", "default", ("http://b:1", "http://c:1")),
        StaticBackend("m", "int4", ("http://d:1",)),
    ]
    table = static_table(backends, {"http://a:1": True, "http://b:1": False, "http://c:1": True})
    dep = table.deployments["m"]
    assert [v.name for v in dep.variants] == ["default", "int4"]
    assert [e.url for e in dep.variants[0].endpoints] == ["http://a:1", "http://c:1"]
    assert dep.variants[1].endpoints == ()  # never checked yet: not routable


def pod(
    name: str,
    *,
    dep: str = "smol",
    ns: str = "prod",
    variant: str = "full",
    revision: str = "r1",
    ip: str | None = "10.0.0.1",
    ready: str = "True",
    phase: str = "Running",
    deleting: bool = False,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ports: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ns,
        "labels": {
            "llmfleet.io/deployment": dep,
            "llmfleet.io/variant": variant,
            "llmfleet.io/revision": revision,
            **(labels or {}),
        },
        "annotations": annotations or {},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [{"name": "worker", "ports": ports or []}]}, "status": status}


@pytest.mark.parametrize(
    ("p", "routable"),
    [
        (pod("a"), True),
        (pod("a", ready="False"), False),
        (pod("a", ip=None), False),
        (pod("a", phase="Pending"), False),
        (pod("a", deleting=True), False),
        (pod("a", labels={"llmfleet.io/draining": "true"}), False),
        (pod("a", annotations={"llmfleet.io/draining": "2026-01-01T00:00:00Z"}), False),
        (pod("a", annotations={"llmfleet.io/draining": "false"}), True),
    ],
)
def test_pod_is_routable(p: dict[str, Any], routable: bool) -> None:
    assert pod_is_routable(p) is routable


@pytest.mark.parametrize(
    ("ports", "ip", "url"),
    [
        ([], "10.0.0.1", "http://10.0.0.1:8000"),
        (
            [{"name": "metrics", "containerPort": 9000}, {"name": "http", "containerPort": 8080}],
            "10.0.0.1",
            "http://10.0.0.1:8080",
        ),
        ([{"name": "http", "containerPort": 8001}], "fd00::1", "http://[fd00::1]:8001"),
    ],
)
def test_pod_url(ports: list[dict[str, Any]], ip: str, url: str) -> None:
    assert pod_url(pod("a", ports=ports, ip=ip)) == url


def cr(
    name: str = "smol",
    ns: str = "prod",
    model: str = "smollm2",
    variants: list[dict] | None = None,
    endpoints: list[dict] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "model": {"name": model, "source": "bundled://smollm2-135m-instruct"},
            "variants": variants or [{"name": "full"}],
        },
    }
    if endpoints is not None:
        obj["status"] = {"endpoints": endpoints}
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return obj


def summary(table) -> dict[str, Any]:
    """{model: {variant: (weight, tiers, {revision: (weight, [pod names])})}}"""
    return {
        model: {
            v.name: (
                v.weight,
                sorted(v.tiers),
                {r.name: (r.weight, [e.name for e in r.endpoints]) for r in v.revisions},
            )
            for v in d.variants
        }
        for model, d in table.deployments.items()
    }


CANARY_ENDPOINTS = [
    {"variant": "full", "revision": "r1", "weight": 90},
    {"variant": "full", "revision": "r2", "weight": 10, "canary": True},
    {"variant": "int4", "revision": "r1", "weight": 0, "tiers": ["batch"]},
]


@pytest.mark.parametrize(
    ("crs", "pods", "expected"),
    [
        # status endpoints give canary weights per revision; pods land by their labels
        (
            [
                cr(
                    variants=[{"name": "full"}, {"name": "int4", "tiers": ["batch"], "weight": 0}],
                    endpoints=CANARY_ENDPOINTS,
                )
            ],
            [
                pod("s1"),
                pod("s2", revision="r1"),
                pod("c1", revision="r2"),
                pod("q1", variant="int4"),
                pod("d1", labels={"llmfleet.io/draining": "true"}),
                pod("u1", ready="False"),
            ],
            {
                "smollm2": {
                    "full": (100.0, [], {"r1": (90.0, ["s1", "s2"]), "r2": (10.0, ["c1"])}),
                    "int4": (0.0, ["batch"], {"r1": (0.0, ["q1"])}),
                }
            },
        ),
        # before the operator writes status: spec variants, every revision on ready pods shares the variant
        (
            [cr(variants=[{"name": "full", "weight": 3}, {"name": "int4"}])],
            [pod("a", revision="r1"), pod("b", revision="r2"), pod("q", variant="int4")],
            {
                "smollm2": {
                    "full": (6.0, [], {"r1": (3.0, ["a"]), "r2": (3.0, ["b"])}),
                    "int4": (1.0, [], {"r1": (1.0, ["q"])}),
                }
            },
        ),
        # a variant scaled to zero keeps its weight so demand can still reach (and wake) it
        (
            [cr(variants=[{"name": "full", "weight": 2}])],
            [],
            {"smollm2": {"full": (2.0, [], {})}},
        ),
        # pods of another deployment or namespace do not leak in; a deleting CR is not routed
        (
            [cr(), cr(name="gone", model="other", deleting=True)],
            [pod("mine"), pod("other-ns", ns="dev"), pod("other-dep", dep="gone")],
            {"smollm2": {"full": (1.0, [], {"r1": (1.0, ["mine"])})}},
        ),
        # two deployments serving one model name: the first by (namespace, name) wins
        (
            [cr(name="b"), cr(name="a")],
            [pod("pa", dep="a"), pod("pb", dep="b")],
            {"smollm2": {"full": (1.0, [], {"r1": (1.0, ["pa"])})}},
        ),
    ],
)
def test_kube_table(crs: list[dict], pods: list[dict], expected: dict[str, Any]) -> None:
    assert summary(kube_table(crs, pods)) == expected


def test_kube_table_endpoint_urls_and_identity() -> None:
    table = kube_table([cr()], [pod("p", ip="10.1.2.3", ports=[{"name": "http", "containerPort": 8080}])])
    (e,) = table.endpoints()
    assert (e.url, e.name, e.variant, e.revision) == ("http://10.1.2.3:8080", "p", "full", "r1")
    assert (table.deployments["smollm2"].namespace, table.deployments["smollm2"].name) == ("prod", "smol")
