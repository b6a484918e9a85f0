"""The Llama-family decoder (Llama 2/3, SmolLM, Mistral without sliding window) over a paged KV cache.

Written as plain tensors and functions rather than `nn.Module`s: inference never needs autograd or module
hooks, and the fewer Python calls per layer, the less a CPU step costs (a pure decode step on panels makes none:
`decode_stack` hands all its layers to the extension's `decode_layers` in one call). Projections are fused (q/k/v
into one matmul, gate/up into one) so a layer is four matmuls; every linear is a `quant.Linear`, so int8, fp8 and int4
variants are the same code. The last layer runs its o projection, MLP and final norm only on the rows a step reads
(`forward(rows=...)`): of a prompt chunk, the cache needs every row's K and V but the sampler only its last row.
Unquantized linears (and the output head) run on the kernel `linear.py` chooses for
the device, dtype and CPU (oneDNN with weights reordered once at load for bf16 on CPUs with native bf16;
plain torch otherwise); the choice and its reason are logged once per model. Numerics follow HF `LlamaForCausalLM` (RMSNorm in fp32, RoPE tables in fp32, HF's
llama3/linear frequency scaling) so greedy outputs match the reference token for token in fp32.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.attention import EAGER, AttentionMetadata, NativeAttention, paged_attention
from worker.model.config import ModelConfig
from worker.model.kernels import FusedOps
from worker.model.linear import (
    PANEL_KERNELS,
    AmxLinear,
    DenseLinear,
    LinearKernel,
    PanelLinear,
    amx_fits,
    available_kernels,
    choose_linear_kernel,
    make_dense_linear,
    panels_fit,
    read_cpu_flags,
)
from worker.model.lora import LoraBatch
from worker.model.quant import Linear, make_linear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def expected_weight_names(cfg: ModelConfig) -> list[str]:
    """The HF tensor names a Llama checkpoint must provide for this config."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        projections = [f"{p}.self_attn.{n}_proj" for n in "qkvo"]
        names += [f"{n}.weight" for n in projections] + [f"{n}.bias" for n in projections if cfg.attention_bias]
        mlp = [f"{p}.mlp.{n}_proj" for n in ("gate", "up", "down")]
        names += [f"{n}.weight" for n in mlp] + [f"{n}.bias" for n in mlp if cfg.mlp_bias]
    return names


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2] in fp32, after the checkpoint's scaling, computed as HF does."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if sc.rope_type == "linear":
        return inv / sc.factor
    if sc.rope_type == "llama3":
        old_len = sc.original_max_position_embeddings
        low_wavelen = old_len / sc.low_freq_factor
        high_wavelen = old_len / sc.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
        smooth = (old_len / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
        smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def owned(source: torch.Tensor, converted: torch.Tensor) -> torch.Tensor:
    """`converted` (`source` moved to the model's device and dtype), copied when it is still `source`'s memory
    and torch does not own that memory (a non-resizable storage: a memory-mapped file, a foreign buffer).

    The loader's tensors are views of the memory-mapped safetensors file; a single one kept by the model (the fp32
    embedding, an untied fp32 head) keeps the whole mapping alive, and with it every page the fused copies were
    read from: +310 MB RSS for SmolLM2-135M in fp32. Tensors torch allocated are kept as they are (no copy)."""
    storage = converted.untyped_storage()
    if storage.data_ptr() == source.untyped_storage().data_ptr() and not storage.resizable():
        return converted.clone(memory_format=torch.contiguous_format)
    return converted


def stack_operands(linear: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A linear's operands as the extension's stack kernels (`decode_layers`, `gated_linear`) take them: (panels,
    bias, extra), an empty tensor for each one it lacks; None where it does not run on panels they multiply by."""
    ops = getattr(linear, "stack_operands", lambda: None)()
    if ops is None:
        return None
    packed, bias, extra = ops
    none = torch.empty(0)
    return packed, none if bias is None else bias, none if extra is None else extra


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Weights plus `forward(input_ids, meta, kv_caches) -> hidden` and `compute_logits(hidden)`."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantization: str | None = None,
        linear_kernel: LinearKernel | None = None,
        fused: FusedOps | None = None,
        quant_amx: FusedOps | None = None,
    ) -> None:
        """`linear_kernel` None: chosen by `choose_linear_kernel` for this device, dtype and CPU. `fused`: the native
        fused steps (`kernels.load_fused_ops`) where they run (the layers' elementwise steps, int8/fp8/int4 dequantization).
        `quant_amx`: the extension where an fp32 model's quantized linears run on AMX (`kernels.load_quant_amx_ops`)."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = cfg.head_dim**-0.5
        names = expected_weight_names(cfg)
        missing = [n for n in names if n not in weights]
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing weights: {shown}")
        embed = weights["model.embed_tokens.weight"]
        if embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"embed_tokens has shape {tuple(embed.shape)}, config says ({cfg.vocab_size}, {cfg.hidden_size})"
            )

        if linear_kernel is None:
            flags = read_cpu_flags() if self.device.type == "cpu" else frozenset()
            linear_kernel, reason = choose_linear_kernel(self.device, dtype, flags, available_kernels(fused))
        else:
            reason = "asked for by the caller"
        self.linear_kernel: LinearKernel = linear_kernel
        self.linear_kernel_reason = reason
        self.fused = fused
        log.info("dense linears run on %s: %s", linear_kernel, reason)

        def take(name: str) -> torch.Tensor:
            return owned(weights[name], weights[name].to(device=self.device, dtype=dtype))

        def linear(prefixes: list[str], bias: bool) -> Linear:
            # One weight [p1; p2; ...] along the output dim (a copy, made once here), so the layer runs one GEMM
            # for q/k/v and one for gate/up; the bias is concatenated the same way (Qwen2-style QKV bias).
            w = torch.cat([weights[f"{p}.weight"] for p in prefixes]).to(self.device)
            b = torch.cat([weights[f"{p}.bias"] for p in prefixes]).to(self.device) if bias else None
            return make_linear(w, b, quantization, dtype, linear_kernel, fused, quant_amx)

        self.layers: list[DecoderLayer] = []
        for i in range(cfg.num_hidden_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            self.layers.append(
                DecoderLayer(
                    input_norm=take(f"model.layers.{i}.input_layernorm.weight"),
                    qkv=linear([f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], cfg.attention_bias),
                    o_proj=linear([f"{attn}.o_proj"], cfg.attention_bias),
                    post_norm=take(f"model.layers.{i}.post_attention_layernorm.weight"),
                    gate_up=linear([f"{mlp}.gate_proj", f"{mlp}.up_proj"], cfg.mlp_bias),
                    down=linear([f"{mlp}.down_proj"], cfg.mlp_bias),
                )
            )
        if quantization is not None and self.layers:
            log.info("%s linears run on %s", quantization, getattr(self.layers[0].gate_up, "path", "?"))
        self.norm = take("model.norm.weight")
        # None where a tied head's panels hold the embedding (`embed_tokens` looks tokens up in them)
        self.embed: torch.Tensor | None = take("model.embed_tokens.weight")
        self._embed_panels: PanelLinear | None = None
        # The output head stays dense (as in vLLM's weight-only schemes): it is one matmul per sampled row. A tied
        # head shares the embedding's storage: oneDNN's packing would hold a second copy (+57 MB bf16 for SmolLM2),
        # so with that kernel it runs torch's matmul; the AMX kernel multiplies by the embedding itself (SmolLM2 at
        # 64 rows: 1.3 s of a 17 s run on W with F.linear); the panels (fp32 or bf16) replace it (the lookups read
        # the panels).
        # An untied head runs the chosen kernel.
        head = self.embed if cfg.tie_word_embeddings else take("lm_head.weight")
        self.lm_head: Linear
        if linear_kernel == "amx_bf16" and fused is not None and amx_fits(head):
            self.lm_head = AmxLinear(head, None, fused, fp32_out=True)  # fp32 logits straight from the sums
        elif linear_kernel in PANEL_KERNELS and fused is not None and panels_fit(head):
            self.lm_head = PanelLinear(head, None, fused, fp32_out=True)  # bf16: fp32 logits straight from the sums
            if cfg.tie_word_embeddings:
                self._embed_panels, self.embed = self.lm_head, None
        elif cfg.tie_word_embeddings:
            self.lm_head = DenseLinear(head)
        else:
            self.lm_head = make_dense_linear(head, None, dtype, linear_kernel, fused)
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        self.decode_stack: list[torch.Tensor] | None = self._decode_stack()
        self.gated_mlp: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = self._gated_mlp()
        # `forward(rows=...)` runs the last layer past attention on those rows alone; False: on every row, the
        # rows picked at the end (the same contract, vLLM's work: bench/decode_stack.py --part prune)
        self.prune_last_layer = True

    def _decode_stack(self) -> list[torch.Tensor] | None:
        """The decoder layers' tensors as the extension's `decode_layers` takes them (per layer: input norm, QKV's
        operands, post norm, o's, gate+up's, down's: `stack_operands`), where a pure decode step can run all its
        layers in one native call: the fused steps native and every linear on panels the stack multiplies by.
        None: the layers run call by call from Python (`forward`)."""
        if self.fused is None:
            return None
        stack: list[torch.Tensor] = []
        for layer in self.layers:
            operands = []
            for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                ops = stack_operands(lin)
                if ops is None:
                    return None
                operands.append(ops)
            qkv, o, gu, down = operands
            stack += [layer.input_norm, *qkv, layer.post_norm, *o, *gu, *down]
        return stack

    def _gated_mlp(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """Per layer, gate+up's `stack_operands` for the extension's `gated_linear` (the linear and SiLU-and-mul in
        one pass, the same bits as the two calls): where every layer's gate+up runs on panels the stack multiplies
        by and gate's and up's columns each fill whole panels. None: the linear, then `silu_and_mul`."""
        fused = self.fused
        if fused is None or not fused.gated_cols(2 * self.cfg.intermediate_size):
            return None
        gated = []
        for layer in self.layers:
            ops = stack_operands(layer.gate_up)
            if ops is None:
                return None
            gated.append(ops)
        return gated

    @property
    def nbytes(self) -> int:
        """Bytes held by weights (tied embeddings counted once)."""
        head, embed = self.lm_head, self.embed
        total = head.nbytes
        if embed is not None and not (isinstance(head, DenseLinear) and head.weight.data_ptr() == embed.data_ptr()):
            total += embed.numel() * embed.element_size()
        total += self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            total += layer.qkv.nbytes + layer.o_proj.nbytes + layer.gate_up.nbytes + layer.down.nbytes
            total += (layer.input_norm.numel() + layer.post_norm.numel()) * layer.input_norm.element_size()
        return total

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [T, 1, head_dim], so rope(x) = x * cos + roll(x, half) * sin."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos = freqs.cos()
        sin = freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype)[:, None, :]
        sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)[:, None, :]
        return cos, sin

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        native: NativeAttention = EAGER,
        lora: LoraBatch | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of the batch's rows; `lora` adds the deltas of the adapters its rows use to every
        projection's output (worker.model.lora; None: the base model alone). `native`: the extension's attention
        pieces that run here (`attention.paged_attention`).

        `rows` (int64 indices into the batch, ascending and distinct; None: all): the rows whose hidden states
        the caller reads, returned in that order. Every row's K and V still reach the cache in every layer, but
        the last layer's o projection, MLP and final norm run on these rows alone: the other rows of a prompt
        chunk only feed the cache, and their last-layer outputs would be thrown away (llama.cpp prunes the same
        way; vLLM computes them). Without LoRA only, whose batch plan is laid out over all the rows."""
        cfg = self.cfg
        t = input_ids.shape[0]
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        half = head_dim // 2
        eps = cfg.rms_norm_eps
        cos, sin = self.rope_tables(meta.positions)
        fused = self.fused
        if rows is not None:
            assert lora is None, "rows: the last layer's pruning runs without LoRA"
            if rows.numel() == t:
                rows = None  # every row is read: nothing to prune
            elif not self.prune_last_layer:
                return self.forward(input_ids, meta, kv_caches, native).index_select(0, rows)
        h = self.embed_tokens(input_ids)
        if (
            self.decode_stack is not None
            and fused is not None
            and lora is None
            and meta.num_decode == t
            and native.decode is not None
            and native.kv_write is not None
        ):
            assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
            out = fused.decode_layers(
                h,
                self.decode_stack,
                [heads, kv_heads, head_dim, cfg.hidden_size, inter],
                cos,
                sin,
                [k for k, _ in kv_caches],
                [v for _, v in kv_caches],
                meta.slot_mapping,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                eps,
                self.norm,
                self.gated_mlp is not None,
            )
            return out if rows is None else out.index_select(0, rows)
        last = len(self.layers) - 1
        pending: torch.Tensor | None = None  # the last sub-layer's output, not yet added to the residual h
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            h, x = self._add_norm(h, pending, layer.input_norm, eps)
            qkv = layer.qkv(x)
            if lora is not None:
                lora.apply(i, "qkv", x, qkv)
            if fused is not None:
                fused.rope_(qkv, heads + kv_heads, head_dim, cos, sin)
                q = qkv[:, :q_size].view(t, heads, head_dim)
                k = qkv[:, q_size : q_size + kv_size].view(t, kv_heads, head_dim)
            else:
                qk = qkv[:, : q_size + kv_size].view(t, heads + kv_heads, head_dim)
                qk = qk * cos + qk.roll(half, dims=-1) * sin
                q = qk[:, :heads]
                k = qk[:, heads:]
            v = qkv[:, q_size + kv_size :].view(t, kv_heads, head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, native)
            attn = attn.reshape(t, q_size)
            if rows is not None and i == last:
                if rows.numel() == 0:  # no row is read: this layer's K and V were all the batch needed
                    return h.new_empty((0, cfg.hidden_size))
                attn, h = attn.index_select(0, rows), h.index_select(0, rows)
            o = layer.o_proj(attn)
            if lora is not None:
                lora.apply(i, "o", attn, o)
            h, x = self._add_norm(h, o, layer.post_norm, eps)
            if self.gated_mlp is not None and fused is not None and lora is None:
                act = fused.gated_linear(x, *self.gated_mlp[i], 2 * inter)
            else:
                gu = layer.gate_up(x)
                if lora is not None:
                    lora.apply(i, "gate_up", x, gu)
                act = fused.silu_and_mul(gu) if fused is not None else F.silu(gu[:, :inter]) * gu[:, inter:]
            pending = layer.down(act)
            if lora is not None:
                lora.apply(i, "down", act, pending)
        return self._add_norm(h, pending, self.norm, eps)[1]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `input_ids` [T] -> [T, hidden]."""
        if self._embed_panels is not None:
            return self._embed_panels.rows(input_ids)
        assert self.embed is not None
        return F.embedding(input_ids, self.embed)

    def _add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm of it): a sub-layer's residual add and the norm after it (fused: h in place)."""
        if self.fused is not None:
            h, x = self.fused.add_rms_norm(h, delta, weight, eps)
            return h, x
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, weight, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] for the given hidden rows."""
        return self.lm_head(hidden).float()
