"""Build tiny random Llama model folders in the HF layout, for tests anywhere in the project.

`make_tiny_llama(path)` writes `config.json`, `model.safetensors`, `tokenizer.json` (a byte-level BPE trained
by the `tokenizers` library on a fixed corpus, so every string is encodable and the result is deterministic),
`tokenizer_config.json` (ChatML chat template, `<|im_end|>` as EOS) and `generation_config.json`. The folder
loads both in our `ModelRunner` and in `transformers.LlamaForCausalLM`, which is what the correctness tests
compare. Weights are drawn with a fixed seed and a larger spread than real initialisations, so greedy decoding
has clear winners (fp32 rounding differences between implementations then never flip a token).

`add_projection_biases(path)` gives such a folder a bias on every projection (as Qwen2 has them).
`make_random_lora(path, model_dir)` writes a random LoRA adapter in PEFT's format for such a folder (or any
Llama folder), and `merge_lora_into` merges one into a transformers state dict: the reference an adapter served
by our engine must equal. `causal_attention` is the reference the native prompt-attention kernels are held to, `qkv_views` their inputs as
the model hands them over. `Fp32PanelsOnly` shows the extension as a CPU without AVX512-BF16 sees it, so the fp32
code panels such CPUs run are tested on any CPU that has them. `int16_activations` and `int16_rounding` are what
AVX2 hosts' int8, fp8 and int4 panels do to x and the most that moves an output; `int4_grid` and `fp8_grid` the
weights AVX2 hosts' int4 and fp8 panels multiply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from worker.model.linear import unpack_panels

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.",
    "Hello, world! How are you today? I am fine, thank you. Tell me a story about a robot and a cat.",
    "Large language models generate text one token at a time. Continuous batching keeps the machine busy.",
    "Paged attention stores keys and values in fixed-size blocks; a block table maps positions to blocks.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Ünïcödé: café, naïve, 東京, 😀 emoji.",
]


def make_tiny_tokenizer(vocab_size: int = 384) -> Tokenizer:
    """A deterministic byte-level BPE with the ChatML special tokens at ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def make_tiny_llama(
    path: str | Path,
    *,
    hidden_size: int = 72,
    intermediate_size: int = 100,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 6,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int = 384,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    rms_norm_eps: float = 1e-5,
    init_std: float = 0.2,
    seed: int = 0,
    pad_vocab_to: int | None = None,
) -> Path:
    """Write a tiny random Llama HF folder at `path` (created if needed) and return it.

    `pad_vocab_to` grows the embedding and head (and `vocab_size` in config.json) past the tiny tokenizer's
    vocabulary, as real models pad theirs: a random model in the shape of a real one for benchmarks that feed
    token ids, where the hub that holds the real weights is out of reach."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(vocab_size)
    vocab = max(tok.get_vocab_size(with_added_tokens=True), pad_vocab_to or 0)
    head_dim = head_dim or hidden_size // num_attention_heads
    bos, eos = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * init_std

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden_size, generator=gen)

    q_size, kv_size = num_attention_heads * head_dim, num_key_value_heads * head_dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, hidden_size)}
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.input_layernorm.weight": norm(),
            f"{p}.self_attn.q_proj.weight": rand(q_size, hidden_size),
            f"{p}.self_attn.k_proj.weight": rand(kv_size, hidden_size),
            f"{p}.self_attn.v_proj.weight": rand(kv_size, hidden_size),
            f"{p}.self_attn.o_proj.weight": rand(hidden_size, q_size),
            f"{p}.post_attention_layernorm.weight": norm(),
            f"{p}.mlp.gate_proj.weight": rand(intermediate_size, hidden_size),
            f"{p}.mlp.up_proj.weight": rand(intermediate_size, hidden_size),
            f"{p}.mlp.down_proj.weight": rand(hidden_size, intermediate_size),
        }
    tensors["model.norm.weight"] = norm()
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = rand(vocab, hidden_size)
    weights = {k: v.contiguous() for k, v in tensors.items()}
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(root / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2))
    return root


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_projection_biases(root: str | Path, seed: int = 5) -> Path:
    """Give every projection of the Llama folder at `root` (q/k/v/o, gate/up/down) a random bias and turn on
    `attention_bias` and `mlp_bias`, as a Qwen2- or Llama-with-bias checkpoint has them. Returns `root`."""
    root = Path(root)
    tensors = load_file(str(root / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(tensors.items()):
        if name.endswith("_proj.weight"):
            tensors[name.removesuffix("weight") + "bias"] = torch.randn(t.shape[0], generator=gen) * 0.2
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(config | {"attention_bias": True, "mlp_bias": True}))
    return root


def make_random_lora(
    path: str | Path,
    model_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = LORA_TARGETS,
    use_rslora: bool = False,
    init_std: float = 0.1,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Write a random LoRA adapter in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`) for the
    Llama folder `model_dir`, and return its tensors by PEFT key. Both A and B are random (PEFT starts B at zero;
    a zero delta would test nothing)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_size, kv_size = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * init_std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * init_std
    save_file(tensors, str(root / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": use_rslora,
        "task_type": "CAUSAL_LM",
    }
    (root / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return tensors


def merge_lora_into(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], scale: float) -> None:
    """Add `scale * B @ A` of each adapted projection to its weight in a transformers Llama state dict (in place):
    the merged reference that serving the adapter must equal."""
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        base = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = tensors[key.replace("lora_A", "lora_B")]
        w = state[f"{base}.weight"]
        w += (scale * (b.double() @ a.double())).to(w.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Attention in fp32 (float64 for float64 inputs) of queries at positions start .. start + n over keys 0 ..
    start + n, query i seeing keys up to start + i. Returns [n, heads * head_dim]."""
    n, heads, hd = q.shape
    kv = k.shape[0]
    dtype = torch.promote_types(q.dtype, torch.float32)
    mask = torch.zeros(n, kv, dtype=dtype)
    mask.masked_fill_(torch.arange(kv)[None, :] > start + torch.arange(n)[:, None], float("-inf"))
    qf, kf, vf = (x.to(dtype).transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, heads * hd)


def qkv_views(n: int, start: int, heads: int, kv_heads: int, hd: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    """q, k, v as the model has them: strided views into fused QKV rows (q for the chunk's own rows only)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(start + n, (heads + 2 * kv_heads) * hd, generator=gen).to(dtype)
    q = qkv[start:, : heads * hd].view(n, heads, hd)
    k = qkv[:, heads * hd : (heads + kv_heads) * hd].view(start + n, kv_heads, hd)
    v = qkv[:, (heads + kv_heads) * hd :].view(start + n, kv_heads, hd)
    return q, k, v


def _chunk_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each input's 64-input chunk's largest |x|, per row: where AVX2 hosts' int8 panels quantize the activations to
    int16 (`kernels.py`, quantize_rows_i16), an input's step is that / 32767."""
    chunks = [x[:, k : k + 64] for k in range(0, x.shape[1], 64)]
    return torch.cat([c.abs().amax(1, keepdim=True).expand(-1, c.shape[1]) for c in chunks], 1)


def int16_activations(x: torch.Tensor) -> torch.Tensor:
    """x as AVX2 hosts' int8 panels see it: x * (32767 / its chunk's largest |x|) rounded half to even, times the
    step (the step and the codes in fp32, as the kernel computes them; their product in fp64)."""
    big = _chunk_absmax(x)
    # 32767 / big rounded once, as the kernel divides (torch's `32767 / big` is big's reciprocal times 32767: two
    # roundings, one ulp off at times, and a product that then lands on .5 rounds the other way)
    inv = torch.where(big > 0, (32767 / big.double()).float(), torch.zeros_like(big))
    return torch.round(x * inv).double() * (big / 32767).double()


def int16_rounding(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The most int16_activations can move x @ w.T (fp64, [rows, out]): half a step of each input times |w|."""
    return (_chunk_absmax(x).double() / 65534) @ w.double().abs().t()


def _grid_chunks(k: int) -> list[tuple[int, int]]:
    """The 64-input chunks [a, b) of k inputs that AVX2 hosts' int16 paths sum exactly."""
    return [(c, min(k, c + 64)) for c in range(0, k, 64)]


def _grid_step(top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight grid's step for each column and chunk whose largest |weight| (a bound of it) is `top` (fp32), and
    1 / step (0 where top is 0), both in fp32 as the kernel divides (each division rounded once: fp64's, narrowed)."""
    step = (top.double() / 1023).float()
    return step, torch.where(step > 0, (1 / step.double()).float(), torch.zeros_like(step))


def fp8_grid(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights AVX2 hosts' fp8 panels multiply (`kernels.py`, F8GridPanels), computed as the kernel computes them
    from fp8 panels (`pack_panels` of e4m3 codes, [P, K, cols]): each code's value / 2**8 (its fp16 pattern's) times
    1 / step rounded half to even (one fused multiply-add: the exact product, rounded once), the step the column's
    chunk's largest |value| / 1023. `scale`: each output row's ([out_features], quantize_fp8's). Returns (the grid
    weights, each weight's step), both fp64 [out_features, K] in the weights' units (times the row's scale)."""
    from worker.model.quant import FP8_TO_FP16_EXP_SHIFT, fp8_to_fp16

    k = codes.shape[1]
    value = fp8_to_fp16(codes).float()  # [P, K, cols]
    top = torch.stack([value[:, a:b].abs().amax(1) for a, b in _grid_chunks(k)], 1)  # [P, chunks, cols]
    step, inv = _grid_step(top)
    chunk_of = torch.arange(k) // 64
    units = torch.round(value.double() * inv[:, chunk_of].double())
    assert units.abs().max() <= 1023, "the grid's values must fit its top"
    steps = step[:, chunk_of].double()
    out_features = scale.shape[0]
    unit = (scale.double() * FP8_TO_FP16_EXP_SHIFT)[:, None]
    return unpack_panels(units * steps, out_features) * unit, unpack_panels(steps, out_features) * unit


def int4_grid(codes: torch.Tensor, groups: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights AVX2 hosts' int4 panels multiply (`kernels.py`, I4GridPanels), computed as the kernel computes
    them from int4 panels (`pack_int4_panels`' codes and groups): each code put on an int16 grid of its column and
    64-input chunk, (code * S + O + 16) >> 5 with S and O its group's scale and offset in 1/32 steps, the step the
    chunk's bound max(|offset|, |offset + 15 scale|) over its groups / 1023. Returns (the grid weights, each
    weight's step), both fp64 [out_features, K]."""
    k = codes.shape[1]
    g = k // groups.shape[1]
    scale, offset = groups[:, :, 0], groups[:, :, 1]  # fp32 [P, K / G, cols]
    bound = torch.maximum(offset.abs(), (15 * scale.double() + offset.double()).float().abs())  # (one fma)
    top = torch.stack([bound[:, a // g : (b - 1) // g + 1].amax(1) for a, b in _grid_chunks(k)], 1)
    step, inv = _grid_step(top)
    inv = inv * 32
    chunk_of, group_of = torch.arange(k) // 64, torch.arange(k) // g
    s_units = torch.round(scale[:, group_of] * inv[:, chunk_of]).long()  # [P, K, cols]
    o_units = torch.round(offset[:, group_of] * inv[:, chunk_of]).long() + 16
    q = torch.cat([codes & 0xF, codes >> 4], dim=-1).long()
    units = q * s_units + o_units
    assert units.abs().max() < 2**15, "the grid's 16-bit sums must not wrap"
    steps = step[:, chunk_of].double()
    weights = torch.div(units, 32, rounding_mode="floor").double() * steps
    return unpack_panels(weights, out_features), unpack_panels(steps, out_features)


class Fp32PanelsOnly:
    """The native extension with its bf16 panels refused (`bf16_panels_ready` False), as on a CPU without
    AVX512-BF16: an fp32 model's int8/fp8 layers then take the fp32 code panels (`panel_linear_i8` / `_fp8`)."""

    def __init__(self, module: object) -> None:
        self._module = module

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)

    def bf16_panels_ready(self) -> bool:
        return False
