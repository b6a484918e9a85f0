"""Pure policy: API keys, token buckets and per-key limits, tiers and admission decisions (time passed in)."""

from __future__ import annotations

import asyncio
import base64

import pytest

from gateway.admission import Admission, Rejected, ZeroHold
from gateway.auth import OPEN_MODE_KEY_ID, KeyFileError, KeyStore, key_id, keys_from_secret, parse_keys
from gateway.ratelimit import RateLimiter, TokenBucket, estimate_prompt_tokens, format_reset
from gateway.settings import GatewaySettings, TierSettings
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
    ("seconds", "text"), [(0, "0s"), (-1, "0s"), (0.0004, "1ms"), (0.25, "250ms"), (1.5, "1.5s"), (59.4, "59.4s"), (360, "6m0s"), (90.4, "1m30s")]
)
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


@pytest.mark.parametrize(("prompt", "tokens"), [("", 1), ("abc", 1), ("abcd", 1), ("abcde", 2), ("x" * 400, 100)])
def test_estimate_prompt_tokens(prompt: str, tokens: int) -> None:
    assert estimate_prompt_tokens(prompt) == tokens


LIMITED = TierSettings(name="standard", priority=10, requests_per_minute=2, tokens_per_minute=100)


def test_limiter_rejects_on_requests_with_headers_and_takes_nothing() -> None:
    rl = RateLimiter()
    v1 = rl.check("k", LIMITED, 10, now=0.0)
    assert v1.allowed and v1.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "90",
        "x-ratelimit-reset-tokens": "6s",
    }
    assert rl.check("k", LIMITED, 10, now=0.0).allowed
    v3 = rl.check("k", LIMITED, 10, now=0.0)
    assert (v3.allowed, v3.limit, v3.headers["retry-after"]) == (False, "requests", "30")
    assert v3.headers["x-ratelimit-remaining-requests"] == "0"
    assert v3.headers["x-ratelimit-remaining-tokens"] == "80"  # the rejected request took no tokens
    assert rl.check("other", LIMITED, 10, now=0.0).allowed  # per key
    assert rl.check("k", LIMITED, 10, now=30.0).allowed  # one request refilled after 30 s


def test_limiter_rejects_on_tokens_and_counts_streamed_output() -> None:
    rl = RateLimiter()
    assert rl.check("k", LIMITED, 50, now=0.0).allowed
    rl.charge_tokens("k", LIMITED, 45, now=0.0)  # output streamed: 5 tokens left
    v = rl.check("k", LIMITED, 10, now=0.0)
    assert (v.allowed, v.limit) == (False, "tokens")
    assert v.retry_after == pytest.approx(5 * 60 / 100)
    assert v.headers["retry-after"] == "3"
    assert rl.check("k", LIMITED, 10, now=3.0).allowed


def test_unlimited_tier_sends_no_headers() -> None:
    v = RateLimiter().check("k", TierSettings(name="premium", priority=1), 10**6, now=0.0)
    assert v.allowed and v.headers == {}


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
def test_admission_decision(tier: TierSettings, in_flight: int, max_in_flight: int, queued: int, queue_size: int, expected: Admit) -> None:
    assert admission_decision(tier, in_flight, max_in_flight, queued, queue_size) is expected


async def test_admission_hands_freed_slots_to_the_highest_priority_first() -> None:
    adm = Admission(GatewaySettings(max_in_flight=1, admission_queue_size=10, admission_wait_seconds=30))
    await adm.acquire(STANDARD)
    order: list[str] = []

    async def wait(tier: TierSettings, tag: str) -> None:
        await adm.acquire(tier)
        order.append(tag)

    low = TierSettings(name="low", priority=0)
    tasks = [asyncio.create_task(wait(t, tag)) for t, tag in [(low, "low1"), (STANDARD, "std1"), (low, "low2"), (STANDARD, "std2")]]
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
