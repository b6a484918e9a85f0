"""LoRA adapters through the gateway on loopback against stub workers: `MODEL:ADAPTER` and `ADAPTER` reach only
pods that have the adapter Loaded, 503 `adapter_not_ready` while none has it (with the pods' failure reason), 404
for unknown and ambiguous names, the adapter's shared tokens-per-minute bucket, `/v1/models`, metrics, and the
scale-from-zero hold."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from gateway.routing import AdapterRoute, DeploymentRoute, RoutingTable
from gateway.settings import GatewaySettings, TierSettings
from gateway.stub import StubWorker
from gateway.testing import FixedSource, chat, eventually, run_gateway, stubs, variant_route

KEY = "sk-test-key-standard"
OTHER_KEY = "sk-test-key-other"
KEYS = {KEY: "standard", OTHER_KEY: "standard"}
AUTH = {"authorization": f"Bearer {KEY}"}


def settings(**kw: object) -> GatewaySettings:
    tiers = (  # generous key limits: only the adapter's own bucket can run out here
        TierSettings(name="standard", priority=10, requests_per_minute=10_000, tokens_per_minute=10_000_000),
        TierSettings(name="premium", priority=20),
        TierSettings(name="batch", priority=0),
    )
    return GatewaySettings(health_interval_seconds=0.05, tiers=tiers, **kw)  # type: ignore[arg-type]


def deployment(
    model: str, ws: Sequence[StubWorker], adapters: Sequence[AdapterRoute], name: str | None = None
) -> DeploymentRoute:
    return DeploymentRoute(
        model,
        name or model,
        "ns",
        (variant_route("full", 1, ws),),
        adapters={a.name: a for a in adapters},
    )


def loaded_on(name: str, *ws: StubWorker, **kw: object) -> AdapterRoute:
    """An adapter Loaded on these workers (`variant_route` names each pod by its URL)."""
    return AdapterRoute(name, pods=frozenset(w.url for w in ws), **kw)  # type: ignore[arg-type]


async def test_model_adapter_reaches_only_pods_that_have_it_loaded() -> None:
    async with stubs(3, tokens=3) as ws:
        table = RoutingTable({"m": deployment("m", ws, [loaded_on("sql", ws[1]), loaded_on("poet", ws[0], ws[2])])})
        async with run_gateway(FixedSource(table), KEYS, settings()) as gw, gw.client(headers=AUTH) as c:
            for i in range(8):
                for model in ("m:sql", "sql"):
                    body = chat(model=model, stream=i % 2 == 0, content=f"question {i}", max_tokens=3)
                    r = await c.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
            assert [w.stats.requests for w in ws] == [0, 16, 0]
            # the worker gets the model as the client sent it: it resolves both forms to the adapter
            assert sorted({b["model"] for b in ws[1].stats.bodies}) == ["m:sql", "sql"]
            poet = [await c.post("/v1/chat/completions", json=chat(model="m:poet", content=f"{i}")) for i in range(8)]
            assert all(r.status_code == 200 for r in poet)
            assert ws[1].stats.requests == 16 and ws[0].stats.requests + ws[2].stats.requests == 8
            # base requests go to any pod, whatever adapters it has. Each prompt's affinity ranks the pods by
            # hashing their names (random ports), so any 12 prompts miss one pod ~0.8% of the time: send until
            # both sides have had some (a pod barred from base requests would never get one in 200)
            base = 0
            while base < 200 and not (ws[0].stats.requests + ws[2].stats.requests > 8 and ws[1].stats.requests > 16):
                assert (await c.post("/v1/chat/completions", json=chat(content=f"base {base}"))).status_code == 200
                base += 1
            metrics = await gw.metrics_text()
        assert ws[0].stats.requests + ws[2].stats.requests > 8 and ws[1].stats.requests > 16
        assert gw.state.outstanding == {}
    for needle in (
        'llmfleet_gateway_requests_total{adapter="sql",model="m",status="200"} 16.0',
        'llmfleet_gateway_requests_total{adapter="poet",model="m",status="200"} 8.0',
        f'llmfleet_gateway_requests_total{{adapter="",model="m",status="200"}} {base}.0',
        'llmfleet_gateway_output_tokens_total{adapter="sql",model="m"} 48.0',
    ):
        assert needle in metrics, needle


async def test_an_adapter_no_pod_has_loaded_is_503_adapter_not_ready() -> None:
    async with stubs(2) as ws:
        table = RoutingTable(
            {
                "m": deployment(
                    "m",
                    ws,
                    [
                        AdapterRoute("sql"),  # loading
                        AdapterRoute("poet", failed="adapter_model.safetensors is missing; rank 64 > 16"),
                    ],
                )
            }
        )
        async with run_gateway(FixedSource(table), KEYS, settings()) as gw, gw.client(headers=AUTH) as c:
            loading = await c.post("/v1/chat/completions", json=chat(model="m:sql"))
            failed = await c.post("/v1/chat/completions", json=chat(model="poet", stream=True))
            base = await c.post("/v1/chat/completions", json=chat(model="m"))
            metrics = await gw.metrics_text()
    assert loading.status_code == 503 and loading.headers["retry-after"] == "1"
    err = loading.json()["error"]
    assert err["code"] == "adapter_not_ready" and "'sql' of model 'm'" in err["message"] and "loading" in err["message"]
    assert failed.status_code == 503 and failed.headers["retry-after"] == "10"  # the operator's first back-off
    err = failed.json()["error"]
    assert err["code"] == "adapter_not_ready"
    assert "failed to load on every pod: adapter_model.safetensors is missing; rank 64 > 16" in err["message"]
    assert "x-ratelimit-remaining-tokens" not in loading.headers  # refused before the limits: nothing charged
    assert base.status_code == 200  # the base model keeps serving
    assert [w.stats.requests for w in ws] in ([1, 0], [0, 1])
    assert 'llmfleet_gateway_errors_total{kind="adapter_not_ready",model="m"} 2.0' in metrics
    assert 'llmfleet_gateway_requests_total{adapter="sql",model="m",status="503"} 1.0' in metrics


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("m:nope", "model 'm' has no variant or adapter 'nope' (variants: full; adapters: poet, sql)"),
        ("nope", "the model 'nope' does not exist"),
        ("n:poet", "model 'n' has no variant or adapter 'poet'"),
        ("sql", "the adapter name 'sql' is ambiguous: models m, n each declare it; send model MODEL:ADAPTER"),
    ],
)
async def test_unknown_and_ambiguous_adapters_are_404(model: str, message: str) -> None:
    async with stubs(2) as ws:
        table = RoutingTable(
            {
                "m": deployment("m", ws[:1], [loaded_on("sql", ws[0]), loaded_on("poet", ws[0])]),
                "n": deployment("n", ws[1:], [loaded_on("sql", ws[1])]),
            }
        )
        async with run_gateway(FixedSource(table), KEYS, settings()) as gw, gw.client(headers=AUTH) as c:
            r = await c.post("/v1/chat/completions", json=chat(model=model))
            ok = [await c.post("/v1/chat/completions", json=chat(model=m)) for m in ("m:sql", "n:sql", "poet")]
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and message in r.json()["error"]["message"]
    assert [x.status_code for x in ok] == [200, 200, 200]
    assert [w.stats.requests for w in ws] == [2, 1]


async def test_an_adapters_tokens_per_minute_is_one_bucket_for_every_key() -> None:
    async with stubs(1, tokens=8) as ws:
        table = RoutingTable({"m": deployment("m", ws, [loaded_on("sql", ws[0], tokens_per_minute=120)])})
        async with run_gateway(FixedSource(table), KEYS, settings()) as gw:
            assert set(gw.state.limiter.adapters) == {("ns", "m", "sql")}  # synced from the routing table
            async with gw.client(headers=AUTH) as c:
                first = await c.post("/v1/chat/completions", json=chat(model="m:sql", max_tokens=100))
                again = await c.post("/v1/chat/completions", json=chat(model="m:sql", max_tokens=100))
                other_key = await c.post(
                    "/v1/chat/completions",
                    json=chat(model="sql", max_tokens=100),
                    headers={"authorization": f"Bearer {OTHER_KEY}"},
                )
                base = await c.post("/v1/chat/completions", json=chat(model="m", max_tokens=100))
                metrics = await gw.metrics_text()
    assert first.status_code == 200  # reserved 102, settled at its usage (2 + 8): 110 of 120 left
    for r in (again, other_key):
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded"
        assert "LoRA adapter 'sql' of model 'm' (120, shared by all API keys" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
    assert base.status_code == 200  # the base model has no such bucket
    assert ws[0].stats.requests == 2
    assert 'llmfleet_gateway_rate_limit_rejections_total{limit="adapter tokens",tier="standard"} 2.0' in metrics


async def test_models_lists_adapters_with_parent_and_root() -> None:
    table = RoutingTable(
        {
            "m": deployment(
                "m", [], [AdapterRoute("sql", source="/adapters/sql"), AdapterRoute("poet", source="hf://org/poet")]
            ),
            "n": deployment("n", [], [AdapterRoute("sql", source="file:///sql-n")]),
        }
    )
    async with run_gateway(FixedSource(table), KEYS, settings()) as gw, gw.client(headers=AUTH) as c:
        data = (await c.get("/v1/models")).json()["data"]
    assert [(d["id"], d.get("parent"), d.get("root")) for d in data] == [
        ("m", None, None),
        ("n", None, None),
        ("poet", "m", "hf://org/poet"),
        ("m:sql", "m", "/adapters/sql"),  # `sql` alone is ambiguous
        ("n:sql", "n", "file:///sql-n"),
    ]
    assert all(d["object"] == "model" and d["owned_by"] == "llmfleet" for d in data)


async def test_an_adapter_request_for_a_scaled_to_zero_variant_waits_for_the_adapter_too() -> None:
    async with stubs(1, tokens=2) as ws:
        cold = RoutingTable({"m": deployment("m", [], [AdapterRoute("sql")])})
        source = FixedSource(cold)
        async with run_gateway(source, KEYS, settings(zero_hold_seconds=60)) as gw, gw.client(headers=AUTH) as c:
            held = asyncio.create_task(c.post("/v1/chat/completions", json=chat(model="m:sql")))
            await eventually(lambda: gw.state.hold.counts == {("ns", "m", "full"): 1}, "the request is held")
            source.publish(RoutingTable({"m": deployment("m", ws, [AdapterRoute("sql")])}))  # a pod, no adapter yet
            await asyncio.sleep(0.1)
            assert not held.done() and gw.state.hold.counts == {("ns", "m", "full"): 1}
            source.publish(RoutingTable({"m": deployment("m", ws, [loaded_on("sql", ws[0])])}))  # loaded
            r = await asyncio.wait_for(held, 30)
    assert r.status_code == 200 and ws[0].stats.bodies[-1]["model"] == "m:sql"


async def test_a_held_adapter_request_that_times_out_on_a_ready_variant_is_adapter_not_ready() -> None:
    async with stubs(1) as ws:
        source = FixedSource(RoutingTable({"m": deployment("m", [], [AdapterRoute("sql")])}))
        async with run_gateway(source, KEYS, settings(zero_hold_seconds=0.5)) as gw, gw.client(headers=AUTH) as c:
            held = asyncio.create_task(c.post("/v1/chat/completions", json=chat(model="m:sql")))
            await eventually(lambda: gw.state.hold.counts != {}, "the request is held")
            source.publish(RoutingTable({"m": deployment("m", ws, [AdapterRoute("sql")])}))
            r = await asyncio.wait_for(held, 30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_not_ready" and r.headers["retry-after"]
    assert ws[0].stats.requests == 0


async def test_model_variant_reaches_the_worker_as_the_base_model() -> None:
    """A worker serves its model under the base name and 404s `MODEL:VARIANT`: the gateway sends `MODEL`."""
    async with stubs(2) as (main, cheap):
        table = RoutingTable(
            {
                "m": DeploymentRoute(
                    "m", "m", "ns", (variant_route("full", 1, [main]), variant_route("cheap", 1, [cheap]))
                )
            }
        )
        async with run_gateway(FixedSource(table), KEYS, settings()) as gw, gw.client(headers=AUTH) as c:
            plain = await c.post("/v1/chat/completions", json=chat(model="m:cheap", max_tokens=2))
            streamed = await c.post("/v1/chat/completions", json=chat(model="m:cheap", stream=True, max_tokens=2))
    assert (plain.status_code, streamed.status_code) == (200, 200)
    assert [(b["model"], b["max_tokens"]) for b in cheap.stats.bodies] == [("m", 2), ("m", 2)]
    assert cheap.stats.bodies[1]["stream_options"] == {"include_usage": True}
    assert main.stats.requests == 0


async def test_a_held_adapter_request_waits_for_a_pod_of_its_tier_with_the_adapter() -> None:
    """The batch tier's variant is scaled to zero while the main variant serves (and has the adapter): a batch
    request for the adapter is held, not sent to the main variant and not refused, until a batch pod is ready
    with the adapter loaded."""
    async with stubs(2, tokens=2) as (main, batch):

        def table(batch_pods: list[StubWorker], loaded: list[StubWorker]) -> RoutingTable:
            variants = (variant_route("full", 1, [main]), variant_route("cheap", 0, batch_pods, tiers=("batch",)))
            return RoutingTable(
                {"m": DeploymentRoute("m", "m", "ns", variants, adapters={"sql": loaded_on("sql", *loaded)})}
            )

        source = FixedSource(table([], []))
        async with run_gateway(source, KEYS, settings(zero_hold_seconds=60)) as gw, gw.client(headers=AUTH) as c:
            tier = {"x-llmfleet-tier": "batch"}
            held = asyncio.create_task(c.post("/v1/chat/completions", json=chat(model="m:sql"), headers=tier))
            await eventually(lambda: gw.state.hold.counts == {("ns", "m", "cheap"): 1}, "the request is held")
            source.publish(table([], [main]))  # the main variant has it: not this tier's
            source.publish(table([batch], [main]))  # a batch pod, without the adapter yet
            await asyncio.sleep(0.1)
            assert not held.done() and gw.state.hold.counts == {("ns", "m", "cheap"): 1}
            source.publish(table([batch], [main, batch]))
            r = await asyncio.wait_for(held, 30)
    assert r.status_code == 200 and r.headers["x-llmfleet-variant"] == "cheap"
    assert (main.stats.requests, batch.stats.requests) == (0, 1)
