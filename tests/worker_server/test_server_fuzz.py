"""Fuzz the worker's request schemas against the real builtin engine (a tiny random Llama): whatever the body
(extreme integers and floats, unicode, huge lists, wrong types), the answer is a 2xx or a 4xx, the engine never
dies, and normal requests sent all the while are served exactly as before (issue #18, finding 1).

The strategies are written by hand from the OpenAI request schemas: each field is absent, plausible, at or past
a boundary, or of the wrong type."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

async_engine = pytest.importorskip("worker.engine.async_engine")
testing = pytest.importorskip("worker.model.testing")

from worker.core.config import EngineConfig  # noqa: E402

EDGE_INTS = [
    0,
    1,
    -1,
    16,
    17,
    20,
    21,
    383,
    384,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    -(2**63) - 1,
    10**30,
]
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 100.0, -100.0, 101.0, 1e308, -1e308]

ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-3, 40), st.sampled_from(EDGE_INTS), st.integers())
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EDGE_FLOATS), st.floats(0, 2))
texts = st.one_of(st.text(max_size=24), st.sampled_from(["", "\n", "é" * 300, "\x00", "😀", "The"]))
wrong = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
token_ids = st.one_of(
    st.lists(ints, max_size=12), st.just([7] * 5000), st.lists(st.integers(0, 383), min_size=1, max_size=12)
)


def field(valid: st.SearchStrategy, extreme: st.SearchStrategy) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """A field's plausible values, and its values at or past the limits or of a wrong type."""
    return valid, st.one_of(extreme, wrong)


# field -> (plausible values, extreme or wrong values); a body has some plausible fields and a few extreme ones
COMMON = {
    "max_tokens": field(st.integers(1, 16), ints),
    "temperature": field(st.floats(0, 2), floats),
    "top_p": field(st.floats(0.01, 1), floats),
    "top_k": field(st.integers(-1, 400), ints),
    "min_tokens": field(st.integers(0, 4), ints),
    "n": field(st.just(1), ints),
    "seed": field(st.integers(-(2**63), 2**63 - 1), ints),
    "stop": field(
        st.one_of(st.text(min_size=1, max_size=8), st.lists(st.text(min_size=1, max_size=8), max_size=4)),
        st.one_of(texts, st.lists(texts, max_size=20), st.just(["x"] * 1000)),
    ),
    "stop_token_ids": field(
        st.lists(st.integers(0, 383), max_size=4), st.one_of(st.lists(ints, max_size=6), st.just(list(range(1000))))
    ),
    "ignore_eos": field(st.booleans(), wrong),
    "stream": field(st.booleans(), st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()}), wrong),
    "presence_penalty": field(st.just(0.0), floats),
    "frequency_penalty": field(st.just(0.0), floats),
    "repetition_penalty": field(st.just(1.0), floats),
    "logit_bias": field(
        st.dictionaries(st.integers(0, 383).map(str), st.floats(-100, 100), max_size=4),
        st.one_of(
            st.dictionaries(st.one_of(ints.map(str), texts), floats, max_size=6),
            st.just({str(i): 1.0 for i in range(2000)}),
        ),
    ),
    "priority": field(st.integers(-10, 10), ints),
    "user": field(st.text(max_size=8), texts),
}
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"]),
            "content": st.one_of(
                texts, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)
            ),
        }
    ),
    max_size=3,
)
COMPLETION = {
    **COMMON,
    "prompt": field(
        st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 383), min_size=1, max_size=30)),
        st.one_of(texts, token_ids, st.lists(token_ids, max_size=2), st.lists(texts, max_size=2)),
    ),
    "logprobs": field(st.integers(0, 5), ints),
    "echo": field(st.booleans(), wrong),
    "best_of": field(st.just(1), ints),
    "suffix": field(st.just(""), texts),
}
CHAT = {
    **COMMON,
    "messages": field(
        st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=30)}), min_size=1, max_size=2
        ),
        messages,
    ),
    "logprobs": field(st.booleans(), wrong),
    "top_logprobs": field(st.integers(0, 20), ints),
    "max_completion_tokens": field(st.integers(1, 16), ints),
    "response_format": field(st.just({"type": "text"}), wrong),
}


@st.composite
def bodies(draw: st.DrawFn, fields: dict, required: str) -> dict:
    """Plausible values for a random subset of fields (the required one always), then 0-2 fields made extreme."""
    names = sorted(fields)
    chosen = draw(st.sets(st.sampled_from(names), max_size=8)) | {required}
    body = {name: draw(fields[name][0]) for name in sorted(chosen)}
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        body[name] = draw(fields[name][1])
    return body


requests = st.one_of(
    st.tuples(st.just("/v1/completions"), bodies(COMPLETION, "prompt")),
    st.tuples(st.just("/v1/chat/completions"), bodies(CHAT, "messages")),
)

NORMAL = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def live(module_launcher, tmp_path_factory):
    model_dir = testing.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    engine = async_engine.AsyncEngine(
        EngineConfig(model=str(model_dir), served_model_name="tiny", kv_cache_bytes=4_000_000)
    )
    return module_launcher(engine, model="tiny", max_tokens_cap=16)


class Bystander:
    """Sends the same normal request over and over (bounded in count and time) while the fuzz runs."""

    def __init__(self, base_url: str, expected: str) -> None:
        self.base_url, self.expected = base_url, expected
        self.stop = threading.Event()
        self.results: list[tuple[int, str]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            for _ in range(2_000):
                if self.stop.is_set() or time.monotonic() > deadline:
                    return
                r = client.post("/v1/completions", json=NORMAL)
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                self.results.append((r.status_code, text))

    def finish(self) -> list[tuple[int, str]]:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self.results


def check(live, client: httpx.Client, path: str, body: dict) -> int:
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    event(f"{path} {r.status_code}")
    assert r.status_code < 500, (path, body, r.status_code, r.text[:500])
    if r.status_code == 200 and body.get("stream") is True:
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
        assert not errors, (path, body, errors)
    assert live.engine._error is None and live.service.load_error is None, (path, body)
    return r.status_code


def test_fuzzed_requests_never_get_a_5xx_nor_hurt_the_engine(live) -> None:
    with httpx.Client(base_url=live.base_url, timeout=60) as client:
        expected = client.post("/v1/completions", json=NORMAL).json()["choices"][0]["text"]
        bystander = Bystander(live.base_url, expected)
        try:
            statuses = fuzz(live, client)
        finally:
            results = bystander.finish()
        print("fuzzed answers by status:", sorted(Counter(statuses).items()))
        assert statuses.count(200) >= len(statuses) // 10, "too few fuzzed requests reached the engine"
        assert results, "the bystander sent nothing"
        assert all(r == (200, expected) for r in results), [r for r in results if r != (200, expected)][:3]
        r = client.post("/v1/completions", json=NORMAL)
        assert (r.status_code, r.json()["choices"][0]["text"]) == (200, expected)
        assert client.get("/health").status_code == 200


def fuzz(live, client: httpx.Client) -> list[int]:
    """Run the fuzz; the status of every answer."""
    statuses: list[int] = []

    @settings(
        max_examples=120,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(request=requests)
    @example(request=("/v1/completions", {"prompt": "x", "temperature": 1, "seed": 2**64}))  # issue #18
    @example(request=("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6], "min_tokens": 2}))
    @example(request=("/v1/completions", {"prompt": "x", "logit_bias": {"1000000": 5}}))
    @example(request=("/v1/completions", {"prompt": "x", "temperature": 5e-324}))
    @example(request=("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}))
    def run(request: tuple[str, dict]) -> None:
        statuses.append(check(live, client, *request))

    run()
    return statuses
