"""Typed settings of the worker server: one validated object built from CLI flags, files and the environment.

Everything the server decides with (admission limits, drain timeout, the drain token, fault injection) lives here,
so the decisions stay pure functions of (settings, state) and a bad flag fails at start-up with a message that says
how to fix it, never at the first request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from worker.core.config import SpeculativeConfig

DRAIN_TOKEN_ENV = "LLMFLEET_DRAIN_TOKEN"
FAULT_ENV_PREFIX = "LLMFLEET_FAULT_"

EngineKind = Literal["builtin", "vllm", "fake"]
Quantization = Literal["none", "int8", "fp8", "int4"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
MaxTokensPolicy = Literal["reject", "clamp"]
# vLLM 0.32's `LoRAConfig.max_lora_rank` takes only these (`vllm.config.lora.MaxLoRARanks`); the builtin engine
# takes any rank.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


# The worker's port when none is given. The fleet's side of the contract is `crds.pods.WORKER_PORT` (the worker
# image imports nothing of the fleet); tests/worker_server/test_server_settings.py checks that the two agree.
DEFAULT_PORT = 8000


class FaultSettings(BaseModel):
    """Fault injection for tests of canary analysis with real pods. Off unless an `LLMFLEET_FAULT_*` variable is set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_delay_ms: float = Field(0.0, ge=0, description="extra delay before the first token of every request")
    itl_delay_ms: float = Field(0.0, ge=0, description="extra delay before every later token")
    error_rate: float = Field(0.0, ge=0, le=1, description="share of generation requests answered with HTTP 500")
    seed: int = Field(0, description="seed of the RNG that picks the failing requests (reproducible runs)")

    @property
    def enabled(self) -> bool:
        return self.ttft_delay_ms > 0 or self.itl_delay_ms > 0 or self.error_rate > 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FaultSettings:
        """Read `LLMFLEET_FAULT_TTFT_DELAY_MS`, `..._ITL_DELAY_MS`, `..._ERROR_RATE` and `..._SEED`."""
        values: dict[str, str] = {}
        known = {name.upper(): name for name in cls.model_fields}
        for key, value in env.items():
            if not key.startswith(FAULT_ENV_PREFIX):
                continue
            suffix = key.removeprefix(FAULT_ENV_PREFIX)
            if suffix not in known:
                expected = ", ".join(FAULT_ENV_PREFIX + k for k in sorted(known))
                raise ValueError(f"unknown fault-injection variable {key}; expected one of {expected}")
            values[known[suffix]] = value
        return cls.model_validate(values)


class WorkerSettings(BaseModel):
    """What `llmfleet worker` runs with. Engine sizing fields left `None` take the engine's defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, description="model source: bundled://NAME, a local folder or hf://ORG/REPO")
    revision: str | None = Field(None, min_length=1, description="model revision (hf:// sources)")
    served_model_name: str | None = Field(None, min_length=1, description="name clients send as `model`")
    engine: EngineKind = "builtin"
    quantization: Quantization = "none"
    dtype: DType = "auto"
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="0 picks a free port (tests)")
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    kv_cache_bytes: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    speculative: SpeculativeConfig | None = Field(
        None, description="speculative decoding by prompt lookup (--speculative-config, vLLM's JSON); None: off"
    )
    enable_lora: bool = Field(False, description="serve LoRA adapters of the base model (--enable-lora)")
    max_loras: int | None = Field(None, ge=1, description="adapters resident at once (--max-loras)")
    max_lora_rank: int | None = Field(None, ge=1, description="largest adapter rank accepted (--max-lora-rank)")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="adapters loaded at start-up, name -> PEFT folder (--lora-modules)"
    )
    max_waiting: int = Field(256, ge=1, description="requests allowed to wait for a running slot before 429")
    max_tokens_cap: int | None = Field(None, ge=1, description="largest max_tokens a request may ask for")
    max_tokens_policy: MaxTokensPolicy = Field(
        "reject", description="reject: 400 when max_tokens exceeds the cap or the context; clamp: lower it"
    )
    request_timeout_s: float | None = Field(None, gt=0, description="per-request deadline (a header may shorten it)")
    drain_timeout_s: float = Field(30.0, ge=0, description="how long a drain waits for in-flight requests")
    drain_token: SecretStr | None = Field(None, description="bearer token of POST /drain; None disables POST /drain")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of 429 and 503 answers")
    tokenizer_threads: int = Field(
        2,
        ge=1,
        le=64,
        description="threads that tokenize prompts (and render chat templates) off the event loop; "
        "more requests wait for one, up to max_waiting, then get 429",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="largest request body in bytes (--max-body-bytes); a larger one gets 413 before it is read whole",
    )
    faults: FaultSettings = FaultSettings()

    engine_extra_args: dict[str, Any] = Field(
        default_factory=dict,
        description="engine flags with no field here (`spec.engine.extraArgs`), passed to vLLM's engine arguments",
    )

    @model_validator(mode="after")
    def _extra_args_need_vllm(self) -> WorkerSettings:
        if self.engine_extra_args and self.engine != "vllm":
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in self.engine_extra_args)
            raise ValueError(
                f"unknown flags for the {self.engine} engine: {flags}. Extra engine flags are passed "
                "to vLLM only: use --engine vllm, or remove them (spec.engine.extraArgs)"
            )
        return self

    @model_validator(mode="after")
    def _lora_needs_enable_lora(self) -> WorkerSettings:
        given = [
            flag
            for flag, value in (
                ("--max-loras", self.max_loras),
                ("--max-lora-rank", self.max_lora_rank),
                ("--lora-modules", self.lora_modules or None),
            )
            if value is not None
        ]
        if given and not self.enable_lora:
            raise ValueError(f"{', '.join(given)} need --enable-lora: add it, or remove them")
        rank = self.max_lora_rank
        if self.engine == "vllm" and rank is not None and rank not in VLLM_MAX_LORA_RANKS:
            allowed = ", ".join(map(str, VLLM_MAX_LORA_RANKS))
            higher = [r for r in VLLM_MAX_LORA_RANKS if r > rank]
            raise ValueError(
                f"--max-lora-rank {rank}: the vllm engine takes one of {allowed} (vLLM's max_lora_rank); "
                + (f"use {higher[0]} (adapters of lower rank are served too)" if higher else "use at most 512")
                + ", or --engine builtin, which takes any rank"
            )
        for name in self.lora_modules:
            if not name or ":" in name or name == self.model_name:
                raise ValueError(
                    f"--lora-modules: adapter name {name!r} must be non-empty, without ':', and not the base "
                    "model's name"
                )
        return self

    @field_validator("drain_token")
    @classmethod
    def _token_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError(f"the drain token is empty: put a non-empty secret in {DRAIN_TOKEN_ENV} or the token file")
        return value

    @property
    def model_name(self) -> str:
        """The served model name: the explicit one, else the last part of the source (`bundled://x` -> `x`)."""
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").rsplit("/", 1)[-1]


def read_drain_token(token_file: Path | None, env: Mapping[str, str]) -> SecretStr | None:
    """The drain token: the file's content when a file is given, else `LLMFLEET_DRAIN_TOKEN`, else None.

    A blank file or a blank variable is an error (a blank secret is almost always a missing Secret key), so a
    worker never runs with a drain endpoint that anyone could call by sending an empty bearer token.
    """
    if token_file is not None:
        try:
            text = token_file.read_text().strip()
        except OSError as err:
            raise ValueError(f"cannot read --drain-token-file {token_file}: {err.strerror}") from err
        if not text:
            raise ValueError(f"--drain-token-file {token_file} is empty: put the drain token in it")
        return SecretStr(text)
    if DRAIN_TOKEN_ENV in env:
        value = env[DRAIN_TOKEN_ENV].strip()
        if not value:
            raise ValueError(f"{DRAIN_TOKEN_ENV} is set but empty: set it to the drain token or unset it")
        return SecretStr(value)
    return None


def default_host(env: Mapping[str, str] | None = None) -> str:
    """$POD_IP when set (Kubernetes downward API), else loopback."""
    env = os.environ if env is None else env
    return env.get("POD_IP") or "127.0.0.1"
