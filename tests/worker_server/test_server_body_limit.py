"""The worker's body cap: a body over `max_body_bytes` is a 413 (OpenAI error body) whether its length is declared
or it arrives chunked, and the worker answers before reading the rest (so a huge body is never read whole)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from pydantic import ValidationError
from worker.server.settings import WorkerSettings

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def capped(module_launcher):
    return module_launcher(max_body_bytes=LIMIT, drain_token="t0ken")


def _connect(base_url: str) -> tuple[socket.socket, str]:
    host, port = base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10), host


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    """Read one HTTP answer with a Content-Length body (bounded reads)."""
    data = b""
    for _ in range(1000):
        if b"\r\n\r\n" in data:
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            if len(rest) >= int(headers["content-length"]):
                return int(lines[0].split()[1]), headers, json.loads(rest[: int(headers["content-length"])])
        part = sock.recv(65536)
        if not part:
            break
        data += part
    pytest.fail(f"no complete answer: {data[:200]!r}")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/drain"])
def test_declared_length_over_the_cap_is_413_before_the_body(capped, path: str) -> None:
    sock, host = _connect(capped.base_url)
    with sock:  # only the headers: a worker that waited for the body would never answer
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {60 * 1024 * 1024}\r\n\r\n".encode()
        )
        status, headers, body = _read_answer(sock)
    assert status == 413 and headers["connection"] == "close" and headers["x-request-id"]
    assert body["error"]["code"] == "body_too_large" and body["error"]["type"] == "invalid_request_error"
    assert str(LIMIT) in body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_chunked_body_over_the_cap_is_413_before_its_end(capped, path: str) -> None:
    sock, host = _connect(capped.base_url)
    chunk = b"x" * 16 * 1024
    with sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        for _ in range(LIMIT // len(chunk) + 2):  # past the cap, and never the terminating chunk
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        status, headers, body = _read_answer(sock)
    assert status == 413 and headers["connection"] == "close"
    assert body["error"]["code"] == "body_too_large"
    assert capped.metric("llmfleet:request_errors_total", code="413") >= 1


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_at_the_cap_is_read(capped, chunked: bool) -> None:
    prefix = b'{"max_tokens": 1, "prompt": "'
    raw = prefix + b"a" * (LIMIT - len(prefix) - 2) + b'"}'
    assert len(raw) == LIMIT
    content = iter([raw]) if chunked else raw  # an iterator: httpx sends it chunked
    r = capped.http().post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code != 413, r.text


@pytest.mark.parametrize(("value", "ok"), [(1023, False), (1024, True), (8 * 1024 * 1024, True)])
def test_cap_setting_bounds(value: int, ok: bool) -> None:
    if ok:
        assert WorkerSettings(model="m", max_body_bytes=value).max_body_bytes == value
    else:
        with pytest.raises(ValidationError, match="max_body_bytes"):
            WorkerSettings(model="m", max_body_bytes=value)


def test_default_cap_is_8_mib() -> None:
    assert WorkerSettings(model="m").max_body_bytes == 8 * 1024 * 1024


def test_small_requests_are_untouched(capped) -> None:
    r = httpx.post(capped.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200
