"""The quality probe against live workers (the real server around the fake engine, whose greedy output is its
script and whose top token when scoring is the scored token itself) and against stub transports: the
teacher-forced protocol, the agreement it computes, and every way a pod can fail."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fleet_operator.quality_probe import generate_request, run_probe, score_request
from worker.server.fake_engine import FakeEngine
from worker.server.serve import WorkerServer
from worker.server.settings import WorkerSettings

from controllers.quality import PROBE_MAX_TOKENS, PROBE_PROMPTS


def _wait(predicate: Callable[[], Any], what: str, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def worker_url() -> Iterator[Callable[[str | Any], str]]:
    """`worker_url(script_or_engine)`: a live worker on its own loopback IP (a fake engine replaying a script, or
    the given engine); its URL."""
    running: list[tuple[WorkerServer, threading.Thread]] = []

    def start(script: str | Any) -> str:
        host = f"127.0.0.{40 + len(running)}"
        settings = WorkerSettings(model="fake://fake-model", engine="fake", host=host, port=0)
        engine = FakeEngine(script=script) if isinstance(script, str) else script
        worker = WorkerServer(engine, settings, configure_logging=False, log_level="warning")
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


async def test_identical_workers_agree_fully(worker_url: Callable[[str], str]) -> None:
    stable, canary = worker_url(STABLE_SCRIPT), worker_url(STABLE_SCRIPT)
    result = await run_probe(stable, canary, model="fake-model", timeout_s=30)
    assert result.agreement == 1.0, result.detail
    prompts = len(PROBE_PROMPTS)
    assert f"{prompts * PROBE_MAX_TOKENS}/{prompts * PROBE_MAX_TOKENS} tokens" in result.detail
    assert "teacher-forced" in result.detail


async def test_real_engines_agree_as_offline_teacher_forcing_says(worker_url, tmp_path) -> None:
    """fp32 stable vs fp8 canary of a tiny random Llama, over HTTP: the probe's number equals the one computed
    with the offline engine (stable's greedy continuation, then the canary's argmax at each of its positions)."""
    from worker import LLM, SamplingParams
    from worker.core.config import EngineConfig
    from worker.engine.async_engine import AsyncEngine
    from worker.model.testing import make_tiny_llama

    from controllers.quality import token_agreement

    model = str(make_tiny_llama(tmp_path / "tiny"))
    prompts = PROBE_PROMPTS[:4]
    stable_llm, canary_llm = LLM(model, num_blocks=64), LLM(model, quantization="fp8", num_blocks=64)
    conts = stable_llm.generate(list(prompts), SamplingParams(max_tokens=PROBE_MAX_TOKENS, temperature=0))
    scored = canary_llm.generate(
        [c.prompt_token_ids + c.token_ids for c in conts],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
    )
    expected = token_agreement(
        [c.token_ids for c in conts],
        [[lp.top[0][0] for lp in s.prompt_logprobs[len(c.prompt_token_ids) - 1 :]] for c, s in zip(conts, scored)],
    )
    stable = worker_url(AsyncEngine(EngineConfig(model=model, num_blocks=64)))
    canary = worker_url(AsyncEngine(EngineConfig(model=model, quantization="fp8", num_blocks=64)))
    result = await run_probe(stable, canary, prompts=prompts, timeout_s=60)
    assert result.agreement == expected.value and expected.value is not None, result.detail
    assert f"{expected.matched_tokens}/{expected.compared_tokens} tokens" in result.detail


async def test_wrong_model_name_fails_the_probe(worker_url: Callable[[str], str]) -> None:
    stable, canary = worker_url(STABLE_SCRIPT), worker_url(STABLE_SCRIPT)
    result = await run_probe(stable, canary, model="not-served", timeout_s=30)
    assert result.agreement is None and "HTTP 404" in result.detail and "stable pod" in result.detail


# ------------------------------------------------------------------------------------------ stub transports
# The stub "model" works on token ids: a prompt word is its length; stable continues with `STABLE_NEXT`, and a
# canary's argmax at each position comes from a function of the prefix.

STABLE_NEXT = [7, 8, 9]


def stub(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def label(token: int) -> str:
    return f"token_id:{token}"


def stable_answer(body: dict[str, Any]) -> httpx.Response:
    prompt = [len(w) for w in body["prompt"].split()]
    tokens = prompt + STABLE_NEXT[: body["max_tokens"]]
    logprobs = {
        "tokens": [label(t) for t in tokens],
        "token_logprobs": [None] + [-0.1] * (len(tokens) - 1),
        "top_logprobs": None,
    }
    return httpx.Response(
        200,
        json={
            "choices": [{"index": 0, "text": "...", "logprobs": logprobs}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 3},
        },
    )


def canary_scoring(best: Callable[[list[int]], int]) -> Callable[[dict[str, Any]], httpx.Response]:
    """A canary whose top token after a prefix is `best(prefix)` (and a worse runner-up)."""

    def answer(body: dict[str, Any]) -> httpx.Response:
        ids = body["prompt"]
        top = [None] + [{label(best(ids[:i])): -0.1, label(999): -5.0} for i in range(1, len(ids))]
        logprobs = {
            "tokens": [label(t) for t in ids + [1]],
            "token_logprobs": [None] + [-0.2] * len(ids),
            "top_logprobs": top + [{label(1): -0.1}],
        }
        return httpx.Response(
            200,
            json={
                "choices": [{"index": 0, "text": "...", "logprobs": logprobs}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1},
            },
        )

    return answer


def agrees(prefix: list[int]) -> int:
    """Predicts STABLE_NEXT exactly when teacher-forced on it (and garbage inside the prompt, which is not scored)."""
    return {7: 8, 8: 9}.get(prefix[-1], 7 if prefix[-1] < 7 else 0)


def by_host(
    stable: Callable[[dict[str, Any]], httpx.Response], canary: Callable[[dict[str, Any]], httpx.Response]
) -> Callable[[httpx.Request], httpx.Response]:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return (stable if request.url.host == "stable" else canary)(body)

    return handle


async def test_stable_generates_and_the_canary_scores_the_same_tokens() -> None:
    seen: dict[str, list[dict[str, Any]]] = {"stable": [], "canary": []}

    def record(role: str, answer: Callable[[dict[str, Any]], httpx.Response]):
        def handle(body: dict[str, Any]) -> httpx.Response:
            seen[role].append(body)
            return answer(body)

        return handle

    async with stub(by_host(record("stable", stable_answer), record("canary", canary_scoring(agrees)))) as client:
        result = await run_probe(
            "http://stable", "http://canary", prompts=["a bb ccc", "dd e"], max_tokens=3, client=client
        )
    assert result.agreement == 1.0, result.detail
    assert seen["stable"] == [generate_request("a bb ccc", 3, None), generate_request("dd e", 3, None)]
    assert {k: seen["stable"][0][k] for k in ("temperature", "echo", "logprobs", "max_tokens")} == {
        "temperature": 0,
        "echo": True,
        "logprobs": 0,
        "max_tokens": 3,
    }
    # the canary scores exactly the prompt's ids followed by stable's continuation
    assert seen["canary"] == [score_request([1, 2, 3, 7, 8, 9], None), score_request([2, 1, 7, 8, 9], None)]
    assert {k: seen["canary"][0][k] for k in ("echo", "logprobs", "temperature")} == {
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    assert "model" not in seen["stable"][0] and generate_request("x", 1, "m")["model"] == "m"


@pytest.mark.parametrize(
    ("best", "expected"),
    [
        (agrees, 1.0),
        (lambda prefix: 0, 0.0),
        # one flip at the first position costs one position only: the canary is forced back onto stable's tokens
        (lambda prefix: 5 if prefix[-1] < 7 else agrees(prefix), 4 / 6),
        (lambda prefix: agrees(prefix) if prefix[-1] != 8 else 4, 4 / 6),
    ],
    ids=["agrees", "never", "first position flips", "last position flips"],
)
async def test_agreement_counts_the_canary_argmax_per_position(
    best: Callable[[list[int]], int], expected: float
) -> None:
    async with stub(by_host(stable_answer, canary_scoring(best))) as client:
        result = await run_probe("http://stable", "http://canary", prompts=["a bb", "ccc"], max_tokens=3, client=client)
    assert result.agreement == pytest.approx(expected), result.detail


def malformed(field: str, value: Any) -> Callable[[dict[str, Any]], httpx.Response]:
    def answer(body: dict[str, Any]) -> httpx.Response:
        good = canary_scoring(agrees)(body).json()
        good["choices"][0]["logprobs"][field] = value
        return httpx.Response(200, json=good)

    return answer


@pytest.mark.parametrize(
    ("stable", "canary", "fragment"),
    [
        (
            stable_answer,
            lambda body: httpx.Response(503, json={"error": {"message": "draining"}}),
            "canary pod http://canary: HTTP 503",
        ),
        (
            stable_answer,
            lambda body: httpx.Response(200, content=b"not json"),
            "canary pod http://canary: the response is not JSON",
        ),
        (
            stable_answer,
            lambda body: httpx.Response(200, json={"choices": [{"text": "x", "logprobs": None}]}),
            "canary pod http://canary: choices[0].logprobs is missing",
        ),
        (stable_answer, malformed("top_logprobs", None), "top_logprobs must list at least"),
        (
            stable_answer,
            malformed("top_logprobs", [None, {}] + [{"token_id:1": 0.0}] * 5),
            "top_logprobs[1] is not a non-empty",
        ),
        (
            stable_answer,
            malformed("top_logprobs", [None, {"Paris": -0.1}] + [{"token_id:1": 0.0}] * 5),
            "not named by id",
        ),
        (
            lambda body: httpx.Response(200, json={"choices": [{"logprobs": {"tokens": ["token_id:1"]}}]}),
            canary_scoring(agrees),
            "stable pod http://stable: the response has no usage.prompt_tokens",
        ),
        (
            lambda body: httpx.Response(200, json={"choices": [{"logprobs": {"tokens": [1, 2]}}]}),
            canary_scoring(agrees),
            "not a list of strings",
        ),
        (
            lambda body: httpx.Response(
                200, json={"choices": [{"logprobs": {"tokens": ["token_id:1"]}}], "usage": {"prompt_tokens": 4}}
            ),
            canary_scoring(agrees),
            "is echo ignored?",
        ),
        (
            lambda body: httpx.Response(
                200, json={"choices": [{"logprobs": {"tokens": [" The", " capital"]}}], "usage": {"prompt_tokens": 1}}
            ),
            canary_scoring(agrees),
            "stable pod http://stable: token ' The' is not named by id",
        ),
        (
            stable_answer,
            lambda body: (_ for _ in ()).throw(httpx.ConnectError("refused")),
            "canary pod http://canary: ConnectError",
        ),
        (
            lambda body: (_ for _ in ()).throw(httpx.ReadTimeout("slow")),
            canary_scoring(agrees),
            "stable pod http://stable: ReadTimeout",
        ),
    ],
    ids=[
        "503",
        "not json",
        "no logprobs",
        "no top_logprobs",
        "empty top",
        "labels not ids",
        "no usage",
        "token ids not strings",
        "echo ignored",
        "stable labels not ids",
        "connection refused",
        "timeout",
    ],
)
async def test_failures_give_no_agreement_and_say_why(
    stable: Callable[[dict[str, Any]], httpx.Response],
    canary: Callable[[dict[str, Any]], httpx.Response],
    fragment: str,
) -> None:
    async with stub(by_host(stable, canary)) as client:
        result = await run_probe("http://stable", "http://canary", prompts=["a bb ccc"], max_tokens=3, client=client)
    assert result.agreement is None
    assert result.detail.startswith("quality probe failed:") and fragment in result.detail


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"prompts": []}, "at least one prompt"), ({"max_tokens": 0}, "max_tokens must be at least 1")],
)
async def test_bad_arguments_are_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await run_probe("http://stable", "http://canary", **kwargs)
