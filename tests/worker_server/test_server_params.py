"""Request parameters over HTTP against the real builtin engine on a tiny random Llama (issue #18, finding 1):
every field is bounded with a 400 naming it, token ids are checked against the model's vocabulary, a request
that fails inside the engine gets an error of its own, and none of this disturbs a stream running beside it."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

async_engine = pytest.importorskip("worker.engine.async_engine")
testing = pytest.importorskip("worker.model.testing")

from worker.core.config import EngineConfig  # noqa: E402

MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 16, 256  # worker.core.request's limits, spelled out: the test pins them

VOCAB = 384  # make_tiny_llama's default
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def live(module_launcher, tmp_path_factory):
    model_dir = testing.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    engine = async_engine.AsyncEngine(
        EngineConfig(model=str(model_dir), served_model_name="tiny", kv_cache_bytes=4_000_000)
    )
    return module_launcher(engine, model="tiny")


def assert_alive(live) -> None:
    """The engine still serves: no recorded failure, and a plain request completes."""
    assert live.engine._error is None and live.service.load_error is None
    r = httpx.post(live.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def post_json(live, path: str, body: dict) -> httpx.Response:
    """POST `body` as ASCII JSON (so lone surrogates travel as escapes, as a client's JSON encoder may send them)."""
    return httpx.post(
        live.base_url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30
    )


class Stream:
    """A long greedy stream read in a thread: its text and finish reason, to check it was not disturbed."""

    def __init__(self, base_url: str, max_tokens: int = 300) -> None:
        self.body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        self.chunks: list[dict] = []
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(base_url,), daemon=True)
        self.thread.start()
        assert self.first.wait(30), "the stream never started"

    def _read(self, base_url: str) -> None:
        with httpx.stream("POST", base_url + "/v1/completions", json=self.body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.chunks.append(json.loads(line.removeprefix("data: ")))
                    self.first.set()
        self.first.set()

    def result(self) -> tuple[str, str | None]:
        self.thread.join(60)
        assert not self.thread.is_alive()
        assert all("error" not in c for c in self.chunks), self.chunks[-1]
        return "".join(c["choices"][0]["text"] for c in self.chunks), self.chunks[-1]["choices"][0]["finish_reason"]


def test_a_seed_past_int64_is_a_400_and_a_stream_beside_it_finishes(live) -> None:
    """The reported fault: seed 2**64 used to reach torch's manual_seed in the engine step, the step raised, the
    engine was declared dead (503 engine_dead), and every other stream on the worker ended with `abort`."""
    expected = httpx.post(
        live.base_url + "/v1/completions",
        json={**Stream(live.base_url, 5).body, "stream": False, "max_tokens": 300},
        timeout=60,
    ).json()["choices"][0]["text"]
    stream = Stream(live.base_url)
    r = httpx.post(
        live.base_url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 5, "temperature": 1, "seed": 2**64},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "seed"
    assert stream.result() == (expected, "length")
    assert_alive(live)


BAD_BODIES = [
    # (field overrides, param named in the 400 (None: refused by the engine's vocabulary check), text in message)
    ({"seed": 2**64}, "seed", "less than or equal to"),
    ({"seed": -(2**63) - 1}, "seed", "greater than or equal to"),
    ({"top_k": 2**40}, "top_k", "less than or equal to"),
    ({"top_k": -2}, "top_k", "greater than or equal to"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"n": 10**9}, "n", "not supported"),
    ({"logprobs": 6}, "logprobs", "less than or equal to 5"),
    ({"max_tokens": 2**40}, "max_tokens", "less than or equal to"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"min_tokens": 10, "max_tokens": 5}, None, "min_tokens must be in [0, 5]"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ({"repetition_penalty": 1.2}, "repetition_penalty", "not supported"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-5": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ({"logit_bias": {str(VOCAB): 1}}, None, f"logit_bias must name token ids in 0..{VOCAB - 1}"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", f"at most {MAX_STOP_STRINGS} stop strings"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", f"at most {MAX_STOP_STRING_CHARS} characters"),
    ({"stop_token_ids": [VOCAB]}, None, f"stop_token_ids must name token ids in 0..{VOCAB - 1}"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0", "greater than or equal to 0"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64"),
    ({"prompt": [1, 2, VOCAB]}, None, f"prompt token ids must be in 0..{VOCAB - 1}"),
    ({"prompt": [1, 2, VOCAB], "echo": True, "logprobs": 1}, None, f"prompt token ids must be in 0..{VOCAB - 1}"),
    ({"prompt": [1, 2**63]}, "prompt", "at most 2147483647"),
    ({"priority": 2**40}, "priority", "less than or equal to"),
    ({"prompt": "a\ud800b"}, "prompt", "lone surrogate"),  # JSON can carry it; no tokenizer can encode it
    ({"stop": ["\udfff"]}, "stop", "lone surrogate"),
]


@pytest.mark.parametrize(("fields", "param", "needle"), BAD_BODIES)
def test_out_of_range_fields_are_400s_naming_the_field(live, fields, param, needle) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, **fields}
    r = post_json(live, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and needle in error["message"], error


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_floats_are_400s(live, field, value) -> None:
    body = f'{{"prompt": "x", "max_tokens": 2, "{field}": {value}}}'  # json.dumps cannot write these
    r = httpx.post(
        live.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages.0.content"),
    ],
)
def test_chat_fields_are_bounded_too(live, fields, param) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}
    r = post_json(live, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_extreme_but_valid_values_are_served(live) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 1e-300,
        "top_p": 1e-300,
        "top_k": 2**31 - 1,
        "seed": -(2**63),
        "stop": ["é" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        "min_tokens": 4,
        "stop_token_ids": [VOCAB - 1],
        "logit_bias": {str(VOCAB - 1): -100},
        "logprobs": 5,
        "priority": -(2**31),
    }
    r = httpx.post(live.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert_alive(live)


def test_logit_bias_forces_a_token(live) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "logit_bias": {"42": 100},
    }
    r = httpx.post(live.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:42"] * 6


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_failing_inside_the_engine_gets_its_own_error(live, monkeypatch, stream) -> None:
    """Defence in depth: a failure the runner pins on one request (here: building its seeded generator) answers
    that request with a 500 `request_failed` (or an error event mid-stream); the stream beside it is untouched."""
    runner = live.engine._core.runner
    make_generator = runner._generator

    def broken(req_id, seed):
        if seed == 4242:
            raise RuntimeError("cannot seed this one")
        return make_generator(req_id, seed)

    monkeypatch.setattr(runner, "_generator", broken)
    other = Stream(live.base_url, 100)
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 1, "seed": 4242, "stream": stream}
    r = httpx.post(live.base_url + "/v1/completions", json=body, timeout=30)
    if stream:
        events = [
            json.loads(line.removeprefix("data: "))
            for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        error = events[-1]["error"]
    else:
        assert r.status_code == 500, r.text
        error = r.json()["error"]
    assert error["code"] == "request_failed" and "cannot seed this one" not in error["message"]  # details: log only
    assert other.result()[1] == "length"
    assert_alive(live)
