"""Fused projections: q/k/v run as one linear and gate/up as one, for every dtype and quantization the model
supports, with the weights fused once at load.

Fusing is exact for every format here because each one quantizes per output row (int8, fp8: one scale per row; int4:
groups along the input dim of a row; dense and oneDNN-packed: no quantization), so the fused layer is the
concatenation of the per-projection layers, bit for bit in the weights it multiplies by. A format with a
per-tensor scale would not have that property; these tests would catch one. Also: projection biases (Qwen2-style
QKV bias, Llama's `attention_bias` / `mlp_bias`) are fused with their weights and match transformers token for
token, and the model keeps no tensor of the caller's (the loader's are views of the memory-mapped file).
"""

from __future__ import annotations

import pytest
import torch
from worker.model import quant as quant_module
from worker.model.config import ModelConfig
from worker.model.linear import ONEDNN_LINEAR, PackedLinear, available_kernels
from worker.model.llama import LlamaModel
from worker.model.loader import load_weights
from worker.model.quant import Fp8Linear, Int4Linear, Int8Linear, fp8_chunk_rows, make_linear
from worker.model.runner import ModelRunner
from worker.model.testing import add_projection_biases, make_tiny_llama

needs_onednn = pytest.mark.skipif(ONEDNN_LINEAR not in available_kernels(), reason="torch without oneDNN bf16")
GEN = torch.Generator().manual_seed(0)
SIZES = (64, 32, 32)  # q, k, v rows (GQA: k and v narrower than q)
IN = 128  # divisible by 32: int4 groups fit

FORMATS = [
    pytest.param(None, torch.float32, "aten", id="fp32"),
    pytest.param(None, torch.bfloat16, "aten", id="bf16-aten"),
    pytest.param(None, torch.bfloat16, "onednn_bf16", id="bf16-onednn", marks=needs_onednn),
    pytest.param("int8", torch.float32, "aten", id="int8"),
    pytest.param("int8", torch.bfloat16, "aten", id="int8-bf16"),
    pytest.param("fp8", torch.float32, "aten", id="fp8"),
    pytest.param("fp8", torch.bfloat16, "aten", id="fp8-bf16"),
    pytest.param("int4", torch.float32, "aten", id="int4"),
]


def _weights(bias: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    ws = [torch.randn(n, IN, generator=GEN) * 0.1 for n in SIZES]
    bs = [torch.randn(n, generator=GEN) for n in SIZES] if bias else None
    return ws, bs


def _plain_weight(layer, dtype: torch.dtype) -> torch.Tensor:
    return layer.dequantize(dtype) if hasattr(layer, "dequantize") else layer.weight.to(dtype)


@pytest.mark.parametrize("quant,dtype,kernel", FORMATS)
@pytest.mark.parametrize("bias", [False, True])
def test_a_fused_linear_is_the_concatenation_of_its_parts(quant, dtype, kernel, bias):
    ws, bs = _weights(bias)
    fused = make_linear(torch.cat(ws), torch.cat(bs) if bs else None, quant, dtype, kernel)
    parts = [make_linear(w, bs[i] if bs else None, quant, dtype, kernel) for i, w in enumerate(ws)]
    assert fused.out_features == sum(SIZES)
    # the weights it multiplies by are exactly the parts' (per-row quantization commutes with concatenation)
    assert torch.equal(_plain_weight(fused, torch.float32), torch.cat([_plain_weight(p, torch.float32) for p in parts]))
    # and fusing costs no memory: the fused layer holds what the parts hold together
    assert fused.nbytes == sum(p.nbytes for p in parts)
    x = torch.randn(7, IN, generator=GEN).to(dtype)
    got = torch.split(fused(x), list(SIZES), dim=-1)
    for g, p in zip(got, parts):
        torch.testing.assert_close(g, p(x))


def test_fp8_tiles_only_big_weights():
    assert fp8_chunk_rows(3072, 576) == 512  # SmolLM2's fused gate+up: 6 tiles of 512 rows
    assert fp8_chunk_rows(960, 576) == 960  # its fused q/k/v stays whole
    assert fp8_chunk_rows(28672, 4096) == 72  # Llama-3-8B's gate+up: same ~295k weights per tile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_fp8_linear_computes_what_the_whole_one_does(monkeypatch, dtype):
    ws, bs = _weights(bias=True)
    w, b = torch.cat(ws), torch.cat(bs).to(dtype)
    whole = Fp8Linear(w, b, dtype)
    monkeypatch.setattr(quant_module, "FP8_TILE_WEIGHTS", 24 * IN)  # 24-row tiles: 128 rows = 5 tiles + 8 rows
    tiled = Fp8Linear(w, b, dtype)
    assert tiled._chunk_rows == 24 and whole._chunk_rows == len(w)
    x = torch.randn(7, IN, generator=GEN).to(dtype)
    torch.testing.assert_close(tiled(x), whole(x))
    assert tiled(x).shape == (7, len(w))


@pytest.mark.parametrize(("rows", "tiles"), [(7, 6), (256, 6), (257, 1), (2048, 1)])
def test_quantized_weights_dequantize_in_tiles_for_decode_batches_only(rows, tiles):
    """128 output rows in tiles of 24: six tiles for a decode-sized batch, the whole weight at once past AMX_MAX_ROWS
    (a prompt chunk), and the same product either way."""
    w = torch.randn(128, 32, generator=GEN)
    asked: list[tuple[int, int]] = []

    def tile(start: int, end: int) -> torch.Tensor:
        asked.append((start, end))
        return w[start:end]

    x = torch.randn(rows, 32, generator=GEN)
    y = quant_module._tiled_linear(x, 128, 24, tile)
    assert len(asked) == tiles and asked[-1][1] == 128
    torch.testing.assert_close(y, x @ w.t())


@pytest.mark.parametrize(
    "quant,cls",
    [
        ("int8", Int8Linear),
        ("fp8", Fp8Linear),
        ("int4", Int4Linear),
        pytest.param(None, PackedLinear, marks=needs_onednn),
    ],
)
def test_model_layers_run_four_fused_linears_of_the_asked_kind(quant, cls, tmp_path):
    root = make_tiny_llama(tmp_path, hidden_size=128, intermediate_size=256, num_attention_heads=4)
    cfg = ModelConfig.from_dir(root)
    dtype = torch.bfloat16 if quant is None else torch.float32
    kernel = "onednn_bf16" if quant is None else None
    model = LlamaModel(cfg, load_weights(root, dtype), dtype=dtype, quantization=quant, linear_kernel=kernel)
    for layer in model.layers:
        assert all(isinstance(lin, cls) for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        assert layer.qkv.out_features == cfg.q_size + 2 * cfg.kv_size
        assert layer.gate_up.out_features == 2 * cfg.intermediate_size


def test_the_model_keeps_no_view_of_the_memory_mapped_file(tmp_path):
    """The loader's tensors are views of the memory-mapped file when the file already has the model's dtype:
    one of them kept alive (the embedding, an untied head) would keep the whole mapping, every page read while
    fusing included, resident next to the fused copies."""
    root = make_tiny_llama(tmp_path, tie_word_embeddings=False)  # written in fp32
    cfg = ModelConfig.from_dir(root)
    weights = load_weights(root, torch.float32)
    assert not any(t.untyped_storage().resizable() for t in weights.values())  # file memory, not torch's
    mapped = {t.untyped_storage().data_ptr() for t in weights.values()}
    model = LlamaModel(cfg, weights, dtype=torch.float32, linear_kernel="aten")
    kept = [model.embed, model.norm, model.lm_head.weight]
    for layer in model.layers:
        kept += [layer.input_norm, layer.post_norm]
        kept += [lin.weight for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    assert not {t.untyped_storage().data_ptr() for t in kept} & mapped
    assert model.nbytes == sum(t.numel() * t.element_size() for t in weights.values())


@pytest.fixture(scope="module")
def biased_dir(tmp_path_factory):
    """The tiny Llama with `attention_bias` and `mlp_bias` (q/k/v/o and gate/up/down biases), as a Qwen2- or
    Llama-with-bias checkpoint has them."""
    return add_projection_biases(make_tiny_llama(tmp_path_factory.mktemp("biased"), num_hidden_layers=2))


@pytest.mark.parametrize("chunk", [None, 5])
def test_fused_biased_projections_match_transformers_token_for_token(
    biased_dir, load_hf_fn, hf_greedy_fn, driver_cls, seq_cls, chunk
):
    runner = ModelRunner(str(biased_dir), num_blocks=64, block_size=4)
    assert runner.config.attention_bias and runner.config.mlp_bias
    hf = load_hf_fn(biased_dir)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, runner.vocab_size, (n,), generator=gen).tolist() for n in (1, 9, 23)]
    expected = [hf_greedy_fn(hf, p, 8) for p in prompts]
    seqs = [seq_cls(f"r{i}", list(p), 8) for i, p in enumerate(prompts)]
    driver_cls(runner).run(seqs, chunk=chunk)
    assert [s.output for s in seqs] == expected
