"""Linear-layer kernels on this CPU: which library multiplies SmolLM2-135M's linear shapes fastest.

Why it exists: the engine's speed on CPU is set by its linear layers, and torch offers several paths for the same
`y = x @ W.T` whose speed differs by integer factors depending on the CPU's units (AVX512, AVX512-BF16, VNNI,
AMX). This probe measures them on the shapes the engine runs (one decoder layer's fused projections, and the
output head) for decode- and prefill-sized row counts, so `worker/model/linear.py` chooses from figures rather
than folklore. Paths:

* `fp32_mkl`: `F.linear` in fp32 (what torch does by default: MKL sgemm);
* `fp32_mkl_packed`: `torch.ops.mkl._mkl_linear` with the weight packed once (MKL packed sgemm);
* `fp32_onednn`: `torch.ops.mkldnn._linear_pointwise` with the weight reordered once for oneDNN;
* `bf16_aten`: `F.linear` in bf16 (what a bf16 model does today);
* `bf16_onednn`: `_linear_pointwise` in bf16 with the weight reordered once (AVX512-BF16 / AMX);
* `int8_dyn`: `quantize_dynamic` (W8A8, activations quantized per call; x86 engine = fbgemm/oneDNN, VNNI);
* `int8_wo_bf16`: `aten._weight_int8pack_mm` (int8 weights, bf16 activations);
* `int4_wo_bf16`: `aten._weight_int4pack_mm_for_cpu` (int4 groups of 32, bf16 activations: today's int4 path);
* `fp8_wo_fp32`: the engine's `quant.Fp8Linear` (fp8 weights re-biased to fp16 per call, fp32 activations);
* `int8_ours_bf16`, `fp8_ours_bf16`, `int4_ours_bf16`: the engine's quantized layers for a bf16 model (`quant.make_linear`
  with the kernel the engine picks: AMX up to 256 rows on CPUs with AMX, else the GEMV up to 8; dequantized tiles
  past those);
* `int8_ours_fp32`, `fp8_ours_fp32`, `int4_ours_fp32`: the same for an fp32 model (int8 on the panels where the
  dense linears run on them; bf16 products on AMX where the CPU has it; else torch's ops);
* `bf16_amx`: the engine's `linear.AmxLinear` on CPUs with AMX (our kernel up to `AMX_MAX_ROWS` rows, F.linear past);
* `fp32_panels`, `bf16_panels`: the engine's `linear.PanelLinear` (fp32 on AVX2 + FMA or AVX-512; bf16 on
  AVX512-BF16, in panels of input pairs).

`--layers N` builds N copies of each group with their own weights and times a pass over all of them, as a decode
step walks a model's layers: the weights then stream from DRAM instead of sitting in cache (30 SmolLM2 layers are
212 MB in bf16), which is what decode-sized batches are bound by. The table in `worker/model/linear.py` is

    .venv/bin/python bench/linear_kernels.py --layers 30 --groups layer --paths bf16_amx,bf16_onednn,bf16_aten \
        --rows 1,16,64,128,256,512,1024

Prints GFLOP/s (2*M*N*K per call) per (path, M) for the layer (fused projections as the engine runs them, and
unfused: q/k/v and gate/up as separate calls) and for the head, the ratio to `fp32_mkl`, what fusing saves per
path (unfused time / fused time), and as its LAST line one JSON object. Each cell is the best of a few short
timing rounds (`--rounds`, ~0.1 s each: raise it on a shared machine), so a full run takes about a minute.

    .venv/bin/python bench/linear_kernels.py
    .venv/bin/python bench/linear_kernels.py --rows 1,64 --paths fp32_mkl,bf16_onednn
    .venv/bin/python bench/linear_kernels.py --groups layer,layer_unfused   # what fusing QKV and gate+up saves
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN, INTER, VOCAB, Q, KV = 576, 1536, 49152, 576, 192
# [N, K] of one decoder layer's linears as the engine runs them (QKV and gate+up fused), of the same layer with
# every projection on its own (what fusing saves: `layer` vs `layer_unfused`, same FLOPs), and of the output head.
GROUPS: dict[str, list[tuple[int, int]]] = {
    "layer": [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)],
    "layer_unfused": [
        (Q, HIDDEN),
        (KV, HIDDEN),
        (KV, HIDDEN),
        (HIDDEN, Q),
        (INTER, HIDDEN),
        (INTER, HIDDEN),
        (HIDDEN, INTER),
    ],
    "head": [(VOCAB, HIDDEN)],
}
ROWS = (1, 16, 64, 256, 512)

Call = Callable[[torch.Tensor], torch.Tensor]


def _int8_dyn(w: torch.Tensor) -> tuple[Call, torch.dtype]:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
    return q, torch.float32


def _int8_wo(w: torch.Tensor) -> tuple[Call, torch.dtype]:
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    s = scale.to(torch.bfloat16)
    return (lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s)), torch.bfloat16


def _int4_wo(w: torch.Tensor) -> tuple[Call, torch.dtype]:
    n, k = w.shape
    g = 32
    wg = w.view(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1).contiguous().to(torch.bfloat16)
    return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)), torch.bfloat16


def _fp8_wo(w: torch.Tensor) -> tuple[Call, torch.dtype]:
    from worker.model.quant import Fp8Linear

    return Fp8Linear(w, None, torch.float32), torch.float32


def _ours(w: torch.Tensor, quantization: str, dtype: torch.dtype) -> tuple[Call, torch.dtype]:
    from worker.model.kernels import load_fused_ops, load_quant_amx_ops
    from worker.model.linear import available_kernels, choose_linear_kernel, read_cpu_flags
    from worker.model.quant import make_linear

    native = load_fused_ops(dtype, HIDDEN, INTER, 64)[0]
    amx = load_quant_amx_ops(dtype, quantization, HIDDEN, INTER, 64)[0]
    kernel = choose_linear_kernel("cpu", dtype, read_cpu_flags(), available_kernels(native))[0]
    return make_linear(w, None, quantization, dtype, kernel, native, amx), dtype


def _onednn(w: torch.Tensor, dtype: torch.dtype) -> tuple[Call, torch.dtype]:
    packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
    return (lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")), dtype


def _mkl_packed(w: torch.Tensor) -> tuple[Call, torch.dtype]:
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 64)
    return (lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, 64)), torch.float32


def _aten(w: torch.Tensor, dtype: torch.dtype) -> tuple[Call, torch.dtype]:
    wd = w.to(dtype)
    return (lambda x: F.linear(x, wd)), dtype


def _amx(w: torch.Tensor) -> tuple[Call, torch.dtype]:
    from worker.model.kernels import _load_module
    from worker.model.linear import AmxLinear

    module, why = _load_module()
    if module is None or not module.amx_linear_ready():
        raise RuntimeError(why or "this CPU (or its kernel) offers no AMX-BF16")
    return AmxLinear(w.to(torch.bfloat16), None, module), torch.bfloat16


def _panels(w: torch.Tensor, dtype: torch.dtype) -> tuple[Call, torch.dtype]:
    from worker.model.kernels import _load_module
    from worker.model.linear import PanelLinear

    module, why = _load_module()
    ready = module is not None and (module.f32_panels_ready() if dtype == torch.float32 else module.bf16_panels_ready())
    if not ready:
        raise RuntimeError(why or f"this CPU offers no {'AVX2 + FMA' if dtype == torch.float32 else 'AVX512-BF16'}")
    return PanelLinear(w.to(dtype), None, module), dtype


PATHS: dict[str, Callable[[torch.Tensor], tuple[Call, torch.dtype]]] = {
    "fp32_mkl": lambda w: _aten(w, torch.float32),
    "fp32_mkl_packed": _mkl_packed,
    "fp32_onednn": lambda w: _onednn(w, torch.float32),
    "bf16_aten": lambda w: _aten(w, torch.bfloat16),
    "bf16_onednn": lambda w: _onednn(w, torch.bfloat16),
    "int8_dyn": _int8_dyn,
    "int8_wo_bf16": _int8_wo,
    "int4_wo_bf16": _int4_wo,
    "fp8_wo_fp32": _fp8_wo,
    "int8_ours_bf16": lambda w: _ours(w, "int8", torch.bfloat16),
    "fp8_ours_bf16": lambda w: _ours(w, "fp8", torch.bfloat16),
    "int4_ours_bf16": lambda w: _ours(w, "int4", torch.bfloat16),
    "int8_ours_fp32": lambda w: _ours(w, "int8", torch.float32),
    "fp8_ours_fp32": lambda w: _ours(w, "fp8", torch.float32),
    "int4_ours_fp32": lambda w: _ours(w, "int4", torch.float32),
    "bf16_amx": _amx,
    "fp32_panels": lambda w: _panels(w, torch.float32),
    "bf16_panels": lambda w: _panels(w, torch.bfloat16),
}


def time_calls(calls: list[tuple[Call, torch.Tensor]], rounds: int = 3, round_s: float = 0.1) -> float:
    """Best seconds for one pass over `calls`, over `rounds` rounds of about `round_s` each (bounded count)."""
    for fn, x in calls:
        fn(x)
    best = float("inf")
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        while n < 10_000:
            for fn, x in calls:
                fn(x)
            n += 1
            if time.perf_counter() - start >= round_s:
                break
        best = min(best, (time.perf_counter() - start) / n)
    return best


def measure(
    paths: list[str], rows: list[int], groups: list[str], rounds: int = 3, layers: int = 1
) -> dict[str, dict[str, dict[int, float]]]:
    """GFLOP/s per group, path and row count; `layers` copies of each group, each with its own weights."""
    torch.manual_seed(0)
    out: dict[str, dict[str, dict[int, float]]] = {}
    for group in groups:
        shapes = GROUPS[group] * layers
        weights = [torch.randn(n, k) * k**-0.5 for n, k in shapes]
        out[group] = {}
        for path in paths:
            try:
                built = [PATHS[path](w) for w in weights]
            except (RuntimeError, NotImplementedError) as e:
                print(f"{group:5s} {path:16s} unavailable: {str(e).splitlines()[0][:100]}")
                continue
            out[group][path] = {}
            for m in rows:
                calls = [(fn, torch.randn(m, k).to(dt)) for (fn, dt), (_, k) in zip(built, shapes)]
                secs = time_calls(calls, rounds)
                flops = sum(2 * m * n * k for n, k in shapes)
                out[group][path][m] = flops / secs / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts M")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated: {','.join(PATHS)}")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds per cell (best is kept)")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated: {','.join(GROUPS)}")
    ap.add_argument("--layers", type=int, default=1, help="copies of each group with their own weights (streamed)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        ap.error(f"unknown paths {unknown}; choose from {list(PATHS)}")
    groups = [g for g in args.groups.split(",") if g]
    if any(g not in GROUPS for g in groups):
        ap.error(f"unknown groups {[g for g in groups if g not in GROUPS]}; choose from {list(GROUPS)}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
        f"{torch.backends.cpu.get_cpu_capability()}, mkldnn bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}"
    )
    if args.layers < 1:
        ap.error("--layers must be at least 1")
    res = measure(paths, rows, groups, args.rounds, args.layers)
    for group, by_path in res.items():
        base = by_path.get("fp32_mkl", {})
        print(f"\n{group}: GFLOP/s (x fp32_mkl)")
        print(f"{'path':16s}" + "".join(f"{'M=' + str(m):>16s}" for m in rows))
        for path, by_m in by_path.items():
            cells = [f"{by_m[m]:7.1f} ({by_m[m] / base[m]:4.2f}x)" if m in base else f"{by_m[m]:7.1f}" for m in rows]
            print(f"{path:16s}" + "".join(f"{c:>16s}" for c in cells))
    fused, unfused = res.get("layer", {}), res.get("layer_unfused", {})
    if fused and unfused:
        print("\nfused projections: layer time unfused / fused (same FLOPs; >1 means fusing is faster)")
        print(f"{'path':16s}" + "".join(f"{'M=' + str(m):>16s}" for m in rows))
        for path in [p for p in fused if p in unfused]:
            print(f"{path:16s}" + "".join(f"{fused[path][m] / unfused[path][m]:16.2f}" for m in rows))
    print(
        json.dumps(
            {g: {p: {str(m): round(v, 1) for m, v in bm.items()} for p, bm in bp.items()} for g, bp in res.items()}
        )
    )


if __name__ == "__main__":
    main()
