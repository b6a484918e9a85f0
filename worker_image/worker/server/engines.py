"""Build the engine a worker serves from its settings: `builtin` (our engine), `vllm` or `fake` (tests only).

Heavy imports (torch, vLLM) happen inside the builders, so choosing one engine never imports another. With the
engine comes its tokenizer's bound on bytes per token (from the model folder's `tokenizer.json`), which the server
uses to refuse over-long prompts without tokenizing them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.engine.protocol import EngineClient
from worker.server.settings import WorkerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FakeOptions:
    """Knobs of `--engine fake` (tests only): delays and a gate file (see `FakeEngine`)."""

    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    gate_file: Path | None = None


@dataclass(frozen=True)
class BuiltEngine:
    engine: EngineClient
    max_bytes_per_token: int | None  # see worker.model.tokenizer.max_bytes_per_token; None: no bound known


def tokenizer_bytes_bound(model_path: str) -> int | None:
    """The bound of the model folder's `tokenizer.json` (None when it has none, or no such file)."""
    from worker.model.tokenizer import max_bytes_per_token

    path = Path(model_path) / "tokenizer.json"
    return max_bytes_per_token(json.loads(path.read_text())) if path.is_file() else None


def resolve_model_source(settings: WorkerSettings) -> str:
    """The model source (`bundled://NAME`, a folder, `hf://ORG/REPO`) as a local folder the engine can load.

    Raises `ModelSourceError` (a ValueError) with what to do when it cannot.
    """
    from worker.model.source import resolve_model_source as resolve

    return str(resolve(settings.model, revision=settings.revision))


def builtin_engine_kwargs(settings: WorkerSettings, model_path: str, device: str) -> dict[str, Any]:
    """EngineConfig arguments from the worker settings; unset sizing flags keep the engine's defaults."""
    kwargs: dict[str, Any] = {
        "model": model_path,
        "served_model_name": settings.model_name,
        # `auto` goes through: the runner resolves it from the device and the CPU's flags
        # (`linear.resolve_auto_dtype`: bf16 on GPUs and on CPUs with AVX512-BF16/AMX, fp32 elsewhere) and logs why
        "dtype": settings.dtype,
        "quantization": settings.quantization,
        "device": device,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        # The server refuses with 429 at its own limit first; the engine's must not be lower.
        "max_waiting": settings.max_waiting,
    }
    optional = {
        "enable_lora": settings.enable_lora or None,
        "max_loras": settings.max_loras,
        "max_lora_rank": settings.max_lora_rank,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "kv_cache_bytes": settings.kv_cache_bytes,
        "speculative": settings.speculative,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs


def build_engine(settings: WorkerSettings, device: str = "auto", fake: FakeOptions | None = None) -> BuiltEngine:
    if settings.engine == "fake":
        from worker.server.fake_engine import MAX_BYTES_PER_TOKEN, FakeEngine, file_gate

        fake = fake or FakeOptions()
        return BuiltEngine(
            FakeEngine(
                settings.model_name,
                settings.max_model_len or 2048,
                ttft_s=fake.ttft_ms / 1000.0,
                itl_s=fake.itl_ms / 1000.0,
                max_num_seqs=settings.max_num_seqs or 8,
                gate=file_gate(fake.gate_file) if fake.gate_file is not None else None,
            ),
            MAX_BYTES_PER_TOKEN,
        )
    model_path = resolve_model_source(settings)
    bound = tokenizer_bytes_bound(model_path)
    if settings.engine == "vllm":
        from worker.backends.vllm import VllmEngine

        return BuiltEngine(VllmEngine.from_settings(settings, model_path), bound)
    import torch

    from worker.core.config import EngineConfig
    from worker.cpu_threads import configure_torch_threads
    from worker.engine.async_engine import AsyncEngine

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = configure_torch_threads()
    if threads is not None:
        log.info("torch uses %d CPU threads (the container's CPU limit)", threads)
    return BuiltEngine(AsyncEngine(EngineConfig(**builtin_engine_kwargs(settings, model_path, device))), bound)
