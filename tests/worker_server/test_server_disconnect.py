"""A client that goes away aborts its engine request at once: streaming or not, before or after the first token."""

from __future__ import annotations

import pytest
from worker.server.fake_engine import FakeEngine


def _running_request_id(live, wait) -> str:
    wait(lambda: live.engine.stats().num_running == 1, "the request to run in the engine")
    return live.engine.submitted[-1][0]


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_after_first_token_aborts(start_worker, gated, raw_request, wait, stream) -> None:
    engine, gate = gated()  # never opened: the request stays in flight until the client leaves
    live = start_worker(engine)
    sock = raw_request(
        live.base_url, "/v1/completions", {"prompt": "hello", "max_tokens": 50, "stream": stream, "temperature": 0}
    )
    request_id = _running_request_id(live, wait)
    if stream:
        assert b"200 OK" in sock.recv(4096)  # the stream has started
    sock.close()
    wait(lambda: request_id in engine.aborted, "the engine abort")
    wait(lambda: len(live.service.inflight) == 0 and engine.stats().num_running == 0, "in-flight to drain")
    assert not gate.is_set()
    assert live.metric("llmfleet:request_errors_total", code="client_disconnect") == 1
    assert live.metric("vllm:request_success_total", finished_reason="abort") == 1


def test_disconnect_while_waiting_for_the_first_token_aborts_at_once(start_worker, raw_request, wait) -> None:
    """Nothing is written while the engine works on the first token: the disconnect must still be noticed (the
    fake engine's 60 s time-to-first-token is far beyond the wait below)."""
    engine = FakeEngine(ttft_s=60.0)
    live = start_worker(engine)
    sock = raw_request(
        live.base_url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True},
    )
    request_id = _running_request_id(live, wait)
    sock.close()
    wait(lambda: request_id in engine.aborted, "the engine abort", timeout_s=10)
    wait(lambda: engine.stats().num_running == 0, "the engine to free the request")


def test_disconnect_while_queued_aborts(start_worker, gated, raw_request, wait) -> None:
    engine, gate = gated(max_num_seqs=1)
    live = start_worker(engine)
    first = raw_request(live.base_url, "/v1/completions", {"prompt": "a", "max_tokens": 5, "stream": True})
    _running_request_id(live, wait)
    second = raw_request(live.base_url, "/v1/completions", {"prompt": "b", "max_tokens": 5, "stream": True})
    wait(lambda: engine.stats().num_waiting == 1, "the second request to queue")
    queued_id = engine.submitted[-1][0]
    second.close()
    wait(lambda: queued_id in engine.aborted and engine.stats().num_waiting == 0, "the queued request's abort")
    gate.set()
    assert b"[DONE]" in _read_all(first)


def _read_all(sock) -> bytes:
    data = b""
    for _ in range(1000):
        part = sock.recv(65536)
        if not part:
            break
        data += part
        if b"data: [DONE]" in data:
            break
    return data
