"""The native kernels' fp32 paths for CPUs without AVX-512 (AVX2 + FMA: Zen 1-3, Haswell to Comet Lake) compute
what torch computes, and the very bits the AVX-512 paths compute; ATEN_CPU_CAPABILITY caps the instructions they
use, as it caps torch's own. The extension picks its path once per process, so each cap runs in a child process
(the same cached build: its x86-64-v3 code serves every cap)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from worker.model.linear import PanelLinear
from worker.model.llama import rms_norm, stack_operands
from worker.model.quant import Int4Linear, make_linear
from worker.model.testing import Fp32PanelsOnly, causal_attention, fp8_grid, int4_grid, int16_rounding

QUANTIZED = ("int8", "fp8", "int4")  # the formats an fp32 model multiplies on the panels


def takes(quant: str, w: torch.Tensor) -> bool:
    """Whether `quant` takes this weight's shape (int4: groups of 32 inputs)."""
    return quant != "int4" or w.shape[1] % 32 == 0


def grid_steps(layer) -> torch.Tensor:
    """The steps of the int16 grid AVX2 hosts put an fp32 model's int4 or fp8 layer's weights on (`int4_grid`,
    `fp8_grid`), in the weights' units: fp64 [out, in]."""
    if isinstance(layer, Int4Linear):
        return int4_grid(layer.packed, layer.scales_zeros, layer.out_features)[1]
    return fp8_grid(layer.weight, layer.scale)[1]


# What the child computes with the capped extension: its report, and (where the panels run) the kernels' outputs.
def gated(module, w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of x by w's halves on the panels in one pass (`gated_linear`); None where they do not each
    fill whole panels."""
    if not module.gated_cols(w.shape[0]):
        return None
    return module.gated_linear(x, *stack_operands(PanelLinear(w, b, module)), w.shape[0])


CHILD = (
    f"import torch\nQUANTIZED = {QUANTIZED!r}\n"
    + inspect.getsource(takes)
    + "from worker.model.linear import PanelLinear\nfrom worker.model.llama import stack_operands\n"
    + inspect.getsource(gated)
    + """
import sys, torch
from worker.model.kernels import _load_module
from worker.model.linear import PanelLinear, available_kernels, choose_linear_kernel, read_cpu_flags
from worker.model.quant import Int4Linear, make_linear
module, why = _load_module()
if module is None:
    raise SystemExit(why)
data = torch.load(sys.argv[1])
out = {"isa": module.vector_isa(), "panels": module.f32_panels_ready(), "prompt": module.f32_attention_ready(),
       "fused": module.fused_ops_available("float32", 64, 64, 64),
       "linear": choose_linear_kernel("cpu", torch.float32, read_cpu_flags(), available_kernels(module))}
if out["panels"]:
    out["linears"] = [PanelLinear(w, b, module)(x) for w, b, x in data["linears"]]
    out["gated"] = [gated(module, w, b, x) for w, b, x in data["linears"]]
    out["quantized"] = {q: [make_linear(w, b, q, torch.float32, "panels_fp32", module)(x) if takes(q, w) else None
                            for w, b, x in data["linears"]] for q in QUANTIZED}
    h, d, w = data["norm"]
    out["norm"] = module.add_rms_norm(h.clone(), d, w, 1e-5)
    out["silu"] = module.silu_and_mul(data["gu"])
    x, cos, sin = data["rope"]
    x = x.clone()
    module.rope_(x, 3, 64, cos, sin)
    out["rope"] = x
    out["attention"] = []
    for q, k, v, start in data["attention"]:
        o = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
        module.f32_attention_(o, q, k, v, start, q.shape[2] ** -0.5)
        out["attention"].append(o)
    out["decode"] = {}
    for hd, (q, k, v, tables, lens) in data["decode"].items():
        fast = module.paged_decode(q, k, v, tables, lens, hd**-0.5)
        out["decode"][hd] = (module.paged_decode_path("float32", hd), fast, module.paged_decode_generic(q, k, v, tables, lens, hd**-0.5))
torch.save(out, sys.argv[2])
"""
)


def _inputs() -> dict:
    gen = torch.Generator().manual_seed(7)
    linears = []
    # rows: the 4-row blocks' tails (1-3) and an AVX-512 8-row block's; 300: a pass and a half with streaming
    # stores. Columns: a part panel (50), whole ones (96), 16k (the streamed rows).
    for rows, out_features, in_features, bias in [
        (1, 50, 32, True),
        (3, 96, 130, False),
        (4, 50, 64, False),
        (5, 96, 576, True),
        (8, 144, 576, False),
        (13, 50, 200, True),
        (300, 96, 64, False),
        (300, 112, 96, True),
    ]:
        w = torch.randn(out_features, in_features, generator=gen)
        b = torch.randn(out_features, generator=gen) if bias else None
        linears.append((w, b, torch.randn(rows, in_features, generator=gen)))
    decode = {}
    for hd in (64, 128):  # 6 sequences of 1..176 tokens (block tails, several blocks), 8 query heads on 2 KV heads
        k, v = torch.randn(2, 70, 16, 2, hd, generator=gen)
        tables = torch.randperm(70, generator=gen)[:66].view(6, 11)
        decode[hd] = (torch.randn(6, 8, hd, generator=gen), k, v, tables, torch.tensor([1, 9, 17, 90, 160, 176]))
    attention = []  # prompt chunks: 8-query blocks and tails, a causal offset, grouped heads, head dims 64 and 128
    for n, start, heads, kv_heads, hd in [(1, 0, 9, 3, 64), (13, 0, 9, 3, 64), (100, 7, 4, 2, 128), (61, 50, 8, 1, 64)]:
        k, v = torch.randn(2, start + n, kv_heads, hd, generator=gen)
        attention.append((torch.randn(n, heads, hd, generator=gen), k, v, start))
    return {
        "attention": attention,
        "decode": decode,
        "linears": linears,
        "norm": (
            torch.randn(7, 576, generator=gen) * 3,
            torch.randn(7, 576, generator=gen),
            torch.randn(576, generator=gen),
        ),
        "gu": torch.randn(5, 2 * 1536, generator=gen) * 4,
        "rope": (
            torch.randn(6, 4 * 64, generator=gen),
            torch.randn(6, 64, generator=gen),
            torch.randn(6, 64, generator=gen),
        ),
    }


def _run_capped(cap: str, tmp_path: Path) -> dict:
    """The CHILD's results with ATEN_CPU_CAPABILITY=cap."""
    data = _inputs()
    src, dst = tmp_path / f"in-{cap}.pt", tmp_path / f"out-{cap}.pt"
    torch.save(data, src)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(dst)], env=env, capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0 and "cannot be built" in proc.stderr + proc.stdout:
        pytest.skip(proc.stderr[-300:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"inputs": data, **torch.load(dst)}


@pytest.fixture(scope="module")
def capped_avx2(panels, tmp_path_factory):
    """The kernels capped at AVX2 (skipped where the CPU has neither AVX2 + FMA nor AVX-512)."""
    return _run_capped("avx2", tmp_path_factory.mktemp("avx2"))


def test_the_avx2_cap_runs_the_fp32_kernels_on_avx2(capped_avx2):
    assert capped_avx2["isa"] == "avx2"
    assert capped_avx2["panels"] and capped_avx2["fused"] and capped_avx2["prompt"]
    kind, reason = capped_avx2["linear"]  # the worker's log line names the path that runs, not the CPU's widest
    assert kind == "panels_fp32" and "AVX2 + FMA" in reason and "AVX512" not in reason, reason


def test_the_avx2_paths_compute_what_torch_computes(capped_avx2, fp32_code_panels):
    data = capped_avx2["inputs"]
    for (w, b, x), got in zip(data["linears"], capped_avx2["linears"], strict=True):
        exact = x.double() @ w.double().T + (0 if b is None else b.double())
        mkl = (F.linear(x, w, b).double() - exact).abs().max()
        assert (got.double() - exact).abs().max() <= 2 * mkl + 1e-6, (tuple(x.shape), tuple(w.shape))
    gated_ones = [
        (w, b, x, g) for (w, b, x), g in zip(data["linears"], capped_avx2["gated"], strict=True) if g is not None
    ]
    assert gated_ones  # the table has gate+up shapes whose halves fill whole panels
    for w, b, x, got in gated_ones:
        gu = F.linear(x, w, b)
        want = F.silu(gu[:, : w.shape[0] // 2]) * gu[:, w.shape[0] // 2 :]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"gated {tuple(x.shape)} x {tuple(w.shape)}")
    for q in QUANTIZED:
        for (w, b, x), got in zip(data["linears"], capped_avx2["quantized"][q], strict=True):
            if not takes(q, w):
                continue
            layer = make_linear(w, b, q, torch.float32, "panels_fp32", fp32_code_panels)
            exact = x.double() @ layer.dequantize().double().T + (0 if b is None else b.double())
            bound = 1e-4 * exact.abs().max()
            if q in ("int4", "fp8"):  # AVX2's weights on their int16 grid: within 0.75 (fp8: 0.5) of a step of each
                bound = bound + 0.75 * (x.double().abs() @ grid_steps(layer).T)
            assert ((got.double() - exact).abs() <= bound).all(), (q, tuple(x.shape))
    h, d, w = data["norm"]
    got_h, got = capped_avx2["norm"]
    assert torch.equal(got_h, h + d)
    torch.testing.assert_close(got, rms_norm(h + d, w, 1e-5), rtol=1e-5, atol=1e-6)
    gu = data["gu"]
    torch.testing.assert_close(capped_avx2["silu"], F.silu(gu[:, :1536]) * gu[:, 1536:], rtol=1e-5, atol=1e-6)
    x, cos, sin = data["rope"]
    head = x[:, : 3 * 64].reshape(6, 3, 64)
    turned = head * cos[:, None] + torch.cat((head[..., 32:], head[..., :32]), -1) * sin[:, None]
    torch.testing.assert_close(capped_avx2["rope"][:, : 3 * 64], turned.reshape(6, -1), rtol=1e-5, atol=1e-6)
    assert torch.equal(capped_avx2["rope"][:, 3 * 64 :], x[:, 3 * 64 :])  # the heads past `heads` stay
    for (q, k, v, start), got in zip(data["attention"], capped_avx2["attention"], strict=True):
        want = causal_attention(q.double(), k.double(), v.double(), start, q.shape[2] ** -0.5)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=f"{tuple(q.shape)} from {start}")
    for hd, (path, fast, portable) in capped_avx2["decode"].items():
        assert path.startswith("avx2_fp32"), path
        torch.testing.assert_close(fast, portable, rtol=1e-5, atol=1e-6, msg=f"head dim {hd}")


def test_the_avx2_paths_give_the_avx512_paths_bits(capped_avx2, avx512):
    """Same sums in the same order: a worker's outputs do not depend on which of the two its CPU runs. Except the
    quantized layers, whose AVX2 paths multiply int16 activations (`kernels.py`, quantize_rows_i16): within half an
    int16 step of each input (its 64-input chunk's largest |x| / 32767) times its weights, and fp32's rounding;
    int4's and fp8's weights also on their int16 grid there (`int4_grid`, `fp8_grid`: within 0.75 and 0.5 of a step
    of each)."""
    data = capped_avx2["inputs"]
    for (w, b, x), got in zip(data["linears"], capped_avx2["linears"], strict=True):
        assert torch.equal(got, PanelLinear(w, b, avx512)(x)), (tuple(x.shape), tuple(w.shape))
    for (w, b, x), got in zip(data["linears"], capped_avx2["gated"], strict=True):
        if got is not None:
            assert torch.equal(got, gated(avx512, w, b, x)), ("gated", tuple(x.shape), tuple(w.shape))
    for q in QUANTIZED:
        for (w, b, x), got in zip(data["linears"], capped_avx2["quantized"][q], strict=True):
            if not takes(q, w):
                continue
            layer = make_linear(w, b, q, torch.float32, "panels_fp32", Fp32PanelsOnly(avx512))  # not the bf16 pairs
            wa = layer.dequantize().double().abs().t()
            rounding = int16_rounding(x, layer.dequantize()) + 4e-6 * (x.double().abs() @ wa)  # (and fp32's)
            if q in ("int4", "fp8"):
                rounding += 0.75 * (x.double().abs() @ grid_steps(layer).t())
            assert ((got.double() - layer(x).double()).abs() <= rounding).all(), (q, tuple(x.shape))
    h, d, w = data["norm"]
    for got, want in zip(capped_avx2["norm"], avx512.add_rms_norm(h.clone(), d, w, 1e-5), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(capped_avx2["silu"], avx512.silu_and_mul(data["gu"]))
    x, cos, sin = data["rope"]
    x = x.clone()
    avx512.rope_(x, 3, 64, cos, sin)
    assert torch.equal(capped_avx2["rope"], x)
    for (q, k, v, start), got in zip(data["attention"], capped_avx2["attention"], strict=True):
        want = torch.empty_like(got)
        avx512.f32_attention_(want, q, k, v, start, q.shape[2] ** -0.5)
        assert torch.equal(got, want), (tuple(q.shape), start)


def test_the_default_cap_turns_the_vector_kernels_off(panels, tmp_path):
    got = _run_capped("default", tmp_path)
    assert got["isa"] == "none"
    assert not (got["panels"] or got["prompt"] or got["fused"])
    assert got["linear"][0] == "aten", got["linear"]
