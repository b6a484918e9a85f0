"""What the worker reveals when something goes wrong: 500s carry a generic message and a request id (details only
in the log), every answer carries `x-request-id`, bodies that are not JSON are 400s, and the API docs are off."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest
from worker.server.fake_engine import FakeEngine

SECRET = "/opt/models/secret-weights.bin"


class _Failing(FakeEngine):
    """A fake engine that fails where told: in tokenize, or in generate after its first output."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def tokenize(self, text: str) -> list[int]:
        if self.where == "tokenize":
            raise RuntimeError(f"tokenizer crashed reading {SECRET}")
        return super().tokenize(text)

    async def generate(self, prompt, params, request_id, priority=0):  # type: ignore[override]
        async for out in super().generate(prompt, params, request_id, priority):
            yield out
            if self.where == "generate":
                raise RuntimeError(f"kernel failed on {SECRET}")


def _assert_generic_500(response: httpx.Response, caplog: pytest.LogCaptureFixture) -> str:
    assert response.status_code == 500
    request_id = response.headers["x-request-id"]
    error = response.json()["error"]
    assert error["type"] == "server_error"
    assert request_id in error["message"]
    assert SECRET not in response.text and "RuntimeError" not in response.text
    assert SECRET in caplog.text and request_id in caplog.text  # the details are in the log, under that id
    return request_id


@pytest.mark.parametrize(
    ("where", "path", "body"),
    [
        ("tokenize", "/v1/completions", {"prompt": "hi", "max_tokens": 3}),
        ("tokenize", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("generate", "/v1/completions", {"prompt": "hi", "max_tokens": 3}),
    ],
)
def test_500_is_generic_with_a_request_id(start_worker, caplog, where: str, path: str, body: dict[str, Any]) -> None:
    caplog.set_level(logging.ERROR)
    live = start_worker(_Failing(where))
    _assert_generic_500(live.http().post(path, json=body), caplog)


def test_500_in_a_stream_is_generic(start_worker, caplog) -> None:
    caplog.set_level(logging.ERROR)
    live = start_worker(_Failing("generate"))
    with live.http().stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}) as s:
        request_id = s.headers["x-request-id"]
        text = "\n".join(s.iter_lines())
    assert '"code":"engine_error"' in text.replace(" ", "") and request_id in text
    assert SECRET not in text and "RuntimeError" not in text
    assert SECRET in caplog.text


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("gw-7f3a9c", True),  # the gateway's id: logs on both sides line up
        ("a" * 128, True),
        ("a" * 129, False),  # too long
        ("two words", False),  # not a token
        ("x\u00e9", False),
    ],
)
def test_request_id_header(shared_worker, given: str, kept: bool) -> None:
    r = httpx.get(shared_worker.base_url + "/health", headers={"x-request-id": given.encode("utf-8")}, timeout=10)
    assert r.status_code == 200
    assert (r.headers["x-request-id"] == given) is kept
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", r.headers["x-request-id"])


def test_every_answer_has_a_request_id(shared_worker) -> None:
    http = shared_worker.http()
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    missing = http.get("/nope")
    assert ok.status_code == 200 and missing.status_code == 404
    assert ok.headers["x-request-id"] != missing.headers["x-request-id"]


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"{", "invalid_json"),
        (b"\xff\xfe{}", "invalid_json"),
        (b"[]", "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),  # nested past the parser's recursion limit
        (b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", "invalid_json"),  # past int's digit limit
    ],
)
def test_unparsable_body_is_400(shared_worker, raw: bytes, code: str) -> None:
    r = shared_worker.http().post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_api_docs_are_off(shared_worker, path: str) -> None:
    r = httpx.get(shared_worker.base_url + path, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
