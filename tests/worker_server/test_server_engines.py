"""Building the engine from the worker settings: the builtin engine's and vLLM's arguments, the fake engine, the
vLLM stat snapshot (pure parts; the vLLM backend itself runs in test_server_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from worker.backends.vllm import _Snapshot, checkpoint_quantization, vllm_engine_args
from worker.server.engines import FakeOptions, build_engine, builtin_engine_kwargs
from worker.server.fake_engine import FakeEngine
from worker.server.settings import WorkerSettings


def test_builtin_engine_kwargs_pass_only_what_was_set() -> None:
    settings = WorkerSettings(
        model="bundled://m",
        served_model_name="chat",
        quantization="int4",
        max_num_seqs=4,
        kv_cache_bytes=1 << 20,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_waiting=9,
    )
    kwargs = builtin_engine_kwargs(settings, "/models/m", "cpu")
    assert kwargs == {
        "model": "/models/m",
        "served_model_name": "chat",
        "dtype": "auto",
        "quantization": "int4",
        "device": "cpu",
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "max_waiting": 9,
        "max_num_seqs": 4,
        "kv_cache_bytes": 1 << 20,
    }


@pytest.mark.parametrize(
    ("dtype", "device", "expected"),
    [
        ("auto", "cpu", "auto"),  # the runner resolves it with the CPU's flags (bf16 with AVX512-BF16)
        ("auto", "cuda", "auto"),
        ("float16", "cpu", "float16"),
        ("float32", "cuda", "float32"),
    ],
)
def test_builtin_dtype(dtype: str, device: str, expected: str) -> None:
    assert builtin_engine_kwargs(WorkerSettings(model="m", dtype=dtype), "/m", device)["dtype"] == expected


def test_a_worker_left_at_dtype_auto_runs_what_the_cpu_rule_chooses(tmp_path) -> None:
    # A CR's `dtype: auto` (its default) must reach the runner: bf16 on CPUs with AVX512-BF16/AMX. The worker
    # once turned it into float32 on every CPU, before the runner could look at the CPU.
    import torch
    from worker.core.config import EngineConfig
    from worker.engine.core import EngineCore
    from worker.model.linear import available_kernels, read_cpu_flags, resolve_auto_dtype
    from worker.model.testing import make_tiny_llama

    root = str(make_tiny_llama(tmp_path / "m"))
    config = EngineConfig(**builtin_engine_kwargs(WorkerSettings(model=root), root, "cpu"), num_blocks=8)
    runner = EngineCore.from_config(config).runner
    expected, _ = resolve_auto_dtype("cpu", read_cpu_flags(), available_kernels())
    assert runner.dtype == getattr(torch, expected)  # type: ignore[attr-defined]


def test_builtin_kwargs_are_a_valid_engine_config() -> None:
    from worker.core.config import EngineConfig

    settings = WorkerSettings(model="m", max_model_len=256, max_num_batched_tokens=512, max_num_seqs=8)
    assert EngineConfig(**builtin_engine_kwargs(settings, "/m", "cpu")).max_model_len == 256


def test_vllm_engine_args() -> None:
    settings = WorkerSettings(model="m", engine="vllm", quantization="fp8", max_model_len=2048, kv_cache_bytes=10**9)
    args = vllm_engine_args(settings, "/models/m", device_is_cpu=True)
    assert args["quantization"] == "fp8" and args["enforce_eager"] and args["kv_cache_memory_bytes"] == 10**9
    assert args["max_model_len"] == 2048 and "max_num_seqs" not in args and args["served_model_name"] == "m"
    assert vllm_engine_args(WorkerSettings(model="m"), "/m", device_is_cpu=False)["quantization"] is None


@pytest.mark.parametrize(
    ("quantization", "checkpoints"), [("int4", "(AWQ/GPTQ)"), ("int8", "(compressed-tensors W8A8 / GPTQ 8-bit)")]
)
def test_vllm_serves_int8_and_int4_from_pre_quantized_checkpoints_only(
    tmp_path, quantization: str, checkpoints: str
) -> None:
    """The operator passes a variant's quantization with its source (`controllers.pods.worker_args`): vLLM gets the
    checkpoint with quantization None (it reads the scheme from it); a plain checkpoint is refused by name."""
    settings = WorkerSettings(model="m", engine="vllm", quantization=quantization)
    plain, quantized = tmp_path / "plain", tmp_path / "quantized"
    plain.mkdir(), quantized.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (quantized / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    for model in (plain, tmp_path / "missing"):
        with pytest.raises(ValueError) as refused:
            vllm_engine_args(settings, str(model), device_is_cpu=True)
        message = str(refused.value)
        assert f"serves {quantization} only from a pre-quantized checkpoint {checkpoints}" in message
        assert str(model) in message and f"--engine builtin for {quantization} weight-only" in message
    assert vllm_engine_args(settings, str(quantized), device_is_cpu=True)["quantization"] is None
    assert checkpoint_quantization(str(quantized)) == "awq" and checkpoint_quantization(str(plain)) is None


def test_builtin_engine_takes_int8() -> None:
    kwargs = builtin_engine_kwargs(WorkerSettings(model="m", quantization="int8"), "/m", "cpu")
    assert kwargs["quantization"] == "int8"


def test_vllm_snapshot_keeps_gauges_and_adds_counters() -> None:
    snap = _Snapshot()
    prefix = SimpleNamespace(queries=32, hits=16)
    sched = SimpleNamespace(
        num_running_reqs=3,
        num_waiting_reqs=2,
        num_skipped_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_stats=prefix,
    )
    snap.record(sched, SimpleNamespace(num_preempted_reqs=1))
    snap.record(sched, SimpleNamespace(num_preempted_reqs=2))
    snap.record(None, None)
    assert (snap.num_running, snap.num_waiting, snap.kv_cache_usage) == (3, 3, 0.25)
    assert (snap.preemptions, snap.prefix_queries, snap.prefix_hits) == (3, 64, 32)


def test_build_fake_engine(tmp_path: Path) -> None:
    settings = WorkerSettings(model="fake://m", engine="fake", served_model_name="x", max_model_len=64, max_num_seqs=2)
    built = build_engine(settings, fake=FakeOptions(ttft_ms=5, gate_file=tmp_path / "gate"))
    engine = built.engine
    assert isinstance(engine, FakeEngine)
    assert (engine.model_name, engine.max_model_len, built.max_bytes_per_token) == ("x", 64, 1)
    assert len(engine.tokenize("é" * 10)) == 20  # the bound holds: one token per byte


def test_unknown_model_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        build_engine(WorkerSettings(model=str(tmp_path / "absent")))


def test_speculative_settings_map_to_both_engines() -> None:
    from worker.core.config import SpeculativeConfig

    plain = WorkerSettings(model="m")
    assert "speculative_config" not in vllm_engine_args(plain, "/m", device_is_cpu=True)
    assert "speculative" not in builtin_engine_kwargs(plain, "/m", "cpu")
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    settings = WorkerSettings(model="m", speculative=spec)
    assert builtin_engine_kwargs(settings, "/m", "cpu")["speculative"] == spec
    assert vllm_engine_args(settings, "/m", device_is_cpu=True)["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    with pytest.raises(ValueError, match="set by the worker itself"):
        vllm_engine_args(
            WorkerSettings(model="m", engine="vllm", speculative=spec, engine_extra_args={"speculative_config": "{}"}),
            "/m",
            device_is_cpu=True,
        )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "eagle"}', "'ngram'"),
        ('{"num_speculative_tokens": 0}', "greater than or equal to 1"),
        ('{"prompt_lookup_max": 2, "prompt_lookup_min": 3}', "must not exceed prompt_lookup_max"),
        ('{"draft_model": "x"}', "Extra inputs are not permitted"),
    ],
)
def test_bad_speculative_config_fails_at_start_up(text: str, message: str) -> None:
    from pydantic import ValidationError
    from worker.server.cli import parse_speculative_config

    with pytest.raises((ValueError, ValidationError), match=message):
        WorkerSettings(model="m", speculative=parse_speculative_config(text))
