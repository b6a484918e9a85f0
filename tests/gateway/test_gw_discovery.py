"""Routing tables from static backends and from InferenceDeployments + pods (pure functions, as tables),
LoRA adapters included (`spec.adapters` and the operator's `status.adapters`)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from crds.models import AdapterPodState, AdapterPodStatus, AdapterSpec, AdapterStatus
from crds.pods import DRAINING
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


# ------------------------------------------------------------------------------------------------- LoRA adapters


def adapter_cr(
    adapters: list[AdapterSpec], statuses: list[AdapterStatus] | None = None, lora: bool = True
) -> dict[str, Any]:
    """A CR with `spec.adapters` and `status.adapters` as the API server holds them (dumped from the CRD's models,
    camelCase, as the operator writes them)."""
    obj = cr()
    if lora:
        obj["spec"]["engine"] = {"type": "builtin", "lora": {}}  # LoRA on with defaults: an empty object
    obj["spec"]["adapters"] = [a.model_dump(mode="json", by_alias=True, exclude_none=True) for a in adapters]
    if statuses is not None:
        obj["status"] = {"adapters": [s.model_dump(mode="json", by_alias=True, exclude_none=True) for s in statuses]}
    return obj


def entry(pod: str, state: AdapterPodState, message: str = "") -> AdapterPodStatus:
    return AdapterPodStatus(pod=pod, state=state, source="/adapters/sql", message=message, attempts=1)


LOADED, LOADING, FAILED = AdapterPodState.LOADED, AdapterPodState.LOADING, AdapterPodState.FAILED
SQL_SPEC = AdapterSpec(name="sql", source="/adapters/sql", tokens_per_minute=5000)
POET_SPEC = AdapterSpec(name="poet", source="hf://org/poet@v2")
PODS = [pod("a"), pod("b"), pod("c", revision="r2"), pod("u", ready="False"), pod("d", annotations={DRAINING: "now"})]


@pytest.mark.parametrize(
    ("entries", "loaded", "failed"),
    [
        # Loaded on routable pods only: not on one that is unready or draining
        (
            [entry("a", LOADED), entry("c", LOADED), entry("u", LOADED), entry("d", LOADED), entry("b", LOADING)],
            {"a", "c"},
            None,
        ),
        # loading everywhere, or some failed and some loading: loading
        ([entry("a", LOADING), entry("b", LOADING)], set(), None),
        ([entry("a", FAILED, "bad rank"), entry("b", LOADING)], set(), None),
        # failed on every routable pod: the reasons, each once (an unready pod's Loaded entry does not count)
        (
            [entry("a", FAILED, "rank 64 > 16"), entry("b", FAILED, "rank 64 > 16"), entry("u", LOADED)],
            set(),
            "rank 64 > 16",
        ),
        ([entry("a", FAILED, "x"), entry("b", FAILED, "y"), entry("c", FAILED)], set(), "x; y; no reason given"),
        # no routable pod has an entry: all entries decide
        ([entry("u", FAILED, "missing folder")], set(), "missing folder"),
        ([], set(), None),  # not in the status yet: loading
    ],
)
def test_adapter_routes_from_status(entries: list[AdapterPodStatus], loaded: set[str], failed: str | None) -> None:
    status = [AdapterStatus(name="sql", source="/adapters/sql", ready_replicas=len(loaded), pods=entries)]
    table = kube_table([adapter_cr([SQL_SPEC, POET_SPEC], status)], PODS)
    sql = table.deployments["smollm2"].adapters["sql"]
    assert (sql.name, sql.source, sql.tokens_per_minute) == ("sql", "/adapters/sql", 5000)
    assert (set(sql.pods), sql.failed) == (loaded, failed)
    poet = table.deployments["smollm2"].adapters["poet"]  # in the spec, not (yet) in the status
    assert (poet.source, poet.tokens_per_minute, poet.pods, poet.failed) == (
        "hf://org/poet@v2",
        None,
        frozenset(),
        None,
    )


def test_adapters_come_from_the_spec_and_need_engine_lora() -> None:
    gone = AdapterStatus(name="old", source="/old", ready_replicas=1, pods=[entry("a", LOADED)])
    table = kube_table([adapter_cr([SQL_SPEC], [gone])], PODS)
    assert list(table.deployments["smollm2"].adapters) == ["sql"]  # `old` is being unloaded: not routed
    table = kube_table([adapter_cr([SQL_SPEC], [], lora=False)], PODS)  # an invalid spec: no pod serves adapters
    assert table.deployments["smollm2"].adapters == {}
    assert kube_table([cr()], PODS).deployments["smollm2"].adapters == {}


def test_a_long_failure_message_is_cut() -> None:
    status = [AdapterStatus(name="sql", pods=[entry("a", FAILED, "x" * 4000), entry("b", FAILED, "y")])]
    failed = kube_table([adapter_cr([SQL_SPEC], status)], PODS).deployments["smollm2"].adapters["sql"].failed
    assert failed is not None and len(failed) == 500 and failed.startswith("xxx")


def test_static_mode_has_no_adapters() -> None:
    table = static_table([StaticBackend("m", "default", ("http://a:1",))], {"http://a:1": True})
    assert table.deployments["m"].adapters == {} and table.adapter_entries() == []
