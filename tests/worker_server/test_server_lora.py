"""LoRA adapters over HTTP with the real builtin engine on a tiny Llama: the load/unload endpoints need the drain
token, a bad adapter is a 400 with the reason while the base serves, `/v1/models` lists adapters with their parent,
`model: BASE:ADAPTER` or the adapter's own name selects it (same text as the offline engine), an unknown adapter is
a 404 `model_not_found`, boot adapters from `--lora-modules`, and the LoRA metrics; plus the pure pieces (model
resolution, flag parsing, settings rules) as tables."""

from __future__ import annotations

import httpx
import pytest

async_engine = pytest.importorskip("worker.engine.async_engine")
testing = pytest.importorskip("worker.model.testing")

from pydantic import ValidationError  # noqa: E402
from worker.core.config import EngineConfig  # noqa: E402
from worker.core.request import SamplingParams  # noqa: E402
from worker.engine.llm import LLM  # noqa: E402
from worker.server.cli import parse_lora_modules  # noqa: E402
from worker.server.errors import ApiError  # noqa: E402
from worker.server.service import resolve_model  # noqa: E402
from worker.server.settings import WorkerSettings  # noqa: E402

TOKEN = "lora-control-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KV_BYTES = 4_000_000
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return testing.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(["sql", "poet", "late"]):
        testing.make_random_lora(root / name, model_dir, rank=8, alpha=16, seed=i + 1)
    bad = root / "bad"
    testing.make_random_lora(bad, model_dir, rank=32, alpha=16, seed=9)  # over --max-lora-rank 16
    return {p.name: str(p) for p in root.iterdir()}


@pytest.fixture(scope="module")
def offline(model_dir, adapter_dirs):
    llm = LLM(model=str(model_dir), kv_cache_bytes=KV_BYTES, enable_lora=True, max_loras=2)
    for name in ("sql", "poet", "late"):
        llm.add_lora(name, adapter_dirs[name])
    return llm


@pytest.fixture(scope="module")
def live(module_launcher, model_dir, adapter_dirs):
    engine = async_engine.AsyncEngine(
        EngineConfig(
            model=str(model_dir), served_model_name="tiny", kv_cache_bytes=KV_BYTES, enable_lora=True, max_loras=2
        )
    )
    return module_launcher(
        engine,
        model=str(model_dir),
        served_model_name="tiny",
        drain_token=TOKEN,
        enable_lora=True,
        max_loras=2,
        lora_modules={"sql": adapter_dirs["sql"], "poet": adapter_dirs["poet"], "broken": adapter_dirs["bad"]},
    )


def _text(live, model: str, max_tokens: int = 12) -> str:
    r = live.openai().completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert r.model == model
    return r.choices[0].text


def _offline_text(offline, lora: str | None, max_tokens: int = 12) -> str:
    return offline.generate(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0), lora=lora)[0].text


def _models(live) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(live.base_url + "/v1/models", timeout=10).json()["data"]}


def test_boot_adapters_are_listed_with_their_parent_and_a_bad_one_is_left_out(live, adapter_dirs) -> None:
    models = _models(live)
    assert set(models) == {"tiny", "sql", "poet"}
    assert models["sql"]["parent"] == "tiny" and models["sql"]["root"] == adapter_dirs["sql"]
    assert "parent" not in models["tiny"]


def test_adapter_selected_by_name_or_base_colon_name(live, offline) -> None:
    base, sql, poet = (_offline_text(offline, lora) for lora in (None, "sql", "poet"))
    assert len({base, sql, poet}) == 3
    assert _text(live, "tiny") == base
    assert _text(live, "sql") == sql
    assert _text(live, "tiny:sql") == sql
    assert _text(live, "tiny:poet") == poet
    chat = live.openai().chat.completions.create(
        model="poet", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "poet"


@pytest.mark.parametrize("model", ["nope", "tiny:nope", "other:sql", "sql:tiny", "tiny:"])
def test_unknown_models_are_404_model_not_found(live, model) -> None:
    r = httpx.post(live.base_url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}])
def test_adapter_endpoints_need_the_drain_token(live, adapter_dirs, path, headers) -> None:
    body = {"lora_name": "sql", "lora_path": adapter_dirs["late"]}
    if path.startswith("/v1/unload"):
        body.pop("lora_path")
    r = httpx.post(live.base_url + path, json=body, headers=headers, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_drain_token"
    assert "sql" in _models(live)


def test_load_answer_and_unload_an_adapter_at_run_time(live, offline, adapter_dirs) -> None:
    url = live.base_url
    r = httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": "late", "lora_path": "file://" + adapter_dirs["late"]},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    assert "late" in _models(live)
    assert _text(live, "tiny:late") == _offline_text(offline, "late")
    again = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapter_dirs["late"]}, headers=AUTH
    )
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert "late" not in _models(live)
    r = httpx.post(url + "/v1/completions", json={"model": "late", "prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"lora_name": "big", "lora_path": "BAD"}, "exceeds max_lora_rank=16"),
        ({"lora_name": "missing", "lora_path": "/nonexistent/adapter"}, "does not exist"),
        ({"lora_name": "tiny", "lora_path": "SQL"}, "the base model's name"),
        ({"lora_name": "a:b", "lora_path": "SQL"}, "without ':'"),
        ({"lora_name": "x"}, "lora_path: field required"),
        ({"lora_name": "x", "lora_path": "s3://bucket/adapter"}, "adapter sources are a folder"),
    ],
)
def test_a_bad_adapter_is_400_with_the_reason_and_the_base_serves(live, offline, adapter_dirs, body, message) -> None:
    body = {k: {"BAD": adapter_dirs["bad"], "SQL": adapter_dirs["sql"]}.get(v, v) for k, v in body.items()}
    r = httpx.post(live.base_url + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]
    assert _text(live, "tiny") == _offline_text(offline, None)


def test_lora_metrics(live) -> None:
    _text(live, "sql", max_tokens=2)
    text = httpx.get(live.base_url + "/metrics", timeout=10).text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in text
    assert 'llmfleet:lora_loads_total{model_name="tiny"}' in text
    assert 'llmfleet:lora_evictions_total{model_name="tiny"}' in text


def test_endpoints_without_lora_say_how_to_enable_it(start_worker) -> None:
    live = start_worker(drain_token=TOKEN)
    r = httpx.post(
        live.base_url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}, headers=AUTH, timeout=10
    )
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(live.base_url + "/v1/models", timeout=10).json()["data"]] == ["fake-model"]


# ---- pure pieces -------------------------------------------------------------------------------------------------

RESOLVE = [
    (None, None),
    ("base", None),
    ("sql", "sql"),
    ("base:sql", "sql"),
    ("base:nope", 404),
    ("nope", 404),
    ("other:sql", 404),
    ("base:", 404),
]


@pytest.mark.parametrize(("requested", "expected"), RESOLVE)
def test_resolve_model(requested, expected) -> None:
    if expected == 404:
        with pytest.raises(ApiError) as err:
            resolve_model(requested, "base", {"sql", "poet"})
        assert err.value.status == 404 and err.value.code == "model_not_found"
        assert "`base`, `poet`, `sql`" in err.value.message
    else:
        assert resolve_model(requested, "base", {"sql", "poet"}) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (None, {}),
        (["a=/x", "b=/y/z=w"], {"a": "/x", "b": "/y/z=w"}),
        (['{"name": "a", "path": "/x"}'], {"a": "/x"}),
        (["a"], ValueError),
        (["=/x"], ValueError),
        (["a=/x", "a=/y"], ValueError),
        (['{"name": "a"}'], ValueError),
    ],
)
def test_parse_lora_modules(values, expected) -> None:
    if expected is ValueError:
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(values)
    else:
        assert parse_lora_modules(values) == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_loras": 2}, "--max-loras need --enable-lora"),
        ({"lora_modules": {"a": "/x"}}, "--lora-modules need --enable-lora"),
        ({"enable_lora": True, "engine": "vllm", "max_lora_rank": 12}, "the vllm engine takes one of"),
        ({"enable_lora": True, "lora_modules": {"m": "/x"}, "served_model_name": "m"}, "not the base model's name"),
    ],
)
def test_settings_rules(fields, message) -> None:
    with pytest.raises(ValidationError, match=message):
        WorkerSettings(**({"model": "/m", "engine": "builtin"} | fields))


def test_cli_flags_reach_the_engine_config() -> None:
    from typer.testing import CliRunner
    from worker.server.engines import builtin_engine_kwargs

    from llmfleet.cli import app

    args = ["worker", "--model", "fake://m", "--engine", "fake", "--host", "127.0.0.1", "--port", "0"]
    result = CliRunner().invoke(app, [*args, "--max-loras", "2", "--lora-modules", "a=/x"])
    assert result.exit_code == 2
    assert "--max-loras, --lora-modules need --enable-lora" in result.output
    result = CliRunner().invoke(app, [*args, "--enable-lora", "--lora-modules", "oops"])
    assert result.exit_code == 2 and "give name=path" in result.output
    settings = WorkerSettings(model="m", enable_lora=True, max_loras=4, max_lora_rank=32, lora_modules={"a": "/x"})
    kwargs = builtin_engine_kwargs(settings, "/m", "cpu")
    assert (kwargs["enable_lora"], kwargs["max_loras"], kwargs["max_lora_rank"]) == (True, 4, 32)
    config = EngineConfig(**kwargs)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 4, 32)
    assert "enable_lora" not in builtin_engine_kwargs(WorkerSettings(model="m"), "/m", "cpu")
