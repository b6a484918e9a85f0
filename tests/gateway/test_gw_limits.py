"""Pure policy: API keys, token buckets and per-key limits, tiers and admission decisions (time passed in); then
the limits end to end through a gateway on loopback against stub workers (reservation, usage, refunds)."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import replace

import pytest

from gateway.admission import Admission, Rejected, ZeroHold
from gateway.auth import (
    OPEN_MODE_KEY_ID,
    KeyFileError,
    KeyStore,
    key_id,
    keys_from_secret,
    parse_keys,
)
from gateway.ratelimit import (
    ADAPTER_TOKENS,
    CONCURRENCY,
    CostError,
    RateLimiter,
    TokenBucket,
    estimate_prompt_tokens,
    format_reset,
    replica_cap,
    request_cost,
)
from gateway.routing import RoutingTable
from gateway.settings import GatewaySettings, TierSettings
from gateway.stub import StubWorker
from gateway.testing import (
    FixedSource,
    chat,
    eventually,
    one_variant_table,
    run_gateway,
    stubs,
)
from gateway.tiers import Admit, TierError, admission_decision, resolve_tier

TIERS = ["premium", "standard", "batch"]
SECRET_KEY = "sk-very-secret-123"


# ------------------------------------------------------------------------------------------------------ auth


def test_parse_keys() -> None:
    text = "# comment\n\nsk-aaaaaaaa premium\n  sk-bbbbbbbb  \nsk-cccccccc BATCH\n"
    assert parse_keys(text, TIERS, "standard", "f") == {
        "sk-aaaaaaaa": "premium",
        "sk-bbbbbbbb": "standard",
        "sk-cccccccc": "batch",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{SECRET_KEY} premium extra", "f line 1: expected `KEY [TIER]`, found 3 fields"),
        ("short", "f line 1: a key must be at least 8 printable"),
        (f"\n{SECRET_KEY} gold", "f line 2: unknown tier 'gold'"),
        (f"{SECRET_KEY}\n{SECRET_KEY} batch", "f line 2: this key is listed twice"),
    ],
)
def test_parse_keys_errors_name_the_line_never_the_key(text: str, message: str) -> None:
    with pytest.raises(KeyFileError) as e:
        parse_keys(text, TIERS, "standard", "f")
    assert str(e.value).startswith(message)
    assert SECRET_KEY not in str(e.value)


def test_keys_from_secret() -> None:
    text = f"{SECRET_KEY} premium\n"
    secret = {"metadata": {"name": "keys"}, "data": {"api-keys": base64.b64encode(text.encode()).decode()}}
    assert keys_from_secret(secret, "api-keys", TIERS, "standard") == {SECRET_KEY: "premium"}
    assert keys_from_secret({"stringData": {"k": text}}, "k", TIERS, "standard") == {SECRET_KEY: "premium"}
    with pytest.raises(KeyFileError, match="has no such data item"):
        keys_from_secret(secret, "other", TIERS, "standard")
    with pytest.raises(KeyFileError, match="not base64"):
        keys_from_secret({"data": {"api-keys": "***"}}, "api-keys", TIERS, "standard")


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"Bearer {SECRET_KEY}", ("premium", key_id(SECRET_KEY))),
        (f"bearer   {SECRET_KEY} ", ("premium", key_id(SECRET_KEY))),
        ("Bearer sk-other-key-1", ("batch", key_id("sk-other-key-1"))),
        (f"Basic {SECRET_KEY}", None),
        (f"Bearer {SECRET_KEY}x", None),
        (f"Bearer {SECRET_KEY[:-1]}", None),
        ("Bearer ", None),
        ("", None),
        (None, None),
    ],
)
def test_authenticate(header: str | None, expected: tuple[str, str] | None) -> None:
    store = KeyStore({SECRET_KEY: "premium", "sk-other-key-1": "batch"}, "standard")
    p = store.authenticate(header)
    assert (None if p is None else (p.tier, p.key_id)) == expected
    assert p is None or SECRET_KEY not in repr(p)


def test_open_mode_accepts_everyone_at_the_default_tier() -> None:
    store = KeyStore.open("standard")  # only by name: an empty KeyStore refuses everyone (test_gw_auth.py)
    assert store.open_mode
    p = store.authenticate(None)
    assert p is not None and (p.key_id, p.tier, p.open_mode) == (OPEN_MODE_KEY_ID, "standard", True)


# ---------------------------------------------------------------------------------------------- token buckets


def test_token_bucket_refills_continuously_and_allows_debt() -> None:
    b = TokenBucket.per_minute(60, now=0.0)  # 1 per second, burst 60
    assert b.wait_for(60, 0.0) == 0
    b.take(60, 0.0)
    assert b.wait_for(1, 0.0) == pytest.approx(1.0)
    assert b.wait_for(1, 0.5) == pytest.approx(0.5)
    b.take(10, 1.0)  # debt: level -9
    assert b.remaining(1.0) == 0
    assert b.wait_for(1, 1.0) == pytest.approx(10.0)
    assert b.reset_seconds(1.0) == pytest.approx(69.0)
    assert b.wait_for(1000, 200.0) == 0  # more than the capacity is allowed once the bucket is full
    assert b.remaining(1e9) == 60  # never above capacity


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1, "0s"),
        (0.0004, "1ms"),
        (0.25, "250ms"),
        (1.5, "1.5s"),
        (59.4, "59.4s"),
        (360, "6m0s"),
        (90.4, "1m30s"),
    ],
)
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


@pytest.mark.parametrize(("prompt", "tokens"), [("", 1), ("abc", 1), ("abcd", 1), ("abcde", 2), ("x" * 400, 100)])
def test_estimate_prompt_tokens(prompt: str, tokens: int) -> None:
    assert estimate_prompt_tokens(prompt) == tokens


LIMITED = TierSettings(name="standard", priority=10, requests_per_minute=2, tokens_per_minute=100)


def test_limiter_rejects_on_requests_with_headers_and_takes_nothing() -> None:
    rl = RateLimiter()
    v1 = rl.admit("k", LIMITED, 10, now=0.0)
    assert v1.allowed and v1.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "90",
        "x-ratelimit-reset-tokens": "6s",
    }
    assert rl.admit("k", LIMITED, 10, now=0.0).allowed
    v3 = rl.admit("k", LIMITED, 10, now=0.0)
    assert (v3.allowed, v3.limit, v3.headers["retry-after"], v3.reservation) == (False, "requests", "30", None)
    assert v3.headers["x-ratelimit-remaining-requests"] == "0"
    assert v3.headers["x-ratelimit-remaining-tokens"] == "80"  # the rejected request took no tokens
    assert rl.admit("other", LIMITED, 10, now=0.0).allowed  # per key
    assert rl.admit("k", LIMITED, 10, now=30.0).allowed  # one request refilled after 30 s


def test_limiter_reserves_then_settles_from_usage() -> None:
    rl = RateLimiter()
    first = rl.admit("k", LIMITED, 50, now=0.0).reservation
    assert first is not None
    rl.settle(first, 95, now=0.0)  # used more than reserved: 5 tokens left
    rl.settle(first, 0, now=0.0)  # settling twice changes nothing
    v = rl.admit("k", LIMITED, 10, now=0.0)
    assert (v.allowed, v.limit) == (False, "tokens")
    assert v.retry_after == pytest.approx(5 * 60 / 100)
    assert v.headers["retry-after"] == "3"
    second = rl.admit("k", LIMITED, 60, now=3.0).reservation  # 10 available: a reservation over the level waits
    assert second is None
    big = rl.admit("k", LIMITED, 1000, now=60.0).reservation  # larger than a full bucket: admitted when full
    assert big is not None and rl.buckets["k"].tokens is not None
    assert not rl.admit("k", LIMITED, 1, now=60.0).allowed  # ... and the key is in debt
    rl.settle(big, 20, now=60.0)  # refund of the unused part, never above the capacity
    assert rl.buckets["k"].tokens.remaining(60.0) == 80


def test_limiter_keeps_the_reservation_when_no_usage_arrives() -> None:
    rl = RateLimiter()
    r = rl.admit("k", LIMITED, 70, now=0.0).reservation
    assert r is not None
    rl.settle(r, None, now=0.0)
    assert rl.buckets["k"].tokens is not None and rl.buckets["k"].tokens.remaining(0.0) == 30


def test_limiter_caps_requests_in_progress_per_key() -> None:
    tier = TierSettings(name="standard", priority=10, max_concurrent_requests=2)
    rl = RateLimiter()
    held = [rl.admit("k", tier, 1, now=0.0).reservation for _ in range(2)]
    v = rl.admit("k", tier, 1, now=0.0)
    assert (v.allowed, v.limit, v.headers["retry-after"]) == (False, CONCURRENCY, "1")
    assert rl.admit("other", tier, 1, now=0.0).allowed
    assert held[0] is not None
    rl.settle(held[0], 1, now=0.0)
    assert rl.admit("k", tier, 1, now=0.0).allowed


@pytest.mark.parametrize(
    ("cap", "replicas", "each"),
    [(8, 1, 8), (8, 2, 4), (9, 2, 4), (3, 3, 1), (1, 2, 1), (64, 5, 12)],
)
def test_replica_cap_never_sums_above_the_cap_unless_it_is_below_the_replicas(cap: int, replicas: int, each: int):
    assert replica_cap(cap, replicas) == each
    assert each * replicas <= max(cap, replicas)


def test_replicas_together_hold_every_limit_of_a_key() -> None:
    """Two gateway replicas, a key whose requests alternate between them (kube-proxy balances connections): at one
    instant they admit its requests/minute, tokens/minute and requests at a time once in all, not once each."""
    replicas = [RateLimiter(replicas=2), RateLimiter(replicas=2)]

    def admitted(tier: TierSettings, tokens: int, n: int) -> int:
        return sum(replicas[i % 2].admit(tier.name, tier, tokens, now=0.0).allowed for i in range(n))

    assert admitted(TierSettings(name="rpm", priority=1, requests_per_minute=10), 1, 40) == 10
    assert admitted(TierSettings(name="tpm", priority=1, tokens_per_minute=1000), 100, 40) == 10
    assert admitted(TierSettings(name="cap", priority=1, max_concurrent_requests=6), 1, 40) == 6
    alone = TierSettings(name="k", priority=1, requests_per_minute=10)
    single = RateLimiter()  # one replica: the whole limit
    assert sum(single.admit("k", alone, 1, now=0.0).allowed for _ in range(40)) == 10
    v = replicas[0].admit("h", TierSettings(name="h", priority=1, requests_per_minute=10), 1, now=0.0)
    assert v.headers["x-ratelimit-limit-requests"] == "5"  # what this replica enforces, as Retry-After is
    replicas[0].sync_adapters({SQL: 600}, now=0.0)
    assert replicas[0].adapters[SQL].capacity == 300


def test_unlimited_tier_sends_no_headers() -> None:
    tier = TierSettings(name="premium", priority=1, max_concurrent_requests=None)
    v = RateLimiter().admit("k", tier, 10**6, now=0.0)
    assert v.allowed and v.headers == {}


def test_default_tiers_have_limits() -> None:
    for tier in GatewaySettings().tiers:
        assert tier.requests_per_minute and tier.tokens_per_minute and tier.max_concurrent_requests, tier


SQL = ("ns", "smol", "sql")


def test_adapter_bucket_is_shared_by_every_key_and_checked_with_the_keys_own() -> None:
    rl = RateLimiter()
    rl.sync_adapters({SQL: 600}, now=0.0)
    shared = rl.adapters[SQL]
    unlimited = TierSettings(name="premium", priority=1, max_concurrent_requests=None)
    a = rl.admit("a", unlimited, 400, now=0.0, shared=shared)
    assert a.allowed and a.reservation is not None and shared.remaining(0.0) == 200
    b = rl.admit("b", unlimited, 300, now=0.0, shared=shared)  # another key: the same bucket is short
    assert (b.allowed, b.limit, b.headers["retry-after"], b.reservation) == (False, ADAPTER_TOKENS, "10", None)
    assert b.retry_after == pytest.approx(100 / 10)  # 600/min = 10 tokens/s, 100 missing
    assert rl.buckets["b"].in_flight == 0  # a rejected request holds no slot
    assert rl.admit("b", unlimited, 300, now=0.0).allowed  # the base model (no adapter bucket) is not limited
    rl.settle(a.reservation, 50, now=0.0)  # usage settles the adapter bucket too: 350 refunded
    assert shared.remaining(0.0) == 550
    # the key's own limit still applies to adapter requests, and the longest wait names the limit
    v = rl.admit("k", LIMITED, 200, now=0.0, shared=shared)
    assert (v.allowed, v.limit) == (True, None)  # a full key bucket admits one oversized request
    assert shared.remaining(0.0) == 350
    v = rl.admit("k", LIMITED, 50, now=0.0, shared=shared)
    assert (v.allowed, v.limit) == (False, "tokens") and shared.remaining(0.0) == 350  # nothing taken


def test_adapter_bucket_keeps_the_reservation_without_usage() -> None:
    rl = RateLimiter()
    rl.sync_adapters({SQL: 600}, now=0.0)
    r = rl.admit("k", LIMITED, 100, now=0.0, shared=rl.adapters[SQL]).reservation
    assert r is not None
    rl.settle(r, None, now=0.0)
    assert rl.adapters[SQL].remaining(0.0) == 500


def test_sync_adapters_follows_the_routing_table() -> None:
    rl = RateLimiter()
    other = ("ns", "smol", "poet")
    rl.sync_adapters({SQL: 600, other: 60}, now=0.0)
    sql = rl.adapters[SQL]
    sql.take(500, 0.0)
    rl.sync_adapters({SQL: 600, other: 60}, now=0.0)  # unchanged: the same bucket, its level kept
    assert rl.adapters[SQL] is sql and sql.remaining(0.0) == 100
    rl.sync_adapters({SQL: 60}, now=0.0)  # changed: resized in place (held reservations settle on it), capped
    assert rl.adapters[SQL] is sql and (sql.capacity, sql.rate, sql.remaining(0.0)) == (60, 1.0, 60)
    assert other not in rl.adapters  # removed
    rl.sync_adapters({SQL: 60, other: 120}, now=0.0)  # new: full
    assert rl.adapters[other].remaining(0.0) == 120
    rl.sync_adapters({}, now=0.0)
    assert rl.adapters == {}


@pytest.mark.parametrize(
    ("body", "prompt", "max_model_len", "cost"),
    [
        ({"max_tokens": 100}, "x" * 40, 4096, (10, 100)),
        ({"max_completion_tokens": 50, "max_tokens": 100}, "x" * 40, 4096, (10, 50)),
        ({}, "x" * 40, 4096, (10, 4086)),  # no max_tokens: the rest of the context
        ({}, "x" * 40_000, 4096, (10_000, 1)),  # the prompt alone overflows: the worker refuses it
        ({"max_tokens": 10**9}, "x" * 40, 4096, (10, 4096)),  # never more than the context
        ({"max_tokens": 100, "n": 3}, "", 4096, (1, 300)),
        ({"max_tokens": 100, "n": 2, "best_of": 4}, "", 4096, (1, 400)),
        ({"max_tokens": 10, "prompt": ["aaaa", "bbbbbbbb", "c"]}, "ignored", 4096, (4, 30)),  # a batch of prompts
        ({"max_tokens": 10, "prompt": [1, 2, 3, 4, 5]}, "1 2 3 4 5", 4096, (5, 10)),  # token ids count as tokens
        ({"max_tokens": 10, "prompt": [[1, 2], [3, 4, 5]]}, "1 2", 4096, (5, 20)),
        ({"max_tokens": None}, "x" * 4, 100, (1, 99)),
    ],
)
def test_request_cost(body: dict, prompt: str, max_model_len: int, cost: tuple[int, int]) -> None:
    c = request_cost(body, prompt, max_model_len)
    assert (c.prompt_tokens, c.output_tokens) == cost and c.total == sum(cost)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": "100"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"best_of": "9"}, "best_of"),
    ],
)
def test_request_cost_refuses_numbers_it_cannot_bound(body: dict, param: str) -> None:
    with pytest.raises(CostError) as e:
        request_cost(body, "hi", 4096)
    assert e.value.param == param and f"`{param}` must be a positive integer" in str(e.value)


# ------------------------------------------------------------------------------------------- tiers, admission

S = GatewaySettings()
PREMIUM, STANDARD, BATCH = S.tier("premium"), S.tier("standard"), S.tier("batch")


@pytest.mark.parametrize(
    ("key_tier", "header", "may_raise", "expected"),
    [
        ("standard", None, False, "standard"),
        ("standard", "", False, "standard"),
        ("standard", "batch", False, "batch"),  # lowering is allowed
        ("premium", " Standard ", False, "standard"),
        ("standard", "premium", True, "premium"),  # open mode takes the header as given
        ("standard", "premium", False, 403),
        ("standard", "gold", False, 400),
    ],
)
def test_resolve_tier(key_tier: str, header: str | None, may_raise: bool, expected: str | int) -> None:
    if isinstance(expected, int):
        with pytest.raises(TierError) as e:
            resolve_tier(S.tiers, key_tier, header, may_raise)
        assert e.value.status == expected
    else:
        assert resolve_tier(S.tiers, key_tier, header, may_raise).name == expected


@pytest.mark.parametrize(
    ("tier", "in_flight", "max_in_flight", "queued", "queue_size", "expected"),
    [
        (STANDARD, 0, 10, 0, 5, Admit.ADMIT),
        (STANDARD, 10, 10, 0, 5, Admit.QUEUE),
        (STANDARD, 9, 10, 1, 5, Admit.QUEUE),  # others already wait: no overtaking
        (STANDARD, 10, 10, 5, 5, Admit.QUEUE_FULL),
        (PREMIUM, 50, 10, 5, 5, Admit.ADMIT),  # bypasses the queue under saturation
        (BATCH, 3071, 4096, 0, 5, Admit.ADMIT),
        (BATCH, 3072, 4096, 0, 5, Admit.SHED),  # shed first, before the gateway is even saturated
        (TierSettings(name="x", priority=1, shed_above_in_flight=0), 0, 10, 0, 5, Admit.SHED),
    ],
)
def test_admission_decision(
    tier: TierSettings, in_flight: int, max_in_flight: int, queued: int, queue_size: int, expected: Admit
) -> None:
    assert admission_decision(tier, in_flight, max_in_flight, queued, queue_size) is expected


async def test_admission_hands_freed_slots_to_the_highest_priority_first() -> None:
    adm = Admission(GatewaySettings(max_in_flight=1, admission_queue_size=10, admission_wait_seconds=30))
    await adm.acquire(STANDARD)
    order: list[str] = []

    async def wait(tier: TierSettings, tag: str) -> None:
        await adm.acquire(tier)
        order.append(tag)

    low = TierSettings(name="low", priority=0)
    tasks = [
        asyncio.create_task(wait(t, tag))
        for t, tag in [(low, "low1"), (STANDARD, "std1"), (low, "low2"), (STANDARD, "std2")]
    ]
    for _ in range(5):
        await asyncio.sleep(0)
    assert adm.queued == 4 and order == []
    for _ in range(4):
        adm.release()
        for _ in range(5):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["std1", "std2", "low1", "low2"]
    assert (adm.in_flight, adm.queued) == (1, 0)


async def test_admission_wait_is_bounded_and_cancellation_frees_the_place() -> None:
    adm = Admission(GatewaySettings(max_in_flight=1, admission_queue_size=1, admission_wait_seconds=0.05))
    await adm.acquire(STANDARD)
    with pytest.raises(Rejected) as e:
        await adm.acquire(STANDARD)
    assert e.value.reason == "queue_timeout" and adm.queued == 0
    waiter = asyncio.create_task(adm.acquire(STANDARD))
    await asyncio.sleep(0)
    with pytest.raises(Rejected, match="queue is full"):
        await adm.acquire(STANDARD)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert adm.queued == 0
    adm.release()
    assert adm.in_flight == 0


async def test_zero_hold_waits_for_the_table_and_is_bounded() -> None:
    hold = ZeroHold(GatewaySettings(zero_hold_queue_size=1, zero_hold_seconds=30))
    ready = False
    key = ("ns", "dep", "v")
    task = asyncio.create_task(hold.wait(key, lambda: ready, asyncio.get_running_loop().time))
    await asyncio.sleep(0)
    assert hold.counts == {key: 1}
    with pytest.raises(Rejected) as e:
        await hold.wait(key, lambda: ready, asyncio.get_running_loop().time)
    assert e.value.reason == "hold_full"
    hold.table_changed()  # a change that does not make it ready: still held
    await asyncio.sleep(0)
    assert not task.done()
    ready = True
    hold.table_changed()
    await asyncio.wait_for(task, 5)
    assert hold.counts == {}
    short = ZeroHold(GatewaySettings(zero_hold_seconds=0.05))
    with pytest.raises(Rejected) as e:
        await short.wait(key, lambda: False, asyncio.get_running_loop().time)
    assert e.value.reason == "hold_timeout" and short.counts == {}


# --------------------------------------------------------------------- limits end to end (gateway + stub workers)

LIMIT_KEY = "sk-test-key-limited"
LIMIT_AUTH = {"authorization": f"Bearer {LIMIT_KEY}"}


def _limited(**tier: object) -> GatewaySettings:
    tiers = (
        TierSettings(name="standard", priority=10, **tier),  # type: ignore[arg-type]
        TierSettings(name="premium", priority=20),
        TierSettings(name="batch", priority=0),
    )
    return GatewaySettings(health_interval_seconds=0.05, tiers=tiers)


def _table(ws: list[StubWorker], max_model_len: int | None = None) -> RoutingTable:
    table = one_variant_table("m", ws)
    if max_model_len is None:
        return table
    return RoutingTable({"m": replace(table.deployments["m"], max_model_len=max_model_len)})


def _sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


async def test_max_tokens_is_reserved_at_admission_so_concurrent_requests_cannot_overrun_the_limit() -> None:
    """30 concurrent requests of max_tokens=1000 on a 200 tokens/min key: one runs (a full bucket admits one
    request larger than itself), the other 29 get 429 with Retry-After instead of all running at once."""
    async with (
        stubs(1, delay=0.002) as ws,
        run_gateway(FixedSource(_table(ws)), {LIMIT_KEY: "standard"}, _limited(tokens_per_minute=200)) as gw,
    ):
        async with gw.client(headers=LIMIT_AUTH) as c:
            body = chat(stream=True, max_tokens=1000)
            answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(30)))
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200] + [429] * 29
    refused = [r for r in answers if r.status_code == 429]
    assert all(
        r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1 for r in refused
    )
    assert ws[0].stats.requests == 1


async def test_a_gateway_of_two_replicas_enforces_half_of_each_limit() -> None:
    """`limit_replicas` (the chart passes gateway.replicaCount) reaches the limiter: 4 requests/min over 2
    replicas admits 2 here, and the 429 says when to come back."""
    settings = _limited(requests_per_minute=4).model_copy(update={"limit_replicas": 2})
    async with (
        stubs(1) as ws,
        run_gateway(FixedSource(_table(ws)), {LIMIT_KEY: "standard"}, settings) as gw,
    ):
        async with gw.client(headers=LIMIT_AUTH) as c:
            answers = [await c.post("/v1/chat/completions", json=chat(max_tokens=4)) for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 429]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "2"
    assert int(answers[2].headers["retry-after"]) >= 1


async def test_streams_are_charged_from_the_workers_usage_not_by_counting_events() -> None:
    """A stop string that never matches holds text back: 1,500 tokens arrive as 2 events. The usage the worker
    reports is what counts, and the usage event the gateway asked for is not shown to a client that did not."""
    settings = _limited(tokens_per_minute=2000)
    async with (
        stubs(1, tokens_per_event=750) as ws,
        run_gateway(FixedSource(_table(ws)), {LIMIT_KEY: "standard"}, settings) as gw,
    ):
        async with gw.client(headers=LIMIT_AUTH) as c:
            first = await c.post("/v1/chat/completions", json=chat(stream=True, max_tokens=1500, stop=["never"]))
            second = await c.post("/v1/chat/completions", json=chat(stream=True, max_tokens=1000))
    assert first.status_code == 200
    evs = _sse_events(first.text)
    assert len(evs) == 3 and evs[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in evs[:-1])
    assert ws[0].stats.bodies[0]["stream_options"] == {"include_usage": True}
    assert second.status_code == 429, second.text  # 2000 - 1501 used < 1000 + prompt
    assert int(first.headers["x-ratelimit-remaining-tokens"]) < 500  # the reservation showed at admission


async def test_a_client_that_asked_for_usage_gets_it() -> None:
    async with (
        stubs(1, tokens=5) as ws,
        run_gateway(FixedSource(_table(ws)), {LIMIT_KEY: "standard"}, _limited()) as gw,
    ):
        async with gw.client(headers=LIMIT_AUTH) as c:
            body = chat(stream=True, max_tokens=5, stream_options={"include_usage": True})
            r = await c.post("/v1/chat/completions", json=body)
    evs = _sse_events(r.text)
    assert evs[-1] == "[DONE]" and json.loads(evs[-2])["usage"]["completion_tokens"] == 5
    assert len(evs) == 7


async def test_unused_reservation_is_refunded_with_max_model_len_from_the_routing_table() -> None:
    """Without max_tokens a request reserves the remaining context (the deployment's max_model_len minus the
    prompt); what the usage shows unused comes back, so short answers do not exhaust the key."""
    settings = _limited(tokens_per_minute=1000)
    async with (
        stubs(1, tokens=8) as ws,
        run_gateway(FixedSource(_table(ws, max_model_len=500)), {LIMIT_KEY: "standard"}, settings) as gw,
    ):
        async with gw.client(headers=LIMIT_AUTH) as c:
            answers = [await c.post("/v1/chat/completions", json=chat(stream=i % 2 == 0)) for i in range(4)]
            remaining = int(answers[-1].headers["x-ratelimit-remaining-tokens"])
    assert [r.status_code for r in answers] == [200] * 4
    assert 1000 - 3 * 9 - 500 <= remaining <= 1000 - 3 * 9 - 498  # three settled answers, one 499-token reservation


async def test_a_client_that_disconnects_mid_stream_is_charged_its_reservation() -> None:
    """Usage never arrives when the client leaves (the worker aborts): the reservation stands (fail safe)."""
    settings = _limited(tokens_per_minute=1000)
    async with (
        stubs(1, delay=0.02, tokens_per_event=1) as ws,
        run_gateway(FixedSource(_table(ws)), {LIMIT_KEY: "standard"}, settings) as gw,
    ):
        async with gw.client(headers=LIMIT_AUTH) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=900)) as r:
                async for chunk in r.aiter_raw():
                    if b"data:" in chunk:
                        break
            await eventually(lambda: gw.state.admission.in_flight == 0, "the request settled")
            after = await c.post("/v1/chat/completions", json=chat(max_tokens=300))
    assert after.status_code == 429, after.text


async def test_per_key_concurrency_cap() -> None:
    async with (
        stubs(1, mode="hang") as ws,
        run_gateway(FixedSource(_table(ws)), {LIMIT_KEY: "standard"}, _limited(max_concurrent_requests=2)) as gw,
    ):
        async with gw.client(headers=LIMIT_AUTH) as c:
            held = [asyncio.create_task(c.post("/v1/chat/completions", json=chat(max_tokens=4))) for _ in range(2)]
            await eventually(lambda: ws[0].stats.active == 2, "two requests reached the worker")
            third = await c.post("/v1/chat/completions", json=chat(max_tokens=4))
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            await eventually(lambda: gw.state.admission.in_flight == 0, "the held requests settled")
            ws[0].mode = "ok"
            fourth = await c.post("/v1/chat/completions", json=chat(max_tokens=4))
    assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_concurrent_requests"
    assert "2 requests at a time" in third.json()["error"]["message"] and third.headers["retry-after"] == "1"
    assert fourth.status_code == 200
