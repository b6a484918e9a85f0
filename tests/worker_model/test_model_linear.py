"""Dense linear kernels: the pure kernel choice, CPU flag parsing, the oneDNN packed layer against `F.linear`,
and the model building its linears (fused projections and the head) with the chosen kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from worker.model.config import ModelConfig
from worker.model.linear import (
    ONEDNN_LINEAR,
    DenseLinear,
    PackedLinear,
    available_kernels,
    choose_linear_kernel,
    make_dense_linear,
    read_cpu_flags,
    resolve_auto_dtype,
)
from worker.model.llama import LlamaModel
from worker.model.loader import load_weights
from worker.model.testing import make_tiny_llama

BF16_CPU = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
AMX_CPU = frozenset({"avx512f", "amx_bf16", "amx_tile"})
OLD_CPU = frozenset({"avx2", "fma"})
ONEDNN = frozenset({ONEDNN_LINEAR})
needs_onednn = pytest.mark.skipif(ONEDNN_LINEAR not in available_kernels(), reason="torch without oneDNN bf16")
GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    "device,dtype,flags,kernels,expected,why",
    [
        ("cpu", torch.bfloat16, BF16_CPU, ONEDNN, "onednn_bf16", "avx512_bf16"),
        ("cpu", torch.bfloat16, AMX_CPU, ONEDNN, "onednn_bf16", "amx_bf16"),
        ("cpu", torch.bfloat16, OLD_CPU, ONEDNN, "aten", "without avx512_bf16"),
        ("cpu", torch.bfloat16, BF16_CPU, frozenset(), "aten", "lacks oneDNN"),
        ("cpu", torch.float32, BF16_CPU, ONEDNN, "aten", "MKL"),
        ("cpu", torch.float16, BF16_CPU, ONEDNN, "aten", "float16"),
        ("cuda", torch.bfloat16, BF16_CPU, ONEDNN, "aten", "device cuda"),
        ("cuda:0", torch.float32, frozenset(), frozenset(), "aten", "device cuda"),
    ],
)
def test_choose_linear_kernel(device, dtype, flags, kernels, expected, why):
    kind, reason = choose_linear_kernel(device, dtype, flags, kernels)
    assert kind == expected
    assert why in reason


@pytest.mark.parametrize(
    "device,flags,kernels,expected,why",
    [
        ("cpu", BF16_CPU, ONEDNN, "bfloat16", "avx512_bf16"),
        ("cpu", AMX_CPU, ONEDNN, "bfloat16", "amx_bf16"),
        ("cpu", OLD_CPU, ONEDNN, "float32", "without avx512_bf16"),
        ("cpu", BF16_CPU, frozenset(), "float32", "lacks oneDNN"),
        ("cuda", frozenset(), frozenset(), "bfloat16", "device cuda"),
    ],
)
def test_resolve_auto_dtype(device, flags, kernels, expected, why):
    dtype, reason = resolve_auto_dtype(device, flags, kernels)
    assert dtype == expected
    assert why in reason


@pytest.mark.parametrize(
    "text,expected",
    [
        ("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\nbogomips\t: 1\n", {"fpu", "avx512f", "avx512_bf16"}),
        ("processor\t: 0\nFeatures\t: fp asimd bf16\n", {"fp", "asimd", "bf16"}),
        ("processor\t: 0\n", set()),
    ],
)
def test_read_cpu_flags(tmp_path, text, expected):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert read_cpu_flags(path) == expected


def test_read_cpu_flags_without_cpuinfo(tmp_path):
    assert read_cpu_flags(tmp_path / "absent") == frozenset()


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_in_bf16(rows, bias):
    w = torch.randn(96, 64, generator=GEN).bfloat16()
    b = torch.randn(96, generator=GEN).bfloat16() if bias else None
    layer = PackedLinear(w, b)
    x = torch.randn(rows, 64, generator=GEN).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x, w, b))
    assert torch.equal(layer.dequantize(torch.bfloat16), w)
    assert layer.out_features == 96 and layer.nbytes == w.numel() * 2 + (96 * 2 if bias else 0)


@needs_onednn
def test_packed_linear_takes_strided_and_batched_inputs():
    w = torch.randn(32, 48, generator=GEN).bfloat16()
    layer = PackedLinear(w)
    wide = torch.randn(5, 96, generator=GEN).bfloat16()[:, :48]
    torch.testing.assert_close(layer(wide), F.linear(wide, w))
    batched = torch.randn(2, 3, 48, generator=GEN).bfloat16()
    torch.testing.assert_close(layer(batched), F.linear(batched, w))


@pytest.mark.parametrize(
    "kernel,cls", [("aten", DenseLinear), pytest.param("onednn_bf16", PackedLinear, marks=needs_onednn)]
)
def test_make_dense_linear_builds_the_kind_asked(kernel, cls):
    layer = make_dense_linear(torch.randn(8, 16, generator=GEN), None, torch.bfloat16, kernel)
    assert isinstance(layer, cls)


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    root = make_tiny_llama(tmp_path_factory.mktemp("lin"))
    return ModelConfig.from_dir(root), load_weights(root, torch.float32)


@pytest.fixture(scope="module")
def tied_weights(tmp_path_factory):
    root = make_tiny_llama(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)
    return ModelConfig.from_dir(root), load_weights(root, torch.bfloat16)


def test_fp32_model_keeps_plain_torch_linears(tiny_weights):
    cfg, weights = tiny_weights
    model = LlamaModel(cfg, weights, dtype=torch.float32)
    assert model.linear_kernel == "aten"
    assert "MKL" in model.linear_kernel_reason
    assert all(isinstance(lin, DenseLinear) for lin in _linears(model))


@needs_onednn
def test_bf16_model_packs_every_linear_and_matches_plain_torch(tiny_weights):
    cfg, weights = tiny_weights
    plain = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="aten")
    packed = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="onednn_bf16")
    assert all(isinstance(lin, PackedLinear) for lin in _linears(packed))
    assert all(isinstance(lin, DenseLinear) for lin in _linears(plain))
    hidden = torch.randn(9, cfg.hidden_size, generator=GEN).bfloat16()
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden))
    assert packed.compute_logits(hidden).dtype == torch.float32


@needs_onednn
def test_tied_head_shares_the_embedding_under_every_kernel(tied_weights):
    cfg, weights = tied_weights
    plain = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="aten")
    packed = LlamaModel(cfg, weights, dtype=torch.bfloat16, linear_kernel="onednn_bf16")
    assert isinstance(packed.lm_head, DenseLinear)
    assert packed.lm_head.weight.data_ptr() == packed.embed.data_ptr()
    assert packed.nbytes == plain.nbytes
    hidden = torch.randn(4, cfg.hidden_size, generator=GEN).bfloat16()
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden))


@needs_onednn
def test_bf16_model_chooses_onednn_on_a_bf16_cpu(tiny_weights):
    if not read_cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("this CPU has no native bf16 dot products")
    cfg, weights = tiny_weights
    model = LlamaModel(cfg, weights, dtype=torch.bfloat16)
    assert model.linear_kernel == "onednn_bf16"
    assert "reordered once" in model.linear_kernel_reason


def _linears(model: LlamaModel) -> list:
    layers = [lin for layer in model.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    return [*layers, model.lm_head]


def test_runner_resolves_auto_dtype_as_the_pure_rule_says(tmp_path):
    from worker.model.runner import ModelRunner

    root = make_tiny_llama(tmp_path / "m")
    runner = ModelRunner(str(root), dtype="auto", num_blocks=8)
    expected, reason = resolve_auto_dtype("cpu", read_cpu_flags(), available_kernels())
    assert runner.dtype == getattr(torch, expected)
    assert runner.dtype_reason == reason
    assert runner.kv_cache.dtype == runner.dtype
    assert runner.model.compute_logits(torch.zeros(1, runner.config.hidden_size, dtype=runner.dtype)).dtype == (
        torch.float32
    )


def test_engine_config_accepts_auto_dtype():
    from worker.core.config import EngineConfig

    assert EngineConfig(dtype="auto").dtype == "auto"
