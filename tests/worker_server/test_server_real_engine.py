"""The server around the real builtin engine (`AsyncEngine`) on a tiny random Llama: the same text as the
offline API, streaming, KV blocks freed when a client disconnects, prefix-cache metrics, drain."""

from __future__ import annotations

import json

import httpx
import pytest

async_engine = pytest.importorskip("worker.engine.async_engine")
testing = pytest.importorskip("worker.model.testing")

from worker.core.config import EngineConfig  # noqa: E402
from worker.core.request import SamplingParams  # noqa: E402
from worker.engine.llm import LLM  # noqa: E402

KV_BYTES = 4_000_000
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return testing.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=str(model_dir), kv_cache_bytes=KV_BYTES)


def make_engine(model_dir):
    return async_engine.AsyncEngine(
        EngineConfig(model=str(model_dir), served_model_name="tiny", kv_cache_bytes=KV_BYTES)
    )


@pytest.fixture(scope="module")
def live(module_launcher, model_dir):
    return module_launcher(make_engine(model_dir), model="tiny")


def test_completion_matches_the_offline_api(live, offline) -> None:
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))[0]
    r = live.openai().completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == expected.text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)
    chunks = list(
        live.openai().completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_matches_the_offline_api(live, offline) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = offline.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
    r = live.openai().chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0, logprobs=True
    )
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason.value
    assert len(r.choices[0].logprobs.content) == len(expected.token_ids)
    assert all(c.logprob <= 0 for c in r.choices[0].logprobs.content)


def test_echo_scores_the_prompt_like_the_offline_api(live, offline) -> None:
    """Teacher-forced scoring over HTTP (what the canary quality probe sends): the prompt given as token ids comes
    back with each token's logprob and top alternative, equal to the offline engine's prompt logprobs."""
    ids = offline.tokenizer.encode(PROMPT)
    expected = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    r = live.openai().completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens[: len(ids)] == [f"token_id:{t}" for t in ids]
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([e.logprob for e in expected.prompt_logprobs], abs=1e-4)
    assert [list(top) for top in lp.top_logprobs[1 : len(ids)]] == [
        [f"token_id:{e.top[0][0]}"] for e in expected.prompt_logprobs
    ]
    assert r.choices[0].text.startswith(offline.tokenizer.decode(ids, skip_special_tokens=True))


def test_disconnect_mid_stream_frees_the_kv_cache(live, raw_request, wait) -> None:
    engine = live.engine
    before = live.metric("llmfleet:request_errors_total", code="client_disconnect") or 0
    sock = raw_request(
        live.base_url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    )
    data = b""
    for _ in range(100):
        data += sock.recv(65536)
        if data.count(b"data: ") >= 2:
            break
    assert b"200 OK" in data
    wait(lambda: engine.stats().kv_cache_usage > 0, "KV blocks in use")
    sock.close()
    wait(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0, "KV usage back to 0")
    wait(
        lambda: live.metric("llmfleet:request_errors_total", code="client_disconnect") == before + 1,
        "the disconnect to be counted",
    )
    assert live.metric("vllm:kv_cache_usage_perc") == 0
    assert live.metric("llmfleet:inflight_requests") == 0


def test_prefix_cache_metrics_move(live) -> None:
    long_prompt = " ".join([PROMPT] * 6)
    queries = live.metric("vllm:prefix_cache_queries_total")
    hits = live.metric("vllm:prefix_cache_hits_total")
    client = live.openai()
    for _ in range(2):
        client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2, temperature=0)
    assert live.metric("vllm:prefix_cache_queries_total") > queries
    assert live.metric("vllm:prefix_cache_hits_total") >= hits + 16


def test_drain_lets_a_real_stream_finish(start_worker, model_dir, offline, wait) -> None:
    live = start_worker(make_engine(model_dir), model="tiny", drain_token="tok")
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=800, temperature=0, ignore_eos=True))[0]
    http = live.http()
    body = {"prompt": PROMPT, "max_tokens": 800, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: ")).removeprefix("data: "))
        drain = http.post("/drain", headers={"Authorization": "Bearer tok"})
        assert drain.status_code == 202 and drain.json()["inflight"] == 1
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        rest = [
            json.loads(line.removeprefix("data: "))
            for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    text = first["choices"][0]["text"] + "".join(p["choices"][0]["text"] for p in rest)
    assert text == expected.text and rest[-1]["choices"][0]["finish_reason"] == "length"
    wait(lambda: http.get("/drain").json()["state"] == "drained", "the drain to finish")
    # drained by POST /drain: up and idle until its pod is deleted (SIGTERM), never ready again
    assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 503
    assert live.thread.is_alive() and not live.worker.server.should_exit


@pytest.mark.slow
def test_cli_serves_a_model_folder_with_the_builtin_engine(spawn_worker, model_dir, wait) -> None:
    import signal
    import sys

    worker = spawn_worker(
        [
            sys.executable,
            "-m",
            "llmfleet.cli",
            "worker",
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--kv-cache-bytes",
            str(KV_BYTES),
            "--max-num-seqs",
            "4",
        ]
    )
    http = httpx.Client(base_url=worker.base_url, timeout=60)
    wait(lambda: http.get("/ready").status_code == 200, "the model to load", timeout_s=60, poll_s=0.1)
    # greedy and past EOS: at the API's default temperature (1) the random tiny model sampled EOS early now and then
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
