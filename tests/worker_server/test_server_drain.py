"""Lame-duck drain over HTTP: authentication of POST /drain, what a draining worker answers, in-flight streams
completing, the drain timeout aborting what is left, and a drained worker staying up, idle, until a signal (the
signal's exit is tested with a real process in test_server_process.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from worker.server.fake_engine import DEFAULT_SCRIPT, FakeEngine

TOKEN = "s3cret-drain-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "invalid_drain_token"),
        ({"Authorization": "Bearer wrong"}, 401, "invalid_drain_token"),
        ({"Authorization": f"Basic {TOKEN}"}, 401, "invalid_drain_token"),
        ({"Authorization": f"Bearer {TOKEN}x"}, 401, "invalid_drain_token"),
        ({"Authorization": f"Bearer {TOKEN[:-1]}"}, 401, "invalid_drain_token"),
    ],
)
def test_drain_needs_the_token(shared_token_worker, headers, status, code) -> None:
    r = httpx.post(shared_token_worker.base_url + "/drain", headers=headers, timeout=10)
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert httpx.get(shared_token_worker.base_url + "/ready", timeout=10).status_code == 200  # still serving


@pytest.fixture(scope="module")
def shared_token_worker(module_launcher):
    return module_launcher(FakeEngine(), drain_token=TOKEN)


def test_drain_is_disabled_without_a_token(start_worker) -> None:
    live = start_worker()
    r = httpx.post(live.base_url + "/drain", headers=AUTH, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "drain_disabled"
    assert "SIGTERM" in r.json()["error"]["message"]
    assert httpx.get(live.base_url + "/drain", timeout=10).json()["state"] == "serving"


def test_in_flight_stream_completes_and_new_requests_get_503(start_worker, gated, wait) -> None:
    engine, gate = gated()
    live = start_worker(engine, drain_token=TOKEN, retry_after_s=7)
    http = live.http()
    body = {"prompt": "hello", "max_tokens": 30, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "T"

        r = http.post("/drain", headers=AUTH)
        assert r.status_code == 202 and r.json()["state"] == "draining" and r.json()["reason"] == "POST /drain"
        assert http.post("/drain", headers=AUTH).status_code == 202  # idempotent

        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
        assert http.get("/health").status_code == 200
        refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "7"
        assert refused.json()["error"]["code"] == "draining"
        with pytest.raises(openai.InternalServerError):
            live.openai().completions.create(model="fake-model", prompt="x", max_tokens=2)

        status = http.get("/drain").json()
        assert (status["state"], status["inflight"], status["remaining_tokens_estimate"]) == ("draining", 1, 29)
        assert 0 < status["seconds_left"] <= 30
        assert live.metric("llmfleet:draining") == 1 and live.metric("llmfleet:inflight_requests") == 1
        assert live.worker.exit_code == 0 and not live.worker.server.should_exit

        gate.set()
        payloads = [
            json.loads(line.removeprefix("data: "))
            for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    text = "T" + "".join(p["choices"][0]["text"] for p in payloads)
    assert text == DEFAULT_SCRIPT[:30] and payloads[-1]["choices"][0]["finish_reason"] == "length"
    _assert_drained_and_idle(live, wait)
    assert not live.service.drain_status()["timed_out"]


def _assert_drained_and_idle(live, wait) -> None:
    """Drained, and still up: not ready (no traffic), alive (liveness keeps it), nothing in flight, no exit asked."""
    http = live.http()
    status = wait(lambda: (s := http.get("/drain").json())["state"] == "drained" and s, "the drain to finish")
    assert (status["draining"], status["inflight"], status["seconds_left"]) == (True, 0, None)
    ready = http.get("/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
    assert "has drained" in ready.json()["error"]["message"]
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    assert live.metric("llmfleet:draining") == 1 and live.metric("llmfleet:inflight_requests") == 0
    assert live.thread.is_alive() and not live.worker.server.should_exit


def test_idle_worker_stays_up_after_drain(start_worker, wait) -> None:
    live = start_worker(drain_token=TOKEN)
    assert httpx.post(live.base_url + "/drain", headers=AUTH, timeout=10).status_code == 202
    _assert_drained_and_idle(live, wait)


def test_drain_timeout_aborts_what_is_left(start_worker, gated, raw_request, wait) -> None:
    engine, _gate = gated()  # never opens: only the drain timeout can end these requests
    live = start_worker(engine, drain_token=TOKEN, drain_timeout_s=0.3)
    http = live.http()
    sock = raw_request(live.base_url, "/v1/completions", {"prompt": "a", "max_tokens": 20})  # not streaming
    wait(lambda: engine.stats().num_running == 1, "the first request to run")
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 20, "stream": True, "temperature": 0},
    ) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if '"content":"T"' in line)
        assert http.post("/drain", headers=AUTH).status_code == 202
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    aborted_chunk, error = json.loads(rest[-3]), json.loads(rest[-2])
    assert aborted_chunk["choices"][0]["finish_reason"] == "abort"
    assert error["error"]["code"] == "aborted" and "drain timeout" in error["error"]["message"]
    response = _read_response(sock)
    assert response.startswith(b"HTTP/1.1 503") and b'"code":"aborted"' in response
    _assert_drained_and_idle(live, wait)
    assert live.service.drain_status()["timed_out"]
    assert len(set(engine.aborted)) == 2 and engine.stats().num_running == 0


def _read_response(sock) -> bytes:
    data = b""
    for _ in range(1000):
        part = sock.recv(65536)
        if not part or b"}}" in data + part:
            return data + part
        data += part
    return data


def test_drain_before_the_model_loaded(start_worker, wait) -> None:
    live = start_worker(FakeEngine(load_s=30), wait_loaded=False, drain_token=TOKEN)
    ready = httpx.get(live.base_url + "/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "loading"
    assert httpx.post(live.base_url + "/drain", headers=AUTH, timeout=10).status_code == 202
    _assert_drained_and_idle(live, wait)
