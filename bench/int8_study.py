"""Study for an `int8` variant (issue #16): the quality of W8A8 schemes on SmolLM2, and the speed of their parts.

Why a study and not a variant yet: W8A8 (int8 activations quantized per token at run time, int8 weights per output
channel, `torch._int_mm` on VNNI/AMX) has the fastest GEMM this CPU offers, but plain W8A8 misses the 0.95
teacher-forced agreement floor, and computing it from torch ops spends the GEMM's gain on quantizing and
dequantizing. This script measures both halves, so the next step (a fused kernel) starts from figures:

1. Quality (`worker.model.quality`, the canary's teacher-forced agreement and KL, `bench/quant.py`'s prompts) of
   fake-quantized linears (quantize then dequantize in fp32, so only the rounding differs):
   - `w8` weights only, `a8` activations only, `w8a8` both;
   - `w8a8_sq`: SmoothQuant (per input channel s = amax_x^0.5 / amax_w^0.5; x / s, w * s);
   - `w8a8_outN`: the N input channels with the largest calibrated activation range stay unquantized (a second,
     small GEMM on those channels; LLM.int8()-style, but the channels are fixed at load).
   Activation ranges are calibrated on texts that are not the measured prompts (`CALIBRATION`).
2. Speed, one decoder layer of SmolLM2's shapes (fused qkv, o, fused gate_up, down), M rows: fp32 as the engine
   runs it, `torch._int_mm` alone, and the whole W8A8 + 64 outlier channels path from torch ops.

    .venv/bin/python bench/int8_study.py                 # both parts; the last line is one JSON object
    .venv/bin/python bench/int8_study.py --skip-quality
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
from quant import PROMPTS

CALIBRATION = [
    "The printing press spread in the fifteenth century, when movable type changed how books were made and shared.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "Photosynthesis turns light into chemical energy stored in glucose, and releases oxygen as a by-product.",
    "Dear team, the quarterly report is attached. Revenue grew 12% while costs stayed flat; questions welcome.",
    "In 1969 Apollo 11 landed two astronauts on the Moon, and millions of people watched the broadcast live.",
    "Recipe: whisk two eggs with milk, add flour and a pinch of salt, then cook thin pancakes in a hot pan.",
]
LINEARS = ("qkv", "o_proj", "gate_up", "down")
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2's (out, in) of LINEARS
SCHEMES: dict[str, dict[str, object]] = {
    "w8": {"w": True},
    "a8": {"a": True},
    "w8a8": {"w": True, "a": True},
    "w8a8_sq": {"w": True, "a": True, "alpha": 0.5},
    "w8a8_out16": {"w": True, "a": True, "outliers": 16},
    "w8a8_out32": {"w": True, "a": True, "outliers": 32},
    "w8a8_out64": {"w": True, "a": True, "outliers": 64},
}


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (per token of an activation, per output channel of a weight): the int8 values and
    each row's scale (shape [..., 1]), `x ~= q * scale`."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def fake_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """`int8_rows` dequantized: x with only int8's rounding."""
    q, scale = int8_rows(x)
    return q.to(x.dtype) * scale


class _Recorder:
    """Wraps a linear and keeps the largest |x| seen per input channel."""

    def __init__(self, linear: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.linear = linear
        self.amax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        self.amax = seen if self.amax is None else torch.maximum(self.amax, seen)
        return self.linear(x)


class _FakeQuant:
    """A linear computing with int8-rounded weights and/or activations (see SCHEMES)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, amax: torch.Tensor, **scheme: object) -> None:
        w = weight.float()
        self.bias, self.act = bias, bool(scheme.get("a"))
        alpha = scheme.get("alpha")
        smooth = torch.ones(w.shape[1])
        if isinstance(alpha, float):
            smooth = amax.clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
        self.inv_smooth = 1 / smooth
        self.keep = torch.zeros(w.shape[1], dtype=torch.bool)
        outliers = scheme.get("outliers")
        if isinstance(outliers, int):
            self.keep[torch.topk(amax, outliers).indices] = True
        self.w = fake_int8_rows(w * smooth) if scheme.get("w") else w * smooth
        self.w_dense = w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        xs = torch.where(self.keep, 0.0, x2 * self.inv_smooth)
        y = (fake_int8_rows(xs) if self.act else xs) @ self.w.t()
        y = y + torch.where(self.keep, x2, 0.0) @ self.w_dense.t()
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def _weight(linear: object) -> torch.Tensor:
    """A dense layer's fp32 weight, whichever kernel holds it (packed panels only give theirs back unpacked)."""
    dequantize = getattr(linear, "dequantize", None)
    return dequantize() if dequantize is not None else linear.weight  # type: ignore[attr-defined]


def quality(tokens: int) -> dict[str, dict[str, float]]:
    from worker.model.quality import compare, reference
    from worker.model.runner import ModelRunner
    from worker.model.source import resolve_model_source

    path = str(resolve_model_source("bundled://smollm2-135m-instruct"))
    runner = ModelRunner(path, num_blocks=4)
    tok = runner.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    ref = reference(runner, [chat(p) for p in PROMPTS], max_tokens=tokens)
    layers = runner.model.layers
    dense = [{n: getattr(layer, n) for n in LINEARS} for layer in layers]
    recorders = [{n: _Recorder(d[n]) for n in LINEARS} for d in dense]

    def install(linears: list[dict[str, Callable[[torch.Tensor], torch.Tensor]]]) -> None:
        runner.model.decode_stack = None  # decode steps call the swapped linears from Python, not the panels
        for layer, chosen in zip(layers, linears, strict=True):
            for n in LINEARS:
                object.__setattr__(layer, n, chosen[n])  # DecoderLayer is frozen: a study may swap its linears

    install(recorders)  # type: ignore[arg-type]
    reference(runner, [chat(c) for c in CALIBRATION], max_tokens=8)
    rows: dict[str, dict[str, float]] = {}
    for name, scheme in SCHEMES.items():
        install(
            [
                {n: _FakeQuant(_weight(d[n]), d[n].bias, r[n].amax, **scheme) for n in LINEARS}  # type: ignore[arg-type]
                for d, r in zip(dense, recorders, strict=True)
            ]
        )
        report = compare(ref, runner)
        rows[name] = {"agreement": round(report.agreement, 4), "mean_kl": round(report.mean_kl, 5)}
        print(f"{name:12} agreement {report.agreement:.3f}  mean KL {report.mean_kl:.5f}", flush=True)
    return rows


def _time(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def _int_mm(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    m = xq.shape[0]
    if m > 16:
        return torch._int_mm(xq, wq)
    return torch._int_mm(torch.nn.functional.pad(xq, (0, 0, 0, 17 - m)), wq)[:m]  # _int_mm takes M > 16


class _W8A8:
    """W8A8 with 64 fixed outlier channels in bf16, from torch ops (what a fused kernel would replace)."""

    def __init__(self, w: torch.Tensor, outliers: torch.Tensor) -> None:
        self.mask = torch.ones(w.shape[1])
        self.mask[outliers] = 0
        self.idx = outliers
        wq, scale = int8_rows(w)
        self.sw = scale.squeeze(1)
        self.wq = wq.t().contiguous()
        self.wo = w[:, outliers].t().contiguous().bfloat16()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xm = x * self.mask
        sx = xm.abs().amax(1, keepdim=True).clamp_min_(1e-8).div_(127)
        y = _int_mm(xm.div_(sx).round_().to(torch.int8), self.wq).to(torch.float32).mul_(sx).mul_(self.sw)
        return y.add_(torch.mm(x[:, self.idx].bfloat16(), self.wo))


def speed(rows_list: list[int], repeat: int) -> list[dict[str, float]]:
    from worker.model.linear import make_dense_linear

    torch.manual_seed(0)
    out = []
    print(f"{'M':>5} {'fp32 ms':>9} {'_int_mm ms':>11} {'x fp32':>7} {'W8A8+out64 ms':>14} {'x fp32':>7}")
    for m in rows_list:
        dense = int_mm = whole = 0.0
        for n_out, k in SHAPES:
            w, x = torch.randn(n_out, k) * 0.05, torch.randn(m, k)
            fp32 = make_dense_linear(w, None, torch.float32, "aten")
            w8a8 = _W8A8(w, torch.randperm(k)[:64])
            xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            dense += _time(lambda: fp32(x), repeat)  # noqa: B023 (timed at once, inside the loop)
            int_mm += _time(lambda: _int_mm(xq, w8a8.wq), repeat)  # noqa: B023
            whole += _time(lambda: w8a8(x), repeat)  # noqa: B023
        out.append({"rows": m, "fp32_ms": 1e3 * dense, "int_mm_ms": 1e3 * int_mm, "w8a8_out64_ms": 1e3 * whole})
        print(
            f"{m:5d} {1e3 * dense:9.3f} {1e3 * int_mm:11.3f} {dense / int_mm:7.2f} {1e3 * whole:14.3f} "
            f"{dense / whole:7.2f}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24, help="teacher-forced positions per prompt")
    ap.add_argument("--rows", default="1,16,64,256,512", help="comma-separated M of the speed part")
    ap.add_argument("--repeat", type=int, default=30, help="timed calls per measurement")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    report: dict[str, object] = {"threads": torch.get_num_threads()}
    if not args.skip_quality:
        report["quality"] = quality(args.tokens)
    if not args.skip_speed:
        report["speed"] = speed([int(r) for r in args.rows.split(",")], args.repeat)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
