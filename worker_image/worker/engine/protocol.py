"""The interface every engine backend offers the server: our builtin engine and the vLLM backend alike.

The server (`worker.server`) depends only on this module, so it can be developed and tested against a fake
engine, and `--engine builtin|vllm` is a constructor choice, nothing more.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from worker.core.errors import EngineDeadError, QueueFullError
from worker.core.lora import LoraStats
from worker.core.request import FinishReason, Logprob, SamplingParams
from worker.core.spec_decode import SpecDecodeStats

__all__ = ["EngineClient", "EngineDeadError", "EngineStats", "LoraEngineClient", "QueueFullError", "RequestOutput"]


@dataclass(slots=True)
class RequestOutput:
    """One increment of a request's stream (DELTA semantics: only what is new since the last one)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # detokenized delta; never splits a multi-byte character; stop strings already cut out
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    new_logprobs: list[float] | None = None  # logprob of each token in new_token_ids when asked
    new_top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # their top-k (params.top_logprobs)
    # With params.prompt_logprobs, on the first delta only: the logprob (and top-k) of prompt tokens 1..n-1
    # (the first prompt token has none: nothing precedes it).
    prompt_logprobs: list[Logprob] | None = None
    error: str | None = None  # with finish_reason ERROR: why the engine failed this request (and only it)


@dataclass
class EngineStats:
    """A snapshot for /metrics and /drain. Counters are cumulative since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    remaining_tokens_estimate: int = 0  # sum of remaining max_tokens of unfinished requests
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # tokens looked up
    prefix_cache_hits_total: int = 0  # tokens found
    # Speculative decoding counters (`worker.core.spec_decode`); None when the engine does not speculate
    spec_decode: SpecDecodeStats | None = None
    # LoRA adapters of running/waiting requests, slots, loads and evictions; None when the engine serves none
    lora: LoraStats | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine."""

    model_name: str
    max_model_len: int

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, token_ids: list[int]) -> str:
        """Text of token ids, special tokens skipped (echoing a prompt given as ids)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs until one with `finished=True`. Cancelling the iteration aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def start(self) -> None:
        """Load the model and start the background loop (idempotent)."""
        ...

    async def shutdown(self) -> None: ...


@runtime_checkable
class LoraEngineClient(EngineClient, Protocol):
    """An engine that serves LoRA adapters of its base model (vLLM's dynamic adapter API): `generate` takes the
    adapter's name, and adapters are added and removed while it serves."""

    @property
    def lora_enabled(self) -> bool: ...

    def lora_adapters(self) -> dict[str, str]:
        """Registered adapters: name -> path."""
        ...

    async def load_lora(self, name: str, path: str) -> None:
        """Validate and register an adapter (raises ValueError saying why it cannot be served)."""
        ...

    async def unload_lora(self, name: str) -> None:
        """Unregister an adapter (KeyError when unknown); requests already running with it finish."""
        ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...
