"""Model hyper-parameters read from an HF `config.json`, validated once, in the units the model code uses.

Why a model of our own: the runner must not depend on `transformers` (it is only a test reference), and a bad
or unsupported checkpoint must fail at load time with a message that says what is wrong, not deep in a matmul.
Both config spellings are accepted: the classic one (`rope_theta` + `rope_scaling`) and transformers 5's
`rope_parameters`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


class RopeScaling(BaseModel):
    """RoPE frequency scaling. `default` = none; `linear` divides positions by `factor`; `llama3` is Llama 3.1's."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = Field(1.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, gt=0)


class ModelConfig(BaseModel):
    """The Llama-family hyper-parameters the decoder needs."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = Field(2048, gt=0)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: Literal["silu"] = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        return self

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed `config.json`, raising `ValueError` naming what is unsupported."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        absent = [k for k in required if k not in raw]
        if absent:
            raise ValueError(f"config.json lacks {absent}: is this an HF causal-LM model folder?")
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; the builtin engine runs {sorted(SUPPORTED_ARCHITECTURES)} "
                "(use engine: vllm for others)"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: Llama-family models use 'silu'")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // heads
        rope = dict(raw.get("rope_parameters") or {})
        legacy = raw.get("rope_scaling") or {}
        theta = rope.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
        scaling = {**legacy, **rope}
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type") not in (None, "default", "linear", "llama3"):
            raise ValueError(
                f"unsupported rope scaling {scaling.get('rope_type')!r}; supported: default, linear, llama3"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=RopeScaling(**{k: v for k, v in scaling.items() if v is not None}),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model folder needs an HF config.json")
        return cls.from_dict(json.loads(path.read_text()))
