"""EngineConfig: contradictory settings are refused with a message that says how to fix them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from worker.core.config import EngineConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(block_size=12), "power of two"),
        (dict(block_size=0), "greater than or equal to 1"),
        (dict(num_blocks=10, kv_cache_bytes=1 << 20), "either num_blocks or kv_cache_bytes"),
        (dict(max_num_seqs=64, max_num_batched_tokens=32), "must be at least max_num_seqs"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024), "enable_chunked_prefill"),
        (dict(quantization="int3"), "'none', 'int8', 'fp8' or 'int4'"),
        (dict(dtype="float64"), "float32"),
        (dict(device="tpu"), "pattern"),
        (dict(scheduling_policy="lifo"), "fcfs"),
        (dict(max_waiting=0), "greater than or equal to 1"),
        (dict(max_num_seqs=4, unknown=1), "Extra inputs are not permitted"),
    ],
)
def test_invalid_settings_are_refused(kwargs, message) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineConfig(**kwargs)


def test_defaults_and_runner_arguments() -> None:
    cfg = EngineConfig()
    assert (cfg.block_size, cfg.enable_prefix_caching, cfg.enable_chunked_prefill) == (16, True, True)
    assert cfg.runner_quantization is None
    assert EngineConfig(quantization="fp8").runner_quantization == "fp8"
    assert EngineConfig(quantization="int8").runner_quantization == "int8"
    assert EngineConfig(device="cuda:1").device == "cuda:1"


def test_model_derived_context_length_is_checked_too() -> None:
    cfg = EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=512)
    cfg.check_max_model_len(512)
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(512\\) must be at least max_model_len \\(2048\\)"):
        cfg.check_max_model_len(2048)
