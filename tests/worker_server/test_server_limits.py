"""Load-dependent answers on a live worker: queue full (429), per-request deadlines, model loading and load
failure, and fault injection."""

from __future__ import annotations

import json
import threading

import openai
import pytest
from worker.server.fake_engine import FakeEngine
from worker.server.settings import FaultSettings


def _open_stream(http, prompt: str):
    """Open a streaming completion and return (response context, line iterator) once its headers are in."""
    ctx = http.stream(
        "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0}
    )
    response = ctx.__enter__()
    assert response.status_code == 200
    return ctx, response.iter_lines()


def test_full_queue_is_429_with_retry_after(start_worker, gated, wait) -> None:
    engine, gate = gated(max_num_seqs=1)
    live = start_worker(engine, max_waiting=1, retry_after_s=4)
    http = live.http()
    running, running_lines = _open_stream(http, "a")
    wait(lambda: engine.stats().num_running == 1, "the first request to run")
    queued, queued_lines = _open_stream(live.http(), "b")
    wait(lambda: engine.stats().num_waiting == 1, "the second request to wait")
    with pytest.raises(openai.RateLimitError) as info:
        live.openai().completions.create(model="fake-model", prompt="c", max_tokens=2)
    assert info.value.response.headers["retry-after"] == "4"
    error = info.value.response.json()["error"]
    assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
    assert live.metric("llmfleet:request_errors_total", code="429") == 1
    gate.set()
    for ctx, lines in ((running, running_lines), (queued, queued_lines)):
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
        ctx.__exit__(None, None, None)
    r = live.openai().completions.create(model="fake-model", prompt="c", max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_deadline_header_aborts_a_request(start_worker, gated) -> None:
    engine, _gate = gated()  # never opens: the deadline is the only way out
    live = start_worker(engine)
    http = live.http()
    r = http.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 9}, headers={"X-LLMFleet-Timeout-Seconds": "0.2"}
    )
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "deadline_exceeded" and "0.2 s" in r.json()["error"]["message"]
    with http.stream(
        "POST",
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 9, "stream": True},
        headers={"X-LLMFleet-Timeout-Seconds": "0.2"},
    ) as s:
        events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
    assert json.loads(events[-2])["error"]["code"] == "deadline_exceeded"
    assert len(set(engine.aborted)) == 2 and engine.stats().num_running == 0
    assert live.metric("llmfleet:request_errors_total", code="504") == 1
    assert live.metric("llmfleet:request_errors_total", code="stream_aborted") == 1
    assert live.metric("vllm:request_success_total", finished_reason="abort") == 2


def test_deadline_setting_and_bad_header(start_worker, gated) -> None:
    engine, _gate = gated()
    live = start_worker(engine, request_timeout_s=0.2)
    http = live.http()
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 9}).status_code == 504
    # a header may shorten the deadline but never extend it beyond the setting
    assert (
        http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 9}, headers={"X-LLMFleet-Timeout-Seconds": "600"}
        ).status_code
        == 504
    )
    for bad in ("0", "-1", "soon", "inf", "nan"):
        r = http.post("/v1/completions", json={"prompt": "x"}, headers={"X-LLMFleet-Timeout-Seconds": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-llmfleet-timeout-seconds", bad


class SlowStartEngine(FakeEngine):
    """start() waits for `loaded` (set by the test), or fails when `fail` is set."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.release = threading.Event()
        self.fail = fail

    async def start(self) -> None:
        import asyncio

        for _ in range(3000):
            if self.release.is_set():
                break
            await asyncio.sleep(0.01)
        if self.fail:
            raise OSError("weights not found")
        await super().start()


def test_not_ready_while_loading(start_worker, wait) -> None:
    engine = SlowStartEngine()
    live = start_worker(engine, wait_loaded=False)
    http = live.http()
    assert http.get("/health").status_code == 200
    ready = http.get("/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "loading"
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "loading"
    engine.release.set()
    wait(lambda: http.get("/ready").status_code == 200, "readiness after load")
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_load_failure_stops_the_worker_with_exit_code_1(start_worker) -> None:
    engine = SlowStartEngine(fail=True)
    live = start_worker(engine, wait_loaded=False)
    engine.release.set()
    live.thread.join(timeout=15)
    assert not live.thread.is_alive() and live.worker.exit_code == 1
    assert "weights not found" in live.service.load_error


def test_fault_injection(start_worker) -> None:
    failing = start_worker(faults=FaultSettings(error_rate=1.0))
    with pytest.raises(openai.InternalServerError) as info:
        failing.openai().completions.create(model="fake-model", prompt="x", max_tokens=2)
    assert info.value.response.json()["error"]["code"] == "injected_fault"
    assert failing.metric("llmfleet:request_errors_total", code="500") == 1

    slow = start_worker(faults=FaultSettings(ttft_delay_ms=100, itl_delay_ms=20))
    slow.openai().completions.create(model="fake-model", prompt="x", max_tokens=3)
    # sleeps are lower bounds: the client-visible latencies include the injected delays
    assert slow.metric("vllm:time_to_first_token_seconds_sum") >= 0.1
    assert slow.metric("vllm:inter_token_latency_seconds_sum") >= 0.04
