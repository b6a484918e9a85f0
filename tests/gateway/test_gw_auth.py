"""The gateway fails closed and answers errors in OpenAI's shape: no key loaded -> 503 saying why (probes excepted),
missing/wrong key -> 401, open mode only by name; unparsable or too deeply nested JSON -> 400; an unexpected
exception -> a generic 500 with a request id (details only in the log); `/metrics` only on the internal port."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from gateway.auth import OPEN_MODE_KEY_ID, KeyStore, key_id
from gateway.middleware import internal_error_message, request_id
from gateway.settings import GatewaySettings
from gateway.sources import (
    KubeConnection,
    KubeSource,
    malformed_secret_message,
    missing_secret_message,
)
from gateway.testing import FixedSource, chat, one_variant_table, run_gateway, stubs

KEY = "sk-auth-test-key-1"
AUTH = {"authorization": f"Bearer {KEY}"}
NOT_LOADED = missing_secret_message("llm", "gw-keys")


def settings() -> GatewaySettings:
    return GatewaySettings(health_interval_seconds=0.05)


# ------------------------------------------------------------------------------------------- the key store


@pytest.mark.parametrize(
    ("store", "header", "principal"),
    [
        (KeyStore({}, "standard"), None, None),
        (KeyStore({}, "standard"), f"Bearer {KEY}", None),
        (KeyStore({}, "standard", unavailable=NOT_LOADED), f"Bearer {KEY}", None),
        (KeyStore({KEY: "premium"}, "standard"), None, None),
        (KeyStore({KEY: "premium"}, "standard"), "Bearer sk-wrong-key-00", None),
        (KeyStore({KEY: "premium"}, "standard"), f"Bearer {KEY}", "premium"),
        (KeyStore.open("standard"), None, "standard"),
    ],
)
def test_an_empty_store_refuses_everyone_and_only_open_accepts_without_a_key(
    store: KeyStore, header: str | None, principal: str | None
) -> None:
    p = store.authenticate(header)
    assert (p.tier if p else None) == principal


@pytest.mark.parametrize(
    ("store", "unavailable", "open_mode", "key_ids"),
    [
        (KeyStore({}, "standard"), "no API keys are loaded", False, set()),
        (KeyStore({}, "standard", unavailable=NOT_LOADED), NOT_LOADED, False, set()),
        (KeyStore({KEY: "batch"}, "standard", unavailable=NOT_LOADED), None, False, {key_id(KEY)}),
        (KeyStore.open("standard"), None, True, {OPEN_MODE_KEY_ID}),
    ],
)
def test_store_state(store: KeyStore, unavailable: str | None, open_mode: bool, key_ids: set[str]) -> None:
    assert (store.unavailable, store.open_mode) == (unavailable, open_mode)
    assert store.key_ids() == key_ids


# ----------------------------------------------------------------------------- the gateway without keys loaded


class _KeysFromSecret:
    """A discovery source that routes to stubs and plays the Secret watch: `apply` is what a Secret event does."""

    def __init__(self, table: Any, secret: dict[str, Any] | None) -> None:
        self.fixed = FixedSource(table)
        self.kube = KubeSource(KubeConnection("http://unused", False, dict), keys_secret=("llm", "gw-keys"))
        self.secret = secret
        self.state: Any = None

    async def start(self, state: Any) -> None:
        self.state = state
        await self.fixed.start(state)
        self.apply(self.secret)

    async def stop(self) -> None:
        await self.fixed.stop()

    def apply(self, secret: dict[str, Any] | None) -> None:
        self.kube._apply_keys(self.state, secret)


def secret(text: str) -> dict[str, Any]:
    return {"metadata": {"name": "gw-keys", "namespace": "llm"}, "stringData": {"api-keys": text}}


@pytest.mark.parametrize(
    ("initial", "reason"),
    [
        (None, NOT_LOADED),
        (secret("# no keys yet\n"), NOT_LOADED),
        (secret("short\n"), malformed_secret_message("llm", "gw-keys")),
    ],
    ids=["missing", "no-keys", "malformed"],
)
async def test_a_gateway_without_keys_refuses_everything_with_503_until_the_secret_has_keys(
    initial: dict[str, Any] | None, reason: str
) -> None:
    async with stubs(1, tokens=2) as ws:
        source = _KeysFromSecret(one_variant_table("m", ws), initial)
        async with run_gateway(source, settings=settings()) as gw, gw.client() as c:
            for method, path, kw in (
                ("POST", "/v1/chat/completions", {"json": chat(), "headers": {"x-llmfleet-tier": "premium"}}),
                ("POST", "/v1/chat/completions", {"json": chat(), "headers": AUTH}),
                ("GET", "/v1/models", {}),
                ("GET", "/internal/queued", {"headers": AUTH}),
                ("GET", "/metrics", {}),
            ):
                r = await c.request(method, path, **kw)
                assert r.status_code == 503, (path, r.text)
                assert r.json()["error"] == {
                    "message": reason,
                    "type": "api_error",
                    "param": None,
                    "code": "api_keys_not_loaded",
                }
                assert r.headers["retry-after"] == "1" and r.headers["x-request-id"]
            assert (await c.get("/health")).status_code == 200  # liveness: the process is fine
            ready = await c.get("/ready")
            assert ready.status_code == 503 and ready.json() == {"status": "no API keys", "reason": reason}

            source.apply(secret(f"{KEY} premium\n"))  # the Secret gets a key: picked up
            assert (await c.get("/ready")).status_code == 200
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 401
            assert (await c.get("/v1/models")).status_code == 401
            assert (await c.get("/internal/queued")).status_code == 401
            assert (await c.post("/v1/chat/completions", json=chat(), headers=AUTH)).status_code == 200

            source.apply(None)  # the Secret is deleted: every key is dropped
            r = await c.post("/v1/chat/completions", json=chat(), headers=AUTH)
            assert r.status_code == 503 and r.json()["error"]["message"] == NOT_LOADED
            assert ws[0].stats.requests == 1


async def test_keys_removed_from_the_secret_stop_working() -> None:
    other = "sk-auth-test-key-2"
    async with stubs(1, tokens=2) as ws:
        source = _KeysFromSecret(one_variant_table("m", ws), secret(f"{KEY}\n{other}\n"))
        async with run_gateway(source, settings=settings()) as gw, gw.client() as c:
            assert (await c.get("/v1/models", headers={"authorization": f"Bearer {other}"})).status_code == 200
            source.apply(secret(f"{KEY}\n"))
            assert (await c.get("/v1/models", headers={"authorization": f"Bearer {other}"})).status_code == 401
            assert (await c.get("/v1/models", headers=AUTH)).status_code == 200


async def test_open_mode_only_when_asked_for() -> None:
    async with stubs(1, tokens=2) as ws:
        table = one_variant_table("m", ws)
        async with run_gateway(FixedSource(table), settings=settings()) as gw, gw.client() as c:
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 503
            assert (await c.get("/ready")).status_code == 503
        async with run_gateway(FixedSource(table), settings=settings(), open_mode=True) as gw, gw.client() as c:
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
            assert (await c.get("/ready")).status_code == 200


# ------------------------------------------------------------------------------ bad JSON, 500s and request ids


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json"),
        (b'{"model": "m", "x": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}", "invalid_json"),
        (b"\xff\xfe", "invalid_json"),
    ],
    ids=["unparsable", "nested-arrays", "nested-objects", "not-utf8"],
)
async def test_bad_json_is_a_400_in_openai_shape(body: bytes, code: str) -> None:
    async with (
        stubs(1) as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), {KEY: "standard"}, settings()) as gw,
        gw.client(headers={**AUTH, "content-type": "application/json"}) as c,
    ):
        r = await c.post("/v1/chat/completions", content=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == code
    assert ws[0].stats.requests == 0


class _Exploding:
    """A routing table whose every use raises: an unexpected bug behind a handler."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("secret detail /var/run/pod-10.1.2.3")


async def test_an_unexpected_exception_is_a_generic_500_with_the_request_id(caplog: pytest.LogCaptureFixture) -> None:
    async with (
        stubs(1) as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), {KEY: "standard"}, settings()) as gw,
    ):
        gw.state.table = _Exploding()  # type: ignore[assignment]
        async with gw.client(headers=AUTH) as c:
            with caplog.at_level(logging.ERROR, logger="llmfleet.gateway"):
                mine = await c.get("/v1/models", headers={"x-request-id": "trace-42"})
                theirs = await c.post("/v1/chat/completions", json=chat())
    assert mine.status_code == 500 and mine.headers["x-request-id"] == "trace-42"
    assert mine.json()["error"] == {
        "message": internal_error_message("trace-42"),
        "type": "api_error",
        "param": None,
        "code": "internal_error",
    }
    rid = theirs.headers["x-request-id"]
    assert theirs.status_code == 500 and len(rid) == 32
    assert theirs.json()["error"]["message"] == internal_error_message(rid)
    for r in (mine, theirs):
        assert "secret detail" not in r.text and "Traceback" not in r.text
    logged = [r for r in caplog.records if r.exc_info]
    assert {f"(request id {i})" for i in ("trace-42", rid)} == {r.getMessage().split(" failed ")[1] for r in logged}
    assert all("secret detail" in str(r.exc_info[1]) for r in logged if r.exc_info)


@pytest.mark.parametrize(
    ("presented", "kept"),
    [
        (b"abc-123", True),
        (b"A.b:c_d-9", True),
        (b"x" * 128, True),
        (b"x" * 129, False),
        (b"a b", False),
        (b"", False),
        (b"\xff", False),
        (None, False),
    ],
)
def test_request_id_is_kept_only_when_well_formed(presented: bytes | None, kept: bool) -> None:
    rid = request_id(presented)
    assert (rid == presented) is kept
    assert len(rid) == 32 or kept


async def test_request_id_is_echoed_and_forwarded() -> None:
    async with (
        stubs(1, tokens=2) as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), {KEY: "standard"}, settings()) as gw,
        gw.client(headers=AUTH) as c,
    ):
        ok = await c.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "req-1"})
        refused = await c.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer nope-nope-nope"})
        bad = await c.post("/v1/chat/completions", content=b"{", headers={"x-request-id": "bad id!"})
    assert ok.status_code == 200 and ok.headers.get_list("x-request-id") == ["req-1"]
    assert refused.status_code == 401 and len(refused.headers["x-request-id"]) == 32
    assert bad.status_code == 400 and bad.headers["x-request-id"] != "bad id!"


# --------------------------------------------------------------------------------------- metrics port


async def test_metrics_are_served_on_the_internal_port_only() -> None:
    async with (
        stubs(1, tokens=2) as ws,
        run_gateway(FixedSource(one_variant_table("m", ws)), {KEY: "standard"}, settings()) as gw,
    ):
        async with gw.client(headers=AUTH) as c:
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
            public = await c.get("/metrics")
        text = await gw.metrics_text()
        async with httpx.AsyncClient(base_url=gw.metrics_url, trust_env=False) as m:
            other = await m.get("/v1/models")
    assert public.status_code == 404 and public.json()["error"]["code"] == "not_found"
    assert ws[0].url not in public.text
    assert 'llmfleet_gateway_requests_total{adapter="",model="m",status="200"} 1.0' in text and ws[0].url in text
    assert other.status_code == 404


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 9000, "metrics_port": 9000}, "metrics_port equals port"),
        ({"metrics_port": 70000}, "less than or equal"),
    ],
)
def test_metrics_port_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewaySettings(**kwargs)
