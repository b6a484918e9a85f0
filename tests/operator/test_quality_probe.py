"""The quality probe against live workers (the real server around the fake engine, whose greedy output is its
script) and against stub transports for every way a pod can fail."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from controllers.quality import PROBE_MAX_TOKENS, PROBE_PROMPTS
from fleet_operator.quality_probe import completion_request, response_tokens, run_probe
from worker.server.fake_engine import FakeEngine
from worker.server.serve import WorkerServer
from worker.server.settings import WorkerSettings


def _wait(predicate: Callable[[], Any], what: str, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def worker_url() -> Iterator[Callable[[str], str]]:
    """`worker_url(script)`: a live worker (fake engine replaying `script`) on its own loopback IP; its URL."""
    running: list[tuple[WorkerServer, threading.Thread]] = []

    def start(script: str) -> str:
        host = f"127.0.0.{40 + len(running)}"
        settings = WorkerSettings(model="fake://fake-model", engine="fake", host=host, port=0)
        worker = WorkerServer(FakeEngine(script=script), settings, configure_logging=False, log_level="warning")
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        running.append((worker, thread))
        _wait(lambda: worker.server.started or not thread.is_alive(), "the worker to start")
        assert thread.is_alive(), "the worker died during start-up"
        _wait(lambda: worker.service.loaded, "the engine to load")
        return f"http://{host}:{worker.port}"

    yield start
    for worker, thread in running:
        worker.server.should_exit = True
        thread.join(timeout=15)


STABLE_SCRIPT = "The quick brown fox jumps over the lazy dog. "
# Differs from the stable script at 5 of the first 16 bytes (the fake engine's tokens are bytes).
CANARY_SCRIPT = "The QUICK brown fox jumps over the lazy dog. "


async def test_identical_workers_agree_fully(worker_url: Callable[[str], str]) -> None:
    stable, canary = worker_url(STABLE_SCRIPT), worker_url(STABLE_SCRIPT)
    result = await run_probe(stable, canary, model="fake-model", timeout_s=30)
    assert result.agreement == 1.0, result.detail
    prompts = len(PROBE_PROMPTS)
    assert f"{prompts * PROBE_MAX_TOKENS}/{prompts * PROBE_MAX_TOKENS} tokens" in result.detail


async def test_a_different_canary_agrees_partly(worker_url: Callable[[str], str]) -> None:
    stable, canary = worker_url(STABLE_SCRIPT), worker_url(CANARY_SCRIPT)
    result = await run_probe(stable, canary, timeout_s=30)
    assert result.agreement == pytest.approx(11 / 16), result.detail
    assert "0/8 prompts identical" in result.detail


async def test_wrong_model_name_fails_the_probe(worker_url: Callable[[str], str]) -> None:
    stable, canary = worker_url(STABLE_SCRIPT), worker_url(STABLE_SCRIPT)
    result = await run_probe(stable, canary, model="not-served", timeout_s=30)
    assert result.agreement is None and "HTTP 404" in result.detail and "stable pod" in result.detail


# ------------------------------------------------------------------------------------------ stub transports


def stub(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def tokens_response(tokens: list[str]) -> httpx.Response:
    logprobs = {"tokens": tokens, "token_logprobs": [0.0] * len(tokens)}
    return httpx.Response(200, json={"choices": [{"index": 0, "text": "".join(tokens), "logprobs": logprobs}]})


def by_host(stable: Callable[[dict[str, Any]], httpx.Response],
            canary: Callable[[dict[str, Any]], httpx.Response]) -> Callable[[httpx.Request], httpx.Response]:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return (stable if request.url.host == "stable" else canary)(body)

    return handle


def echo_words(body: dict[str, Any]) -> httpx.Response:
    return tokens_response(body["prompt"].split()[:2])


async def test_requests_are_greedy_with_token_logprobs() -> None:
    seen: list[dict[str, Any]] = []

    def record(body: dict[str, Any]) -> httpx.Response:
        seen.append(body)
        return echo_words(body)

    async with stub(by_host(record, record)) as client:
        result = await run_probe("http://stable", "http://canary", prompts=["a b c", "d e"], max_tokens=5,
                                 client=client)
    assert result.agreement == 1.0
    assert len(seen) == 4
    assert seen[0] == completion_request("a b c", 5, None)
    assert {k: seen[0][k] for k in ("temperature", "logprobs", "max_tokens", "stream")} == {
        "temperature": 0, "logprobs": 0, "max_tokens": 5, "stream": False}
    assert "model" not in seen[0] and completion_request("x", 1, "m")["model"] == "m"


@pytest.mark.parametrize(
    ("canary", "fragment"),
    [
        (lambda body: httpx.Response(503, json={"error": {"message": "draining"}}),
         "canary pod http://canary: HTTP 503"),
        (lambda body: httpx.Response(200, content=b"not json"), "canary pod http://canary: the response is not JSON"),
        (lambda body: httpx.Response(200, json={"choices": [{"text": "x", "logprobs": None}]}),
         "no choices[0].logprobs.tokens"),
        (lambda body: httpx.Response(200, json={"choices": [{"logprobs": {"tokens": [1, 2]}}]}),
         "not a list of strings"),
        (lambda body: (_ for _ in ()).throw(httpx.ConnectError("refused")), "canary pod http://canary: ConnectError"),
        (lambda body: (_ for _ in ()).throw(httpx.ReadTimeout("slow")), "ReadTimeout"),
    ],
    ids=["503", "not json", "no logprobs", "token ids not strings", "connection refused", "timeout"],
)
async def test_failures_give_no_agreement_and_say_why(
    canary: Callable[[dict[str, Any]], httpx.Response], fragment: str
) -> None:
    async with stub(by_host(echo_words, canary)) as client:
        result = await run_probe("http://stable", "http://canary", client=client)
    assert result.agreement is None
    assert result.detail.startswith("quality probe failed:") and fragment in result.detail


async def test_agreement_uses_the_token_lists() -> None:
    def canary(body: dict[str, Any]) -> httpx.Response:
        words = body["prompt"].split()[:2]
        return tokens_response([words[0], "DIFFERENT"][: len(words)])

    async with stub(by_host(echo_words, canary)) as client:
        result = await run_probe("http://stable", "http://canary", prompts=["a b", "c d", "e"], client=client)
    # prompt 1: 1/2, prompt 2: 1/2, prompt 3: 1/1 -> 3/5
    assert result.agreement == pytest.approx(3 / 5)


def test_response_tokens_reads_token_id_labels() -> None:
    body = {"choices": [{"logprobs": {"tokens": ["token_id:1", "token_id:2"]}}]}
    assert response_tokens(body) == ["token_id:1", "token_id:2"]


@pytest.mark.parametrize(("kwargs", "message"), [({"prompts": []}, "at least one prompt"),
                                                 ({"max_tokens": 0}, "max_tokens must be at least 1")])
async def test_bad_arguments_are_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await run_probe("http://stable", "http://canary", **kwargs)
