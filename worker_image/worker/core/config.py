"""Typed engine configuration: one validated object that the CLI, the offline `LLM` and the async engine share.

Every limit the scheduler and the runner rely on is checked here once, with a message that says how to fix it,
so the engine never discovers a contradictory setting in the middle of serving.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Quantization = Literal["none", "int8", "fp8", "int4"]
DType = Literal["auto", "float32", "bfloat16", "float16"]  # auto: worker.model.linear.resolve_auto_dtype
SchedulingPolicy = Literal["fcfs", "priority"]
MAX_SPECULATIVE_TOKENS = 16  # drafts verified per step and request; more only costs compute on rejected tokens
MAX_PROMPT_LOOKUP = 32  # longest n-gram matched against the context
MAX_LORAS = 256  # adapter slots; each costs its adapter's weights in memory
MAX_LORA_RANK = 512


class SpeculativeConfig(BaseModel):
    """Speculative decoding by prompt lookup (vLLM's `--speculative-config` with `method: ngram`).

    Each step, a running decode request proposes up to `num_speculative_tokens` drafts: the tokens that followed
    the earliest earlier occurrence of its longest suffix n-gram (n from `prompt_lookup_max` down to
    `prompt_lookup_min`, see `worker.core.ngram`). The target model verifies them in the same forward pass.
    Speculation is skipped for a step in which more than `disable_by_batch_size` requests are decoding: at large
    batches a CPU is compute-bound and the verified-but-rejected tokens would cost throughput.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(
        default=4, ge=1, le=MAX_SPECULATIVE_TOKENS, description="draft tokens proposed per step and request"
    )
    prompt_lookup_max: int = Field(default=4, ge=1, le=MAX_PROMPT_LOOKUP, description="longest n-gram matched")
    prompt_lookup_min: int = Field(default=2, ge=1, le=MAX_PROMPT_LOOKUP, description="shortest n-gram matched")
    disable_by_batch_size: int = Field(
        default=4,
        ge=1,
        description="speculate only in steps where at most this many requests are decoding",
    )

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max}): lower the former or raise the latter"
            )
        return self


class EngineConfig(BaseModel):
    """Settings of one engine instance (mirrors the vLLM engine arguments of the same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, description="model folder (HF safetensors layout)")
    served_model_name: str | None = Field(default=None, description="name reported by /v1/models")
    dtype: DType = "float32"
    quantization: Quantization = "none"
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")

    block_size: int = Field(default=16, ge=1, le=256, description="tokens per KV-cache block")
    num_blocks: int | None = Field(default=None, ge=1, description="KV-cache size in blocks (or kv_cache_bytes)")
    kv_cache_bytes: int | None = Field(default=None, ge=1, description="KV-cache size in bytes (or num_blocks)")
    max_model_len: int | None = Field(default=None, ge=2, description="prompt + output tokens; default: the model's")

    max_num_seqs: int = Field(default=64, ge=1, description="requests running at once")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="tokens computed per step")
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    max_waiting: int = Field(default=1024, ge=1, description="waiting requests admitted before new ones are refused")
    enforce_eager: bool = Field(
        default=False,
        description="plain torch ops everywhere: skip the native CPU decode kernel and the fused bf16 layer steps",
    )
    speculative: SpeculativeConfig | None = Field(
        default=None, description="speculative decoding by prompt lookup; None: off"
    )
    enable_lora: bool = Field(default=False, description="serve LoRA adapters of the base model")
    max_loras: int = Field(default=1, ge=1, le=MAX_LORAS, description="adapters resident at once (slots)")
    max_lora_rank: int = Field(default=16, ge=1, le=MAX_LORA_RANK, description="largest adapter rank accepted")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {self.block_size}")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("set either num_blocks or kv_cache_bytes, not both")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running request needs one token per step; raise the former "
                "or lower the latter"
            )
        if self.max_model_len is not None:
            self.check_max_model_len(self.max_model_len)
        return self

    def check_max_model_len(self, max_model_len: int) -> None:
        """Raise if a (possibly model-derived) context length contradicts the batching settings."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit in one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be at least max_model_len ({max_model_len}); raise it, "
                "lower max_model_len or enable_chunked_prefill"
            )

    @property
    def runner_quantization(self) -> str | None:
        """What `ModelRunner(quantization=...)` takes: None for unquantized weights."""
        return None if self.quantization == "none" else self.quantization
