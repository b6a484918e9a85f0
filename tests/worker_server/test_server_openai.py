"""The OpenAI API through the official `openai` SDK against a live worker (fake engine): shapes, streaming,
usage, stop, seed, logprobs, max_tokens handling and the OpenAI-style errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from worker.server.fake_engine import DEFAULT_SCRIPT, FakeEngine

CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def live(shared_worker):
    return shared_worker


def test_models(live) -> None:
    models = live.openai().models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert models.data[0].owned_by == "llmfleet"


def test_completion(live) -> None:
    r = live.openai().completions.create(model="fake-model", prompt="Hi there", max_tokens=9, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == DEFAULT_SCRIPT[:9]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (8, 9, 17)
    submitted = live.engine.submitted[-1]
    assert submitted[1] == list(b"Hi there") and submitted[2].max_tokens == 9 and submitted[2].greedy


def test_completion_default_max_tokens_is_16(live) -> None:
    r = live.openai().completions.create(model="fake-model", prompt="x", temperature=0)
    assert r.usage.completion_tokens == 16


def test_completion_with_token_id_prompt(live) -> None:
    r = live.openai().completions.create(model="fake-model", prompt=[72, 105], max_tokens=3, temperature=0)
    assert live.engine.submitted[-1][1] == [72, 105]
    assert r.usage.prompt_tokens == 2


def test_chat_applies_the_template(live) -> None:
    r = live.openai().chat.completions.create(
        model="fake-model",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        max_completion_tokens=5,
        temperature=0,
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == DEFAULT_SCRIPT[:5]
    prompt = bytes(live.engine.submitted[-1][1]).decode()
    assert prompt == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    assert r.usage.prompt_tokens == len(prompt.encode())


def test_chat_without_max_tokens_gets_the_rest_of_the_context(start_worker) -> None:
    live = start_worker(FakeEngine(max_model_len=64))
    r = live.openai().chat.completions.create(model="fake-model", messages=CHAT, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 64


def test_streaming_completion_with_usage(live) -> None:
    chunks = list(
        live.openai().completions.create(
            model="fake-model",
            prompt="Hi",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == DEFAULT_SCRIPT[:12]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat(live) -> None:
    chunks = list(
        live.openai().chat.completions.create(
            model="fake-model", messages=CHAT, max_tokens=7, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == DEFAULT_SCRIPT[:7]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_raw_sse_framing(live) -> None:
    body = {"model": "fake-model", "prompt": "Hi", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", live.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert "".join(p["choices"][0]["text"] for p in payloads) == DEFAULT_SCRIPT[:3]


def test_multibyte_characters_are_never_split(live) -> None:
    start = DEFAULT_SCRIPT.encode().index("Café".encode())
    n = len(DEFAULT_SCRIPT.encode()) - start + 10
    # a script position with multi-byte characters: stream past them byte token by byte token
    chunks = list(
        live.openai().completions.create(
            model="fake-model", prompt="x", max_tokens=start + n, temperature=0, stream=True
        )
    )
    pieces = [c.choices[0].text for c in chunks]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces).startswith(DEFAULT_SCRIPT)


@pytest.mark.parametrize(("stop", "expected"), [("fox", "The quick brown "), (["zzz", " b"], "The quick")])
def test_stop_strings(live, stop, expected) -> None:
    client = live.openai()
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=40, temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    chunks = list(
        client.completions.create(model="fake-model", prompt="x", max_tokens=40, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_params_reach_the_engine(live) -> None:
    client = live.openai()
    client.chat.completions.create(
        model="fake-model",
        messages=CHAT,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        seed=123,
        stop=["\n"],
        extra_body={"top_k": 5, "min_tokens": 2, "priority": 3},
    )
    _, _, params, priority = live.engine.submitted[-1]
    assert (params.temperature, params.top_p, params.seed, params.stop, params.top_k, params.min_tokens) == (
        0.7,
        0.9,
        123,
        ("\n",),
        5,
        2,
    )
    assert priority == 3


def test_seed_makes_sampling_reproducible(live) -> None:
    client = live.openai()

    def sample(seed: int) -> str:
        return (
            client.completions.create(model="fake-model", prompt="x", max_tokens=20, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert sample(5) == sample(5)
    assert len({sample(s) for s in range(6)}) > 1


def test_logprobs(live) -> None:
    client = live.openai()
    chat = client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=4, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{b}" for b in DEFAULT_SCRIPT[:4].encode()]
    assert [c.logprob for c in content] == [-0.5, -0.75, -1.0, -0.25]
    comp = client.completions.create(model="fake-model", prompt="x", max_tokens=3, temperature=0, logprobs=0)
    assert comp.choices[0].logprobs.token_logprobs == [-0.5, -0.75, -1.0]
    plain = client.completions.create(model="fake-model", prompt="x", max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None
    stream = list(
        client.chat.completions.create(
            model="fake-model", messages=CHAT, max_tokens=3, temperature=0, logprobs=True, stream=True
        )
    )
    assert [c.logprob for s in stream if s.choices[0].logprobs for c in s.choices[0].logprobs.content] == [
        -0.5,
        -0.75,
        -1.0,
    ]


def test_top_logprobs(live) -> None:
    client = live.openai()
    comp = client.completions.create(model="fake-model", prompt="x", max_tokens=3, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    script = DEFAULT_SCRIPT[:3].encode()
    assert lp.tokens == [f"token_id:{b}" for b in script]
    assert [list(top) for top in lp.top_logprobs] == [[f"token_id:{b}", f"token_id:{b + 1}"] for b in script]
    chat = client.chat.completions.create(
        model="fake-model", messages=CHAT, max_tokens=2, temperature=0, logprobs=True, top_logprobs=3
    )
    for entry, b in zip(chat.choices[0].logprobs.content, DEFAULT_SCRIPT[:2].encode(), strict=True):
        assert [t.token for t in entry.top_logprobs] == [f"token_id:{b + j}" for j in range(3)]


def test_echo_returns_the_prompt_and_scores_it(live) -> None:
    client = live.openai()
    plain = client.completions.create(model="fake-model", prompt="Hi there", max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == "Hi there" + DEFAULT_SCRIPT[:3] and plain.choices[0].logprobs is None
    ids = client.completions.create(model="fake-model", prompt=[72, 105], max_tokens=2, temperature=0, echo=True)
    assert ids.choices[0].text == "Hi" + DEFAULT_SCRIPT[:2]
    scored = client.completions.create(
        model="fake-model", prompt="Hey", max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    lp = scored.choices[0].logprobs
    prompt, out = list(b"Hey"), list(DEFAULT_SCRIPT[:2].encode())
    assert lp.tokens == [f"token_id:{t}" for t in prompt + out]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.token_logprobs[1:3] == pytest.approx([-0.2, -0.3]) and lp.token_logprobs[3:] == [-0.5, -0.75]
    assert [list(top) for top in lp.top_logprobs[1:]] == [[f"token_id:{t}"] for t in prompt[1:] + out]
    assert live.engine.submitted[-1][2].prompt_logprobs == 1
    stream = list(
        client.completions.create(
            model="fake-model", prompt="Hey", max_tokens=2, temperature=0, echo=True, logprobs=0, stream=True
        )
    )
    assert stream[0].choices[0].text == "Hey"
    assert stream[0].choices[0].logprobs.token_logprobs == pytest.approx([None, -0.2, -0.3])
    assert "".join(c.choices[0].text for c in stream) == "Hey" + DEFAULT_SCRIPT[:2]


def _error(excinfo) -> dict:
    body = excinfo.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        ({"n": 2}, "n", "n=2 is not supported"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"max_tokens": 5000}, "max_tokens", "maximum context length is 2048"),
        ({"prompt": ["a", "b"]}, "prompt", "batched prompts"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"prompt": [5, -1]}, "prompt", "non-negative"),
        ({"prompt": [[1, 2], [3]]}, "prompt", "batched prompts (2 prompts)"),
        ({"prompt": {"text": "x"}}, "prompt", "a string or a list of token ids"),
        ({"prompt": []}, "prompt", "must not be empty"),
    ],
)
def test_bad_completion_requests_are_400(live, kwargs, param, needle) -> None:
    args = {"model": "fake-model", "prompt": "x", "max_tokens": 5, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        live.openai().completions.create(**args)
    error = _error(info)
    assert error["type"] == "invalid_request_error" and error["param"] == param and needle in error["message"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": []}, "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs=2 needs logprobs=true"),
        ({"messages": CHAT, "top_logprobs": 21, "logprobs": True}, "less than or equal to 20"),
        ({"messages": CHAT, "response_format": {"type": "json_object"}}, "json_object"),
        ({}, "messages: field required"),
    ],
)
def test_bad_chat_requests_are_400(live, body, needle) -> None:
    r = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"), (b"\xff\xfe", "not valid JSON")],
)
def test_malformed_json_is_400(live, content, needle) -> None:
    r = httpx.post(
        live.base_url + "/v1/completions", content=content, timeout=30, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_json" and needle in error["message"]


def test_form_encoded_json_body_is_accepted(live) -> None:
    """curl -d sends application/x-www-form-urlencoded; the body is still JSON."""
    r = httpx.post(
        live.base_url + "/v1/completions",
        timeout=30,
        content=b'{"prompt": "x", "max_tokens": 2}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_unknown_model_is_404(live) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        live.openai().completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert _error(info)["code"] == "model_not_found"


def test_unknown_route_and_method_are_openai_errors(live) -> None:
    r = httpx.get(live.base_url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(live.base_url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()


def test_max_tokens_cap_reject_and_clamp(start_worker) -> None:
    strict = start_worker(max_tokens_cap=8)
    with pytest.raises(openai.BadRequestError) as info:
        strict.openai().completions.create(model="fake-model", prompt="x", max_tokens=9)
    assert _error(info)["code"] == "max_tokens_above_cap"
    lenient = start_worker(max_tokens_cap=8, max_tokens_policy="clamp")
    r = lenient.openai().completions.create(model="fake-model", prompt="x", max_tokens=9, temperature=0)
    assert r.usage.completion_tokens == 8


def test_prompt_longer_than_the_context_is_400(start_worker) -> None:
    live = start_worker(FakeEngine(max_model_len=16))
    with pytest.raises(openai.BadRequestError) as info:
        live.openai().completions.create(model="fake-model", prompt="x" * 16, max_tokens=1)
    error = _error(info)
    assert error["code"] == "context_length_exceeded" and "16 tokens" in error["message"]


def test_engine_failure_mid_stream_is_an_error_event(start_worker) -> None:
    live = start_worker(FakeEngine(fail_after=3))
    stream = live.openai().completions.create(model="fake-model", prompt="x", max_tokens=10, temperature=0, stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="internal server error"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert "".join(texts) == DEFAULT_SCRIPT[:3]
    with pytest.raises(openai.InternalServerError):
        live.openai().completions.create(model="fake-model", prompt="x", max_tokens=10)


class RefusingEngine(FakeEngine):
    """An engine that refuses every request up front, as a real one does for a prompt it cannot hold."""

    async def generate(self, prompt, params, request_id, priority=0):
        raise ValueError("the prompt has 9 tokens, but this engine serves at most 8")
        yield  # an async generator, like the real ones


def test_engine_refusal_is_400(start_worker) -> None:
    live = start_worker(RefusingEngine())
    with pytest.raises(openai.BadRequestError) as info:
        live.openai().completions.create(model="fake-model", prompt="x", max_tokens=2)
    error = _error(info)
    assert error["code"] == "engine_rejected" and "at most 8" in error["message"]
    assert live.metric("llmfleet:request_errors_total", code="400") == 1
