"""The gateway end to end on loopback against stub workers: pass-through, auth, limits, retries (only before the
first byte), disconnect propagation, timeouts, tiers, the scale-from-zero hold, metrics."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.routing import DeploymentRoute, RoutingTable
from gateway.settings import GatewaySettings, TierSettings, TimeoutSettings
from gateway.sources import StaticSource
from gateway.testing import (
    FixedSource,
    chat,
    eventually,
    one_variant_table,
    run_gateway,
    static,
    stubs,
    variant_route,
)

KEY = "sk-test-key-standard"
PREMIUM_KEY = "sk-test-key-premium"
BATCH_KEY = "sk-test-key-batch"
KEYS = {KEY: "standard", PREMIUM_KEY: "premium", BATCH_KEY: "batch"}
AUTH = {"authorization": f"Bearer {KEY}"}


def events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


def settings(**kw: object) -> GatewaySettings:
    return GatewaySettings(health_interval_seconds=0.05, **kw)  # type: ignore[arg-type]


async def test_streaming_and_plain_requests_pass_through_unchanged() -> None:
    async with (
        stubs(2, delay=0.001, tokens=5) as ws,
        run_gateway(StaticSource([static("m", ws)]), KEYS, settings()) as gw,
    ):
        async with gw.client(headers=AUTH) as c:
            body = chat(stream=True, temperature=0.5, max_tokens=7)
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                assert r.headers["x-llmfleet-variant"] == "default"
                text = (await r.aread()).decode()
            evs = events(text)
            assert len(evs) == 8 and evs[-1] == "[DONE]"
            assert "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in evs[:-1]) == "".join(
                f"tok{i} " for i in range(7)
            )
            # the worker got the client's body, asked for usage (what the gateway charges), and no usage came back
            assert {**body, "stream_options": {"include_usage": True}} in [b for w in ws for b in w.stats.bodies]
            assert all("usage" not in json.loads(e) for e in evs[:-1])

            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "tok0 tok1 tok2 "
            assert r.headers["x-request-id"]
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"x-request-id": "abc"})
            assert r.headers["x-request-id"] == "abc"
        assert gw.state.outstanding == {} and gw.state.admission.in_flight == 0


@pytest.mark.parametrize(
    ("path", "kwargs", "status", "code"),
    [
        ("/v1/chat/completions", {"content": b"{not json"}, 400, "invalid_json"),
        ("/v1/chat/completions", {"json": [1, 2]}, 400, "invalid_request"),
        ("/v1/chat/completions", {"json": {"messages": []}}, 400, "missing_model"),
        ("/v1/chat/completions", {"json": chat(model="nope")}, 404, "model_not_found"),
        ("/v1/chat/completions", {"json": chat(model="m:int4")}, 404, "model_not_found"),
        ("/v1/chat/completions", {"json": chat(), "headers": {"x-llmfleet-tier": "gold"}}, 400, "invalid_tier"),
        ("/v1/chat/completions", {"json": chat(), "headers": {"x-llmfleet-tier": "premium"}}, 403, "invalid_tier"),
    ],
)
async def test_bad_requests_get_openai_error_bodies(path: str, kwargs: dict, status: int, code: str) -> None:
    async with stubs(1) as ws, run_gateway(StaticSource([static("m", ws)]), KEYS, settings()) as gw:
        async with gw.client(headers=AUTH) as c:
            r = await c.post(path, **kwargs)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    assert ws[0].stats.requests == 0


async def test_method_not_allowed_and_unknown_paths() -> None:
    async with stubs(1) as ws, run_gateway(StaticSource([static("m", ws)]), KEYS, settings()) as gw:
        async with gw.client(headers=AUTH) as c:
            r = await c.get("/v1/chat/completions")
            missing = await c.post("/v1/embeddings", json={})
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("header", [None, "Bearer sk-wrong-key-000", f"Token {KEY}"])
async def test_missing_or_wrong_key_is_401(header: str | None) -> None:
    async with stubs(1) as ws, run_gateway(StaticSource([static("m", ws)]), KEYS, settings()) as gw:
        headers = {"authorization": header} if header else {}
        async with gw.client(headers=headers) as c:
            r = await c.post("/v1/chat/completions", json=chat())
            models = await c.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert models.status_code == 401
    assert ws[0].stats.requests == 0


async def test_models_lists_known_models() -> None:
    table = RoutingTable(
        {
            "a": DeploymentRoute("a", "a", variants=(variant_route("full", 1, []), variant_route("int4", 1, []))),
            "b": DeploymentRoute("b", "b", variants=(variant_route("full", 1, []),)),
        }
    )
    async with run_gateway(FixedSource(table), KEYS, settings()) as gw, gw.client(headers=AUTH) as c:
        r = await c.get("/v1/models")
    assert [m["id"] for m in r.json()["data"]] == ["a", "a:full", "a:int4", "b"]


async def test_rate_limit_429_with_headers() -> None:
    tiers = (TierSettings(name="standard", priority=10, requests_per_minute=2, tokens_per_minute=10_000),)
    tiers += (
        TierSettings(name="premium", priority=20, requests_per_minute=None),
        TierSettings(name="batch", priority=0),
    )
    async with stubs(1) as ws, run_gateway(StaticSource([static("m", ws)]), KEYS, settings(tiers=tiers)) as gw:
        async with gw.client(headers=AUTH) as c:
            ok = [await c.post("/v1/chat/completions", json=chat(max_tokens=8)) for _ in range(2)]
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=8))
            premium = await c.post(
                "/v1/chat/completions", json=chat(max_tokens=8), headers={"authorization": f"Bearer {PREMIUM_KEY}"}
            )
            metrics = await gw.metrics_text()
    assert [x.status_code for x in ok] == [200, 200]
    assert ok[0].headers["x-ratelimit-limit-requests"] == "2"
    assert ok[0].headers["x-ratelimit-remaining-requests"] == "1"
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-limit-tokens"] == "10000"
    assert {"x-ratelimit-reset-requests", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"} <= set(r.headers)
    assert premium.status_code == 200  # another key, unlimited tier
    assert ws[0].stats.requests == 3
    assert 'llmfleet_gateway_rate_limit_rejections_total{limit="requests",tier="standard"} 1.0' in metrics


async def test_streamed_output_tokens_count_against_the_token_limit() -> None:
    tiers = (
        TierSettings(name="standard", priority=10, tokens_per_minute=20),
        TierSettings(name="premium", priority=20),
        TierSettings(name="batch", priority=0),
    )
    async with (
        stubs(1, tokens=30) as ws,
        run_gateway(StaticSource([static("m", ws)]), KEYS, settings(tiers=tiers)) as gw,
    ):
        async with gw.client(headers=AUTH) as c:
            first = await c.post("/v1/chat/completions", json=chat(stream=True, content="hi"))
            second = await c.post("/v1/chat/completions", json=chat(stream=True, content="hi"))
    assert first.status_code == 200 and len(events(first.text)) == 31
    assert second.status_code == 429 and second.json()["error"]["message"].startswith("rate limit reached for tokens")


@pytest.mark.parametrize("failure", ["503", "429", "429_tokenizer", "reset", "refused"])
async def test_retries_another_pod_before_the_first_byte(failure: str) -> None:
    async with stubs(3 if failure != "reset" else 2, tokens=4) as ws:  # a reset is retried once only: one bad pod
        good, bad = ws[0], ws[1:]
        for b in bad:
            b.mode = failure if failure != "refused" else "ok"
        table = one_variant_table("m", ws)
        if failure == "refused":
            for b in bad:
                await b.stop()
        async with run_gateway(FixedSource(table), KEYS, settings(max_attempts=3)) as gw, gw.client(headers=AUTH) as c:
            for i in range(12):
                r = await c.post("/v1/chat/completions", json=chat(stream=i % 2 == 0, content=f"q{i}"))
                assert r.status_code == 200, r.text
            metrics = await gw.metrics_text()
    assert good.stats.requests == 12 and good.stats.completed == 12
    if failure != "refused":
        assert sum(b.stats.requests for b in bad) > 0  # the failing pods were tried, and every try moved on
    assert "llmfleet_gateway_retries_total" in metrics and 'status="200"} 12.0' in metrics


async def test_when_every_pod_refuses_the_last_answer_is_returned() -> None:
    async with (
        stubs(2, mode="503") as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, settings(max_attempts=5)) as gw,
    ):
        async with gw.client(headers=AUTH) as c:
            r = await c.post("/v1/chat/completions", json=chat(stream=True))
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["message"] == "draining"
    assert [w.stats.requests for w in ws] == [1, 1]  # each pod once, never twice
    assert gw.state.outstanding == {}


@pytest.mark.parametrize(
    ("failure", "status", "code"),
    [
        ("engine_dead", 503, "engine_dead"),  # the request may have killed the engine: never offer it to another
        ("429_other", 429, "rate_limit_exceeded"),  # a 4xx other than the worker's queue-full is the client's
        ("400", 400, "bad_request"),
    ],
)
async def test_answers_that_a_retry_could_repeat_are_passed_through_untried_elsewhere(
    failure: str, status: int, code: str
) -> None:
    async with (
        stubs(3, mode=failure) as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, settings(max_attempts=3)) as gw,
    ):
        async with gw.client(headers=AUTH) as c:
            for stream in (True, False):
                r = await c.post("/v1/chat/completions", json=chat(stream=stream, max_tokens=4))
                assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert sum(w.stats.requests for w in ws) == 2  # one pod per request, never a second
    assert gw.state.outstanding == {}


async def test_a_connection_reset_is_retried_once_only() -> None:
    """A worker that dies while reading a request (a poison request crashing the process) resets the connection;
    one retry covers the benign race with a keep-alive close, a second would spread the poison."""
    async with (
        stubs(3, mode="reset") as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, settings(max_attempts=3)) as gw,
    ):
        async with gw.client(headers=AUTH) as c:
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=4))
    assert r.status_code == 502
    assert sum(w.stats.requests for w in ws) == 2
    assert gw.state.outstanding == {}


async def test_never_retried_after_the_first_byte() -> None:
    async with stubs(2, mode="midstream", fail_after=2, tokens=10) as ws:
        async with run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, settings(max_attempts=3)) as gw:
            async with gw.client(headers=AUTH) as c:
                r = await c.post("/v1/chat/completions", json=chat(stream=True))
                metrics = await gw.metrics_text()
    assert r.status_code == 200  # committed at the first byte
    evs = events(r.text)
    assert len(evs) == 3 and "[DONE]" not in evs
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in evs[:2]] == ["tok0 ", "tok1 "]
    assert json.loads(evs[2])["error"]["code"] == "upstream_failed_midstream"
    assert sum(w.stats.requests for w in ws) == 1  # no second upstream call
    assert 'kind="midstream"' in metrics
    assert gw.state.outstanding == {}


async def test_client_disconnect_mid_stream_reaches_the_worker() -> None:
    async with (
        stubs(1, delay=0.02, tokens=10_000) as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, settings()) as gw,
    ):
        async with gw.client(headers=AUTH) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                seen = 0
                async for chunk in r.aiter_raw():
                    seen += chunk.count(b"data:")
                    if seen >= 3:
                        break
        await eventually(lambda: ws[0].stats.disconnects == 1, "the worker saw the disconnect")
        await eventually(
            lambda: gw.state.outstanding == {} and gw.state.admission.in_flight == 0, "bookkeeping released"
        )
        assert ws[0].stats.active == 0 and ws[0].stats.completed == 0
        assert gw.state.client is not None
        async with gw.client(headers=AUTH) as c:
            metrics = await gw.metrics_text()
        assert 'kind="client_disconnect"' in metrics


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_before_the_first_byte_reaches_the_worker(stream: bool) -> None:
    async with (
        stubs(1, mode="hang") as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, settings()) as gw,
    ):
        async with gw.client(headers=AUTH) as c:
            req = asyncio.create_task(c.post("/v1/chat/completions", json=chat(stream=stream)))
            await eventually(lambda: ws[0].stats.active == 1, "the worker got the request")
            req.cancel()
            await asyncio.gather(req, return_exceptions=True)
        await eventually(
            lambda: ws[0].stats.disconnects == 1 and ws[0].stats.active == 0, "the worker saw the disconnect"
        )
        await eventually(
            lambda: gw.state.outstanding == {} and gw.state.admission.in_flight == 0, "bookkeeping released"
        )


async def test_first_byte_timeout_is_504_and_not_retried() -> None:
    s = settings(timeouts=TimeoutSettings(first_byte=0.2), max_attempts=3)
    async with stubs(2, mode="hang") as ws, run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, s) as gw:
        async with gw.client(headers=AUTH) as c:
            r = await c.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        assert sum(w.stats.requests for w in ws) == 1
        await eventually(lambda: sum(w.stats.disconnects for w in ws) == 1, "the hung worker was released")


async def test_read_timeout_between_chunks_ends_the_stream_with_an_error_event() -> None:
    s = settings(timeouts=TimeoutSettings(read=0.2))
    async with stubs(1, delay=5.0, tokens=3) as ws, run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, s) as gw:
        async with gw.client(headers=AUTH) as c:
            r = await c.post("/v1/chat/completions", json=chat(stream=True))
        evs = events(r.text)
        assert len(evs) == 2 and json.loads(evs[1])["error"]["code"] == "upstream_failed_midstream"
        await eventually(lambda: ws[0].stats.disconnects == 1, "the slow worker was released")


async def test_tier_picks_its_variant_and_suffix_picks_any() -> None:
    async with stubs(2) as (main, batch):
        table = RoutingTable(
            {
                "m": DeploymentRoute(
                    "m",
                    "m",
                    "ns",
                    (variant_route("full", 1, [main]), variant_route("cheap", 0, [batch], tiers=("batch",))),
                )
            }
        )
        async with run_gateway(FixedSource(table), KEYS, settings()) as gw, gw.client(headers=AUTH) as c:
            plain = await c.post("/v1/chat/completions", json=chat())
            by_header = await c.post("/v1/chat/completions", json=chat(), headers={"x-llmfleet-tier": "batch"})
            by_key = await c.post("/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {BATCH_KEY}"})
            by_suffix = await c.post("/v1/chat/completions", json=chat(model="m:cheap"))
    assert [r.headers["x-llmfleet-variant"] for r in (plain, by_header, by_key, by_suffix)] == [
        "full",
        "cheap",
        "cheap",
        "cheap",
    ]
    assert (main.stats.requests, batch.stats.requests) == (1, 3)


async def test_saturation_sheds_low_tiers_queues_standard_and_lets_premium_through() -> None:
    tiers = (
        TierSettings(name="premium", priority=20, bypass_queue=True),
        TierSettings(name="standard", priority=10),
        TierSettings(name="batch", priority=0, shed_above_in_flight=1),
    )
    s = settings(tiers=tiers, max_in_flight=1, admission_wait_seconds=30)
    async with stubs(1, mode="hang") as ws, run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, s) as gw:
        async with gw.client(headers=AUTH) as c:
            first = asyncio.create_task(c.post("/v1/chat/completions", json=chat(stream=True)))
            await eventually(lambda: ws[0].stats.active == 1, "the first request holds the only slot")
            batch = await c.post("/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {BATCH_KEY}"})
            queued = asyncio.create_task(c.post("/v1/chat/completions", json=chat(stream=True)))
            await eventually(lambda: gw.state.admission.queued == 1, "standard waits for admission")
            premium = asyncio.create_task(
                c.post(
                    "/v1/chat/completions", json=chat(stream=True), headers={"authorization": f"Bearer {PREMIUM_KEY}"}
                )
            )
            await eventually(lambda: ws[0].stats.active == 2, "premium bypassed the queue")
            assert gw.state.admission.queued == 1
            ws[0].mode = "ok"
            first.cancel()  # frees the slot: the queued request goes on
            await eventually(lambda: gw.state.admission.queued == 0, "the queued request was admitted")
            assert (await queued).status_code == 200
            premium.cancel()
            await asyncio.gather(first, premium, return_exceptions=True)
            metrics = await gw.metrics_text()
    assert batch.status_code == 503 and batch.json()["error"]["code"] == "overloaded" and batch.headers["retry-after"]
    assert 'llmfleet_gateway_shed_total{reason="shed",tier="batch"} 1.0' in metrics


async def test_scaled_to_zero_variant_holds_requests_and_exports_the_queue() -> None:
    async with stubs(1, tokens=3) as ws:
        ws[0].ready = False
        async with run_gateway(
            StaticSource([static("m", ws, variant="v")]), KEYS, settings(zero_hold_seconds=60)
        ) as gw:
            async with gw.client(headers=AUTH) as c:
                held = asyncio.create_task(c.post("/v1/chat/completions", json=chat(stream=True)))
                await eventually(lambda: gw.state.hold.counts != {}, "the request is held")
                queued = (await c.get("/internal/queued")).json()
                metrics = await gw.metrics_text()
                assert queued == {"queued": [{"namespace": "", "deployment": "m", "variant": "v", "queued": 1}]}
                assert 'llmfleet_gateway_queued_at_zero{deployment="m",namespace="",variant="v"} 1.0' in metrics
                assert ws[0].stats.requests == 0
                ws[0].ready = True  # the autoscaler woke it: the next health check publishes it
                r = await asyncio.wait_for(held, 30)
                assert r.status_code == 200 and events(r.text)[-1] == "[DONE]"
                assert (await c.get("/internal/queued")).json() == {"queued": []}
            async with gw.client() as anonymous:  # it names deployments: no key, no answer
                assert (await anonymous.get("/internal/queued")).status_code == 401


async def test_hold_is_bounded_in_time_and_size() -> None:
    async with stubs(1) as ws:
        ws[0].ready = False
        s = settings(zero_hold_seconds=0.2, zero_hold_queue_size=1)
        async with run_gateway(StaticSource([static("m", ws)]), KEYS, s) as gw, gw.client(headers=AUTH) as c:
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_backend" and r.headers["retry-after"]
        s2 = settings(zero_hold_seconds=60, zero_hold_queue_size=1)
        async with run_gateway(StaticSource([static("m", ws)]), KEYS, s2) as gw, gw.client(headers=AUTH) as c:
            held = asyncio.create_task(c.post("/v1/chat/completions", json=chat()))
            await eventually(lambda: gw.state.hold.counts != {}, "the first request is held")
            full = await c.post("/v1/chat/completions", json=chat())
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
            await eventually(lambda: gw.state.hold.counts == {}, "the cancelled hold is released")
    assert full.status_code == 503 and "hold queue is full" in full.json()["error"]["message"]


async def test_health_ready_and_metrics() -> None:
    async with stubs(2, tokens=2) as ws:
        ws[1].ready = False
        async with run_gateway(StaticSource([static("m", ws)]), KEYS, settings()) as gw, gw.client(headers=AUTH) as c:
            assert (await c.get("/health")).json() == {"status": "ok"}
            assert (await c.get("/ready")).json() == {"status": "ready", "backends": 1}
            for stream in (True, False):
                assert (await c.post("/v1/chat/completions", json=chat(stream=stream))).status_code == 200
            text = await gw.metrics_text()
    for needle in (
        'llmfleet_gateway_requests_total{adapter="",model="m",status="200"} 2.0',
        'llmfleet_gateway_time_to_first_token_seconds_count{model="m"} 1.0',
        'llmfleet_gateway_inter_token_latency_seconds_count{model="m"} 1.0',  # one per stream
        'llmfleet_gateway_output_tokens_total{adapter="",model="m"} 4.0',
        f'llmfleet_gateway_backend_outstanding_requests{{backend="{ws[0].url}",deployment="m",variant="default"}} 0.0',
        "llmfleet_gateway_ready_backends 1.0",
        "llmfleet_gateway_in_flight_requests 0.0",
    ):
        assert needle in text, needle
    assert ws[1].stats.requests == 0  # the unready backend got no traffic


async def test_upstream_client_error_passes_through_without_retry() -> None:
    async with stubs(2, mode="400") as ws, run_gateway(FixedSource(one_variant_table("m", ws)), KEYS, settings()) as gw:
        async with gw.client(headers=AUTH) as c:
            r = await c.post("/v1/chat/completions", json=chat(stream=True))
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens too large"
    assert sum(w.stats.requests for w in ws) == 1
