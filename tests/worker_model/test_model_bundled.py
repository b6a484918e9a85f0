"""Bundled-model plumbing without the real conversion: name mapping, q/k un-permutation, atomic idempotent
cache, source resolution, and the `llmfleet model pull` command."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from typer.testing import CliRunner
from worker.model import bundled
from worker.model.bundled import cache_dir, ensure_bundled, hf_tensor_name, unpermute_qk
from worker.model.cli import model_app
from worker.model.config import ModelConfig
from worker.model.source import ModelSourceError, resolve_model_source


@pytest.mark.parametrize(
    "gguf,hf",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_output.weight", "model.layers.12.self_attn.o_proj.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
    ],
)
def test_tensor_names(gguf, hf):
    assert hf_tensor_name(gguf) == hf


def test_unknown_tensor_name_is_an_error():
    with pytest.raises(ValueError, match="unexpected tensor"):
        hf_tensor_name("blk.0.attn_qkv.weight")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (what the GGUF stores)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 8), (1, 4)])
def test_unpermute_inverts_llama_cpp(n_head, head_dim):
    w = np.arange(n_head * head_dim * 5, dtype=np.float32).reshape(n_head * head_dim, 5)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
    assert not np.array_equal(llama_cpp_permute(w, n_head), w)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMFLEET_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    assert cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("LLMFLEET_CACHE_DIR")
    assert str(cache_dir()).endswith(".cache/llmfleet/models")


def fake_convert(calls: list):
    def convert(gguf, out):
        calls.append(gguf)
        (out / "config.json").write_text("{}")
        return out

    return convert


def test_ensure_bundled_converts_once_and_atomically(tmp_path):
    calls: list = []
    first = ensure_bundled("smollm2-135m-instruct", tmp_path, convert=fake_convert(calls))
    second = ensure_bundled("smollm2-135m-instruct", tmp_path, convert=fake_convert(calls))
    assert first == second == tmp_path / "smollm2-135m-instruct"
    assert len(calls) == 1 and calls[0].name.endswith(".gguf")
    assert (first / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct"]  # no temp dirs left


def test_failed_conversion_leaves_nothing(tmp_path):
    def broken(gguf, out):
        (out / "partial").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ensure_bundled("smollm2-135m-instruct", tmp_path, convert=broken)
    assert list(tmp_path.iterdir()) == []


def test_stale_partial_folder_is_replaced(tmp_path):
    (tmp_path / "smollm2-135m-instruct").mkdir()
    (tmp_path / "smollm2-135m-instruct" / "junk").write_text("x")
    calls: list = []
    out = ensure_bundled("smollm2-135m-instruct", tmp_path, convert=fake_convert(calls))
    assert (out / "config.json").is_file() and not (out / "junk").exists()


def test_concurrent_pulls_agree(tmp_path):
    calls: list = []
    results: list = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                ensure_bundled("smollm2-135m-instruct", tmp_path, convert=fake_convert(calls))
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and len(set(results)) == 1
    assert (results[0] / bundled.COMPLETE_MARKER).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct"]


def test_unknown_bundled_model(tmp_path):
    with pytest.raises(ModelSourceError, match="unknown bundled model"):
        resolve_model_source("bundled://nope", cache_dir=tmp_path)


@pytest.mark.parametrize(
    "source,match",
    [
        ("", "empty"),
        ("/definitely/not/here", "does not exist"),
        ("hf://just-a-name", "ORG/REPO"),
    ],
)
def test_bad_sources(source, match):
    with pytest.raises(ModelSourceError, match=match):
        resolve_model_source(source)


def test_hf_source_fails_clearly_without_a_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="could not fetch hf://org/repo"):
        resolve_model_source("hf://org/repo", cache_dir=tmp_path)


def test_local_folder_source(tiny_dir, tmp_path):
    assert resolve_model_source(str(tiny_dir)) == tiny_dir
    assert resolve_model_source(f"file://{tiny_dir}") == tiny_dir
    with pytest.raises(ModelSourceError, match=r"config\.json"):
        resolve_model_source(str(tmp_path))


def test_cli_pull_prints_the_folder(tiny_dir):
    result = CliRunner().invoke(model_app, ["pull", str(tiny_dir)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tiny_dir)


def test_cli_pull_bundled_uses_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(bundled, "convert_gguf", lambda gguf, out: (out / "config.json").write_text("{}"))
    result = CliRunner().invoke(model_app, ["pull", "smollm2-135m-instruct", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path / "smollm2-135m-instruct")


def test_cli_pull_error_exit_code():
    result = CliRunner().invoke(model_app, ["pull", "/no/such/model"])
    assert result.exit_code == 1
    assert "does not exist" in result.output


def test_config_reads_both_rope_spellings():
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    legacy = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    v5 = ModelConfig.from_dict({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}})
    assert legacy == v5
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling.rope_type == "linear" and legacy.head_dim == 4


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling"),
    ],
)
def test_config_rejects_unsupported(patch, match):
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**base, **patch})


def test_config_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1}))
    with pytest.raises(ValueError, match="lacks"):
        ModelConfig.from_dir(tmp_path)
