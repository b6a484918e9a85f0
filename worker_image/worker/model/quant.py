"""Linear layers: dense, int8, fp8 and int4 weight-only, behind one callable interface.

Why these kernels (measured on the 2-core CPU machines with torch 2.13.0+cpu; `bench/quant.py` prints memory and
quality, this docstring records the speed probe for SmolLM2's linear shapes, summed over one layer):

* fp8 (`float8_e4m3fn` weights, one fp32 scale per output channel). `torch._scaled_mm` runs on CPU but only with
  fp8 *activations* too (that is W8A8, not weight-only) and was the slowest option (~12 ms/layer at any batch
  size). A plain `w.to(float32)` cast of fp8 is also slow (~4 ms for a 3072x576 matrix). Fastest: re-bias the
  fp8 bit pattern into an fp16 bit pattern with integer ops (exact for every finite e4m3 value, subnormals
  included), convert to the activation dtype, matmul, and multiply the output columns by `scale * 2**8`
  (the exponent bias difference is folded into the scale). Costs ~0.6 ns per weight per call on top of the matmul.
* int4 (group-wise asymmetric, 16 levels, groups of 32 (else 64/128) along the input dim). torch's
  `_weight_int4pack_mm_for_cpu` is *very* slow with fp32 activations (230 ms/layer at 64 rows: a scalar path)
  but with bf16 activations it matches or beats a dense fp32 matmul for decode-sized batches (0.14 vs 0.23 ms
  at 1 row, 3.4 vs 2.0 ms at 64) and is ~2x slower for long prefill chunks. Dequantize-then-matmul costs
  ~3 ms/layer extra at every size. We use the kernel, casting activations to bf16 and the result back: the
  bf16 rounding of activations is far below int4's own error, and the weights stay packed (0.5 byte/weight +
  bf16 scales/zeros), which is the sure win on CPU.

Both formats quantize per output row (fp8: one scale per row; int4: groups along the input dim of a row), so
quantizing the fused q/k/v or gate/up weight (llama.py concatenates them along the output dim once at load) is
exactly the concatenation of the per-projection layers: fusing changes no weight (tests/worker_model/
test_model_fused.py). A per-tensor scale would not have that property.

The dequantization conventions are tested against a reference: fp8 `w = fp8 * scale`; int4
`w = (q - 8) * scale + zero` (torch's tinygemm convention, `zero` in the float domain).

Measured with `bench/quant.py` on SmolLM2-135M (8 chat prompts x 16 teacher-forced positions; the embedding /
tied output head stays dense):

    variant  weights MB  linears MB  agreement  mean KL
    fp32          538.1       424.7      1.000  0.00000
    bf16          269.0       212.3      0.992  0.00107
    fp8           220.2       106.8      0.953  0.02226
    int4          179.7        66.4      0.984  0.00037

int4 beats fp8 here only because SmolLM2's own weights are Q4_1 (4-bit, groups of 32): int4 with 32-groups
lands almost exactly on that grid. Speed on this CPU (one decode step, 64 requests): fp32 0.39 s, int4 0.49 s,
fp8 0.61 s; a 512-token prefill: fp32 1.0 s, fp8 1.3 s, int4 2.1 s. The variants trade speed for memory here.

**With bf16 activations** (a CR's `dtype: auto` on CPUs with AVX512-BF16, where the bf16 GEMM units do the work)
the variants pay for themselves, on the extension's kernels (kernels.py; without it, torch's paths above):
* batches of more than 8 rows dequantize the weight to bf16 in L2-sized tiles, one AVX512 pass each
  (`fp8_to_bf16`: bit for bit torch's `fp8_to_fp16(w).to(bf16)`, 0.09 vs 1.59 ms for a 3072x576 weight;
  `int4_to_bf16`: torch's int4 weights to the bit, from our own nibble layout, `pack_int4_rows`) and run a bf16
  GEMM;
* 1-8 rows (the decode of a small batch) take a GEMV that dequantizes each weight row in registers
  (`fp8_gemv_bf16`, `int4_gemv_bf16`): 1 or 0.5 byte read a weight and no per-call weight reorder.
Per SmolLM2 layer, fp32 -> fp8-bf16 / int4-bf16: 1 row 0.29 -> 0.21-0.23 / 0.27-0.33 ms; 64 rows 1.7 -> 1.2 / 1.1;
2048 rows 40 -> 9 / 7 (torch's int4 kernel, by contrast: 2.6 at 64 rows, 81 at 2048: it has no AMX path).
One run of `bench/engine.py --variants fp32,fp8-bf16,int4-bf16 --skip hf_static,ours_seq1,vllm` on workload W
(2-core Xeon with AMX): fp32 163.5 tok/s, fp8-bf16 299.6 (1.83x), int4-bf16 333.4 (2.04x). Quality
(`bench/quant.py --tokens 16`): fp8-bf16 agreement 0.938, KL 0.0211 (fp8 with fp32 activations: 0.953, 0.0223);
int4-bf16 0.969, KL 0.0011 (bf16 alone: 0.984, 0.0012).

**On CPUs with AMX** (stop 29) batches of 1-256 rows multiply the quantized weight on our AMX kernel
(`amx_linear_fp8` / `amx_linear_int4`, `direct_rows` decides): each thread dequantizes its next 32 weight rows into
its own scratch and multiplies them from cache, so the weight streams at 1 or ~0.56 bytes a weight and no bf16 copy
goes through L2. fp8's dequantization moved to 16-bit integer ops (`fp8_bf16_32`: 2x fewer instructions). What bounds
these variants on this CPU is the dequantization's compute, not the memory: per 30 SmolLM2 layers, 12 (fp8) and 10
(int4) ms at one row, where bf16 streams its 212 MB in ~8.6. `bench/engine.py --variants fp8-bf16,int4-bf16 --skip
hf_static,ours_seq1,vllm`, one run each side: fp8-bf16 423 -> 590 tok/s, int4-bf16 480 -> 632 (bf16: 682).
An fp32 model's fp8 and int4 linears take the same kernels, their activations rounded to bf16 on the way in
(`Bf16Inside`; torch's int4 kernel rounds them so inside too): with fp32 products they ran W at 0.66x (fp8) and
0.75x (int4) the fp32 model's tok/s.
Agreement at stop 29 (`bench/quant.py`, 8 prompts): with 24 positions each, fp8 0.948, fp8-bf16 0.943-0.953 (a change
of summation order flips one token of 192 either way), int4 0.979-0.990; with 48 (`--tokens 48`), fp8 0.932-0.938
(0.932 with its products in bf16), fp8-bf16 0.938, int4 0.990, int4-bf16 0.987, bf16 0.987. So e4m3 with one scale per row sits near 0.94 on SmolLM2, under the 0.95 floor: its 3
mantissa bits give every weight ~2.6% relative error whatever the scale, and only a calibrated rounding (GPTQ-style)
or higher precision for some layers would move it. Stop 31 measured the second (each layer's fp8 rounding alone,
fp32 products, 24 positions): the last layer carries 23% of the KL (0.0046 of 0.0199), no other more than 5%;
keeping the last, first and middle layers unquantized brings the KL to 0.0130 but the agreement stays
0.938-0.948, so that is not adopted. GPTQ-style rounding (each column's error pushed onto the columns after it
through the inverse Hessian of 1,610 calibration rows: the model's own answers to 8 prompts unlike the evaluation's)
took the KL 0.0199 -> 0.0178 and the agreement 0.948 -> 0.938: not adopted either. SmolLM2's weights were 4-bit
(Q4_1, groups of 32) before they were fp32, which int4 with 32-groups reproduces and e4m3 cannot.
Stop 51 tried two more, each emulated (the rounded weights back in fp32, /tmp scripts) and scored by `bench/quant.py`'s
192 positions: each row's scale chosen among 32 in one binade below the largest weight's for the least squared
error (e4m3's grid shifts with a scale that is not a power of two): KL 0.0200 -> 0.0178, agreement 0.948 -> 0.927;
and the input channels with the largest activations (root mean square over 8 other prompts' answers) kept exact,
as LLM.int8() keeps its outliers: 0.5% of them KL 0.0160, agreement 0.932; 1%: 0.0157, 0.938; 2%: 0.0129, 0.938;
5%: 0.0101, 0.953. The error is spread over all channels, not held by a few, and the agreement moves by a position
or two either way whatever the KL does: 182 of 192 has the 95% interval 0.907-0.971 (quality.py), and 13 of the
reference's positions have their top two tokens within 0.1 nats, 48 within 0.5 (`bench/quant.py`, stop 52).
Stop 53 tried bias correction (each linear's output shifted by -(w_fp8 - w) @ E[x], E[x] its input's mean over 8
other prompts and their answers, 563 rows; emulated as stop 51's, which reproduced fp8's 0.948 / 0.0199 to the
digit): KL 0.0199 -> 0.0227, agreement 0.948 -> 0.927 (int8: 0.0032 -> 0.0034, 0.984 -> 0.964). The rounding error
has no mean to take out.

**int8** (stop 32): weight-only, one symmetric int8 per weight (-127..127) and one fp32 scale per output row, so
fusing stays exact as for fp8. Each weight is within half a step (its row's largest |w| / 254) of the original, where
e4m3's 3 mantissa bits leave ~2.6% of every weight: `bench/quant.py` (24 positions) gives int8 agreement 0.974, KL
0.0034 and int8-bf16 0.974, KL 0.0040 (fp8 0.943 / 0.0206; bf16 alone 0.984), at fp8's memory (106.8 MB of linears).
Its codes are integers bf16 holds exactly, so its kernels are fp8's (`kernels.py`, one template per kernel over
`ByteFormat`) with a cheaper conversion (int8 -> fp32 -> bf16, ~0.16 instructions a weight against fp8's ~0.35).
Speed is fp8's within the noise: the conversion is not what bounded these kernels (engine-performance.md
says what did: an unaligned scratch strip, dequantizing between multiplications, and the per-row scales applied in a
pass of torch's over the output, where the kernels now apply them). W, one run of `bench/engine.py --variants
fp32,bf16,int8,fp8,int4,int8-bf16,fp8-bf16,int4-bf16 --skip hf_static,ours_seq1,vllm` (on a day this machine ran
~20% slower than stop 31's): fp32 223.8 tok/s, int8 389.1 (1.74x our fp32), fp8 385.4, int4 385.9; bf16 562.4,
int8-bf16 582.5 (1.04x our bf16, at 0.61x its weights' memory), fp8-bf16 543.5, int4-bf16 559.5.
So on this checkpoint int8 is the one-byte format to choose; fp8 stays for checkpoints (and GPUs) made for it.

**fp32 models on the panels** (stop 34): where the dense linears run on the fp32 panels (`linear.PanelLinear`:
CPUs with AVX-512, or AVX2 + FMA, and no AMX) the quantized layers keep their codes in the same panel layout and
the extension multiplies them there at every batch size: int8 codes widened to fp32 in registers, fp8 through an
fp16 bit pattern and F16C (`panel_linear_i8` / `panel_linear_fp8`), one scale per output column applied to the sums;
passes of 32 rows or more widen each panel once into an fp32 scratch first (the same values, so the same sums).
int4 (`panel_linear_int4`) always widens a panel first: code * scale + offset with fp32 scales and offsets per
group of 32 (`pack_int4_panels`; 0.75 byte a weight, not torch's 0.625). Before, these layers ran on torch's ops
(a dequantized copy per call, then MKL; int4 on torch's int4 kernel) and W ran at 0.60-0.69x the fp32 model.
Per 30 streamed SmolLM2 layers on an AMD Zen 3 (AVX2 only), GFLOP/s (`bench/linear_kernels.py --layers 30 --groups
layer --paths fp32_panels,int8_ours_fp32,fp8_ours_fp32,int4_ours_fp32 --rows 1,4,16,32,64,256,2048`), one run:

    rows                 1      4     16     32     64    256   2048
    fp32 panels        4.5   14.6   47.8   96.8    128    113    146
    int8 panels       24.9   78.5    132    127    124    124    137
    fp8 panels        18.8   56.9   80.0   99.1    107   93.7    131
    int4 panels       12.7   42.4   80.4   91.9   97.9    102    118

(int4 at one row reads 17.0-17.3 since its widening walks group by group: a division per input cost ~20%), and W
(`bench/engine.py --variants fp32,int8,fp8,int4 --skip hf_static,ours_seq1,vllm`, one run): fp32 84.5 tok/s,
int8 86.3 (1.02x), fp8 88.0 (1.04x), int4 92.2 (1.09x; it was 0.60x on torch's int4 kernel; 1.17x in a later run
with the faster widening). Agreement
(`bench/quant.py`, 24 positions): int8 0.984, fp8 0.948, int4 1.000 with KL under 5e-6: the fp32 scales and offsets
give back SmolLM2's weights bit for bit (they were 4-bit, groups of 32, before they were fp32; torch's bf16 group
scales cost that int4 0.984). A checkpoint not made on that grid will not do so well.

**On the bf16 pair panels** (stop 42): on CPUs with AVX512-BF16 and no AMX (a Zen 5) the dense bf16 linears run on
`linear.PanelLinear`'s pair panels, and int8 and fp8 codes go into the same layout (`pack_pair_panels`):
`panel_linear_bf16_codes` widens each panel's codes to bf16 once per pass of rows (exact for both formats) into a
per-thread scratch and multiplies it there, the scales applied to the fp32 sums. A bf16 model's layers take their
activations as they are; an fp32 model's are rounded to bf16 for it, as on AMX (`Bf16Inside`), which twice the
fp32 FMA's work per instruction pays for. Over 30 streamed SmolLM2 layers on that Zen 5, int8 codes ran 1.14-1.51x
the dense bf16 panels at 1-16 rows and 0.91-0.99x from 32 (the widening), ~1.9x the fp32 panels at 64. W (`bench/
engine_parts.py`, one run each): the fp32 model's int8 14.6 s against fp32's 22.1 (the fp32 code panels ran it at
~1.0x); the bf16 model's int8 11.5 s against dense bf16's 11.7. Agreement (`bench/quant.py`): int8 0.984 and fp8
0.948 as on the fp32 panels; int8-bf16 0.969, fp8-bf16 0.943. int4 keeps its fp32 int4 panels and
`panel_linear_bf16_int4` widens each to fp32 (code * scale + offset) and rounds it to bf16 pairs in registers,
once per pass: 0.96-1.0x the dense bf16 panels at 1-16 rows, 0.75-0.83x at 32-64, 0.97x past (through an fp32
scratch first it ran 0.64-0.81x at 1-32 rows), ~1.4-1.6x the fp32 panels at 32-64 rows; W fp32-model int4 20.2 ->
16.2-16.4 s (agreement 1.000 -> 0.995: its weights are now rounded to bf16), bf16-model int4 17.1 -> 12.3 s (0.984
-> 0.974; it keeps fp32 group scales now, 0.75 byte a weight against the GEMV layout's 0.625).

**int8 on AVX2 hosts: int16 activations** (stop 56). Without AVX-512 (a Zen 3) the fp32 panels already run near
the FMA units' peak from 16 rows up, so int8 codes widened to fp32 could only tie them there (0.96x fp32 on W at
stop 55). AVX2's integer multiply-add (vpmaddwd, then vpaddd) runs beside the FMA pipes at ~1.5x their
multiply-adds a cycle, so `panel_linear_i8` on such hosts rounds x to int16 per row and per 64-input chunk (the
chunk's largest |x| / 32767 a step, half to even), sums each chunk's products exactly in int32 and adds chunk sum x
step into fp32 totals (`kernels.py`, quantize_rows_i16 / panel_pass_i16_avx2; `panel_codes_int16` says where, and the
worker's log names it). Each input moves by at most 2**-16 of its chunk's largest |x|, against the int8 weights'
2**-8 of their row's largest |w|: agreement stays 0.984 (189/192), KL 0.0032 (`bench/quant.py`). Integer sums do
not depend on their order, so a row's output still does not depend on its batch; it does differ from an AVX-512
host's (which keeps fp32 activations) by that rounding. Layers with an odd number of inputs keep fp32 activations.
Over 30 streamed SmolLM2 layers on the Zen 3, against the fp32 panels in the same rounds (`bench/panel_ab.py
--paths i8 --against f32 --rounds 7`, a slow hour): 1 row 2.24x, 8: 1.25, 16: 1.21, 32: 1.17, 64: 1.05, 256:
1.08, 2048: 1.03. W (`bench/engine.py`, 4 rounds): int8 1.08x our fp32 (every round 1.00-1.11), where it read
0.96 before. W8A16 is what this is; W8A8 is not (below).

**int4 on AVX2 hosts: int16 activations, weights on an int16 grid** (stop 58). int4 widened to fp32 could at best
tie the fp32 panels from 16 rows (W: 0.97-1.00x our fp32 at stops 56-57). So where int8 takes its int16 path,
`panel_linear_int4` (an even group size) rounds x as int8 does and widens each panel once per pass into int16
values on a grid of its own per column and 64-input chunk, which int8's kernel multiplies (`kernels.py`,
I4GridPanels): the step an upper bound of the chunk's largest |weight| (max(|offset|, |offset + 15 scale|) over
its groups) / 1023, each weight (code * S + O + 16) >> 5 in 16-bit integers, S and O its group's scale and offset
in 1/32 steps: within 0.75 of a step of the weight (`testing.int4_grid` computes the same values), so a chunk's
int32 sum stays exact and one flush serves 64 inputs. The path built first kept the weights exact (the codes as
int16, each group's int32 sums flushed with its scale and offset): its flush every 32 inputs held it to 0.94-0.95x
the fp32 panels from 256 rows, which the prompt chunks that fill most of W's time run at. Against it, the grid
read 0.89 / 1.02 / 1.09 / 1.15 / 1.20 / 1.19 / 1.22 at 1 / 8 / 16 / 32 / 64 / 256 / 2048 rows, and against the
fp32 panels 2.28 / 1.36 / 1.14 / 1.07 / 0.93 / 1.10 / 1.14 (`bench/panel_ab.py --paths int4 --against f32
--rounds 7`, Zen 3; 64 rows' rounds 0.84-1.24). Agreement (`bench/quant.py`): int4 1.000 (192/192), KL 0.00002
(it was < 5e-6 with the exact weights). A row's output does not depend on its batch (the grid depends on the
weights only); it differs from an AVX-512 host's (fp32 x, exact weights) by the two roundings.

**fp8 on AVX2 hosts: int16 activations, weights on an int16 grid** (stop 59). fp8 widened to fp32 read 0.95-0.96x
our fp32 on W (stops 57-58), and e4m3 values need 18-bit integers to be exact. So where int8 takes its int16 path
(`panel_codes_int16`), `panel_linear_fp8` rounds x as int8 does and puts each panel, once per pass, on an int16
grid per column and 64-input chunk (`kernels.py`, F8GridPanels): the step the chunk's largest |value| / 1023, each
value rounded to the nearest step (`testing.fp8_grid` computes the same values), within half a step: ~1/2046 of
the chunk's largest weight, where e4m3 itself moves a weight by up to 1/16 of its own size. Agreement
(`bench/quant.py`): 0.948 (182/192) as before, KL 0.0200 (0.0199 with the exact values). Against the path it
replaced (`bench/panel_ab.py --base 5dbafe9 --paths fp8`, 5 rounds, Zen 3): 1 / 2 / 4 rows 0.70 / 0.69 / 0.80 (a
pass's widening weighs on a few rows), 8-16 rows 1.01, 32-64 rows 1.09-1.10, 256 rows 1.16, 2048 rows 1.20; W
(`bench/engine.py --variants fp32,fp8 --skip hf_static,ours_seq1,vllm --rounds 3`) 1.15x our fp32 (rounds 1.15,
1.16, 0.99), where it read 0.96. A row's output does not depend on its batch; layers with an odd number of inputs
keep the exact values and fp32 x.

W8A8 (activations in int8 too) is not a variant: `bench/int8_study.py` measures why. Plain W8A8 misses the 0.95
agreement floor (0.89) and keeping the 64 widest-range input channels out of the int8 GEMM recovers it (0.958, KL
0.0046); `torch._int_mm` alone is ~6x the fp32 GEMM from 64 rows on (AMX int8 here), but quantizing and dequantizing
with torch ops leaves 1.35-1.78x at 64-512 rows and 0.34x at one row. It needs a fused quantize/dequantize kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import torch
import torch.nn.functional as F

from worker.model.kernels import FusedOps
from worker.model.linear import (
    AMX_MAX_ROWS,
    PANEL_KERNELS,
    LinearKernel,
    amx_fits,
    make_dense_linear,
    nbytes_of,
    on_rows,
    pack_pair_panels,
    pack_panels,
    unpack_pair_panels,
    unpack_panels,
)

Quantization = Literal["int8", "fp8", "int4"]
QUANTIZATIONS: tuple[str, ...] = ("int8", "fp8", "int4")
FP8_MAX = 448.0
INT8_MAX = 127.0
FP8_TO_FP16_EXP_SHIFT = 2.0**8  # 2**(fp16 bias 15 - e4m3 bias 7)
# fp8 weights are dequantized per call; a big (fused gate+up) weight is done in tiles of ~295k weights (a 590 KB
# fp16 temporary that stays in L2, 512 rows of SmolLM2's 576 inputs): its gate+up (3072 rows) then runs 1.1-1.5x
# faster at 1-64 rows than in one piece, and faster than gate and up unfused. Weights under 4 tiles (q/k/v: 960
# rows, o and down: 576) gained nothing from tiling (within +-10%), so they stay whole.
FP8_TILE_WEIGHTS = 512 * 576
FP8_CHUNK_MIN_TILES = 4
INT4_GROUP_SIZES = (32, 64, 128)  # smallest first: quality; 32 is also GGUF's Q4 block


class Linear(Protocol):
    """`y = x @ W.T (+ b)` for x of shape [..., in_features]."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


def _torch_path(what: str) -> str:
    return f"torch's ops ({what})"


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric fp8: returns (`float8_e4m3fn` [N, K], fp32 scales [N])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 (-127..127, the scale of a row its largest |w| / 127): returns (int8 [N, K],
    fp32 scales [N])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(1e-12)
    return (w / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def fp8_to_fp16(w8: torch.Tensor) -> torch.Tensor:
    """Exact fp8 e4m3fn -> fp16 of the same value / 2**8, by moving bits (fast on CPU, unlike `.to()`)."""
    bits = w8.view(torch.uint8).to(torch.int16)
    return (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).view(torch.float16)


@dataclass(frozen=True)
class RowFormat:
    """A one-byte weight format with one scale per output row (fp8, int8): how a weight is quantized, what its codes
    are worth in a compute dtype with torch's ops (`to_dtype`: the codes' values / `unit`), and the extension's ops
    that read the codes for bf16 activations (the same values, `kernels.py`)."""

    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    to_dtype: Callable[[torch.Tensor, torch.dtype], torch.Tensor]
    unit: float
    native_to_bf16: str
    native_gemv: str
    native_amx: str
    native_panels: str | None = None  # the extension's panel linear over the codes, for fp32 activations
    # the extension's answer to whether that linear rounds the activations to int16 for a weight of this many inputs
    native_panels_int16: str | None = None
    # whether it then puts the weights on an int16 grid of their own (fp8: its values need 18-bit integers)
    int16_grid: bool = False


FP8 = RowFormat(
    quantize=quantize_fp8,
    to_dtype=lambda w8, dtype: fp8_to_fp16(w8).to(dtype),
    unit=FP8_TO_FP16_EXP_SHIFT,
    native_to_bf16="fp8_to_bf16",
    native_gemv="fp8_gemv_bf16",
    native_amx="amx_linear_fp8",
    native_panels="panel_linear_fp8",
    native_panels_int16="panel_codes_int16",
    int16_grid=True,
)
INT8 = RowFormat(
    quantize=quantize_int8,
    to_dtype=lambda w8, dtype: w8.to(dtype),
    unit=1.0,
    native_to_bf16="int8_to_bf16",
    native_gemv="int8_gemv_bf16",
    native_amx="amx_linear_int8",
    native_panels="panel_linear_i8",
    native_panels_int16="panel_codes_int16",
)


def direct_rows(native: FusedOps | None, kernel: LinearKernel, weight: torch.Tensor) -> tuple[int, bool]:
    """(the most rows a batch may have to multiply the quantized weight directly, without a dequantized copy;
    whether that is our AMX kernel). Where the dense linears run on it (`kernel` amx_bf16) and the shape fits,
    it is `amx_linear_fp8` / `amx_linear_int8` / `amx_linear_int4` up to AMX_MAX_ROWS rows: each thread
    dequantizes 32 weight rows at a time into its own scratch and multiplies them from cache. Else the extension's
    GEMV (`gemv_max_rows`), else none. Per 30 SmolLM2 layers (the weights streamed), one row: AMX 12 (fp8) / 10 (int4) ms against the GEMV's
    18 / 12.5; 32 rows: 13 / 12 against dequantized tiles + AMX 15 / 16 (engine-performance.md)."""
    if native is None:
        return 0, False
    if kernel == "amx_bf16" and amx_fits(weight):
        return AMX_MAX_ROWS, True
    return native.gemv_max_rows(), False


def _few_rows(x: torch.Tensor, most: int) -> bool:
    """A batch small enough for the GEMV path (2-D, contiguous, 1 to `most` rows)."""
    return x.dim() == 2 and 0 < x.shape[0] <= most and x.is_contiguous()


def _tiled_linear(
    x: torch.Tensor, out_features: int, rows: int, tile: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """`F.linear` of x with a quantized weight that `tile(start, end)` dequantizes `rows` output rows at a time
    (in one piece when they cover it, or when x is a prompt chunk: more than AMX_MAX_ROWS rows), the outputs
    concatenated. Tiles keep a decode batch's dequantized weight in L2; a prompt chunk's output is large, and
    concatenating it cost more than the whole weight's bf16 copy (int8, 30 SmolLM2 layers of 2048 rows: 720-930
    GFLOP/s in 512-row tiles)."""
    if rows >= out_features or x.numel() > AMX_MAX_ROWS * x.shape[-1]:
        return F.linear(x, tile(0, out_features))
    return torch.cat([F.linear(x, tile(i, min(i + rows, out_features))) for i in range(0, out_features, rows)], -1)


def fp8_chunk_rows(out_features: int, in_features: int) -> int:
    """Rows of a weight that `RowScaledLinear` dequantizes and multiplies at a time: all of them, unless the weight
    holds at least FP8_CHUNK_MIN_TILES tiles of FP8_TILE_WEIGHTS, then tiles of that size (row-aligned)."""
    rows = max(1, FP8_TILE_WEIGHTS // in_features)
    return rows if out_features >= FP8_CHUNK_MIN_TILES * rows else out_features


class RowScaledLinear:
    """One-byte weights (`FORMAT`) with one fp32 scale per output row: `y = (x @ codes.T) * scale * unit (+ b)`."""

    FORMAT: ClassVar[RowFormat]
    __slots__ = (
        "_amx",
        "_chunk_rows",
        "_direct",
        "_direct_rows",
        "_dtype",
        "_int16",
        "_out_scale",
        "_panels",
        "_to_bf16",
        "_unit_scale",
        "bias",
        "out_features",
        "scale",
        "weight",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        native: FusedOps | None = None,
        kernel: LinearKernel = "aten",
    ) -> None:
        """`native`: the extension's fused ops, where the activations are bf16: its dequantizer (one AVX512 pass, the
        same values; fp8's replaces four torch passes, ~1 ns a weight) makes the tiles, and decode-sized batches skip
        the dequantized copy (`direct_rows`: AMX where `kernel` is amx_bf16, else the GEMV). Where the dense linears
        run on the panels (`kernel` panels_fp32 or panels_bf16) and the CPU has AVX512-BF16, the codes go into bf16
        pair panels (`linear.pack_pair_panels`), widened to bf16 a panel at a time in the kernel
        (`panel_linear_bf16_codes`; an fp32 model's activations rounded to bf16 for it, as on AMX, `Bf16Inside`).
        Else where they are fp32 and the dense linears run on the fp32 panels, a format with a panel kernel (int8,
        fp8) keeps its codes in panels (`linear.pack_panels`) and multiplies them there at every batch size."""
        fmt = self.FORMAT
        self.weight, self.scale = fmt.quantize(weight)
        self._panels: Callable[..., torch.Tensor] | None = None
        self._int16 = False  # the panels round the activations to int16 (int8 and fp8 on AVX2 hosts)
        if native is not None and on_pairs(native, kernel, weight):
            self._panels = _pair_kernel(native.panel_linear_bf16_codes, dtype)
            self.weight = pack_pair_panels(self.weight, native.f32_panel_cols())
            bias = None if bias is None else bias.float().contiguous()
        elif dtype == torch.float32 and kernel == "panels_fp32" and native is not None and fmt.native_panels:
            self._panels = getattr(native, fmt.native_panels)
            self.weight = pack_panels(self.weight, native.f32_panel_cols())
            self._int16 = bool(fmt.native_panels_int16 and getattr(native, fmt.native_panels_int16)(weight.shape[1]))
        ops = native if dtype == torch.bfloat16 else None
        self._direct_rows, self._amx = direct_rows(ops, kernel, weight)
        # the extension's ops for this format, looked up once (None: torch's ops)
        self._direct: Callable[..., torch.Tensor] | None = (
            None if ops is None else getattr(ops, fmt.native_amx if self._amx else fmt.native_gemv)
        )
        self._to_bf16: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = (
            None if ops is None else getattr(ops, fmt.native_to_bf16)
        )
        self._dtype = dtype
        self.bias = bias
        self.out_features = weight.shape[0]
        self._unit_scale = (self.scale * self.FORMAT.unit).float().contiguous()  # what one unit of a code's value is
        self._out_scale = self._unit_scale.to(dtype)
        self._chunk_rows = fp8_chunk_rows(*weight.shape)

    @property
    def path(self) -> str:
        """Which kernel multiplies this layer, for the worker's log."""
        fmt = self.FORMAT
        if self.weight.dim() == 4:
            inside = "" if self._dtype == torch.bfloat16 else ", the fp32 activations rounded to bf16"
            return f"the bf16 pair panels over the codes (panel_linear_bf16_codes), scales applied to the sums{inside}"
        if self._panels is not None:
            if self._int16:
                grid = (
                    ", each panel put on an int16 grid per column and 64 inputs once per pass" if fmt.int16_grid else ""
                )
                return (
                    f"the code panels times int16 activations ({fmt.native_panels}: no AVX-512 here, and AVX2's "
                    f"integer multiply-add outruns its fp32 FMAs), x rounded per row and 64 inputs{grid}, scales "
                    "applied to the sums"
                )
            return f"the fp32 panels over the codes ({fmt.native_panels}), scales applied to the sums"
        if self._direct is not None:
            direct = fmt.native_amx if self._amx else fmt.native_gemv
            return f"{direct} up to {self._direct_rows} rows, {fmt.native_to_bf16} tiles and a bf16 GEMM past"
        return _torch_path("the codes converted per call, then F.linear")

    def stack_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """What the extension's `decode_layers` multiplies by for this layer, where its codes lie in panels of the
        model's dtype: a bf16 model's pair panels or an fp32 model's fp32 code panels (the codes' panels, the bias,
        the columns' scales). None elsewhere (the layer runs from Python): an fp32 model's pair panels round its
        activations to bf16 on the way in, which the stack does not."""
        if self._panels is None or (self.weight.dim() == 4) != (self._dtype == torch.bfloat16):
            return None
        return self.weight, self.bias, self._unit_scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = self.weight
        if self.weight.dim() == 4:
            codes = unpack_pair_panels(self.weight, self.out_features)
        elif self._panels is not None:
            codes = unpack_panels(self.weight, self.out_features)
        return (codes.to(torch.float32) * self.scale[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, n, direct, to_bf16, panels = self.weight, self.out_features, self._direct, self._to_bf16, self._panels
        if panels is not None:  # the scales and the bias applied in the kernel
            return on_rows(x, n, lambda r: panels(r, w, n, self._unit_scale, self.bias))
        if direct is None or to_bf16 is None:  # torch's ops: the codes' values in the compute dtype, scaled after
            fmt, dtype = self.FORMAT, self._dtype
            y = _tiled_linear(x, n, self._chunk_rows, lambda a, b: fmt.to_dtype(w[a:b], dtype)) * self._out_scale
        elif _few_rows(x, self._direct_rows):  # AMX scales the sums before it rounds them; the GEMV's are scaled after
            y = direct(x, w, self._unit_scale) if self._amx else direct(x, w) * self._out_scale
        else:  # rows dequantized times their scales: F.linear's output needs no pass of its own to scale
            scale = self._unit_scale
            y = _tiled_linear(x, n, self._chunk_rows, lambda a, b: to_bf16(w[a:b], scale[a:b]))
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.weight, self.scale, self.bias)


def on_pairs(native: FusedOps, kernel: LinearKernel, weight: torch.Tensor) -> bool:
    """Whether a quantized layer's codes go into bf16 pair panels: the dense linears run on the panels and the CPU
    has AVX512-BF16 (`panel_linear_bf16_codes` / `_int4`), and the weight has an even number of inputs."""
    return kernel in PANEL_KERNELS and native.bf16_panels_ready() and weight.shape[1] % 2 == 0


def _pair_kernel(run: Callable[..., torch.Tensor], dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """A pair-panel kernel (x first, `fp32_out` last) as a layer of a `dtype` model calls it, without `fp32_out`: a
    bf16 model's y in bf16; an fp32 model's x rounded to bf16 and its y the fp32 sums."""
    if dtype == torch.bfloat16:
        return lambda x, *operands: run(x, *operands, False)
    return lambda x, *operands: run(x.to(torch.bfloat16), *operands, True)


class Fp8Linear(RowScaledLinear):
    """fp8 (e4m3) weights, one scale per output row."""

    FORMAT = FP8
    __slots__ = ()


class Int8Linear(RowScaledLinear):
    """int8 weights (-127..127), one scale per output row: fp8's memory, int8's 7 bits of precision per weight."""

    FORMAT = INT8
    __slots__ = ()


def int4_group_size(in_features: int) -> int:
    for g in INT4_GROUP_SIZES:
        if in_features % g == 0:
            return g
    raise ValueError(
        f"int4 quantization needs in_features divisible by one of {INT4_GROUP_SIZES}, got {in_features}; "
        "serve this model with quantization none or fp8"
    )


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4: returns (q int32 [N, K] in 0..15, scale [N, K/G], zero [N, K/G]) with
    `w ~= (q - 8) * scale + zero`."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo = w.amin(dim=-1)
    hi = w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    return q, scale, lo + 8 * scale


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> uint8 [N, K/2] in the native dequantizer's layout: byte i of each 32-weight chunk
    holds weight i in its low nibble and weight i + 16 in its high one (K % 32 == 0)."""
    n, k = q.shape
    chunks = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def pack_int4_panels(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise int4 (`quantize_int4`'s q [N, K], scale and zero [N, K/G]) in the extension's int4 panels
    (`kernels.panel_linear_int4`): (codes uint8 [P, K, cols/2], byte j of input k holding column j's code in its low
    nibble and column j + cols/2's in its high one; groups fp32 [P, K/G, 2, cols], each group's scales then offsets,
    weight = code * scale + offset: `(q - 8) * scale + zero`). Columns past N: code, scale and offset 0."""
    half = cols // 2
    codes = pack_panels(q.to(torch.uint8), cols)
    groups = torch.stack([pack_panels(scale.float(), cols), pack_panels((zero - 8 * scale).float(), cols)], dim=2)
    return (codes[..., :half] | (codes[..., half:] << 4)).contiguous(), groups.contiguous()


def unpack_int4_panels(codes: torch.Tensor, groups: torch.Tensor, out_features: int) -> torch.Tensor:
    """The fp32 [out_features, K] weights `pack_int4_panels` packed, computed as the kernel computes them (one
    rounding: float64 products rounded once)."""
    q = torch.cat([codes & 0xF, codes >> 4], dim=-1).double()  # [P, K, cols]
    k = codes.shape[1]
    scale, offset = (g.repeat_interleave(k // g.shape[1], dim=1).double() for g in groups.unbind(2))
    return unpack_panels((q * scale + offset).float(), out_features)


class Int4Linear:
    """Group-wise int4 weights. With bf16 activations and the extension's ops (`native`) the weights are kept in
    our own nibble layout and dequantized to bf16 in tiles (`kernels.int4_to_bf16`, one AVX512 pass) for a bf16
    GEMM, as fp8 is; otherwise they are packed for torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16
    activations inside). Either way 0.5 byte a weight plus bf16 (scale, zero) per group. An fp32 model whose dense
    linears run on the panels (`kernel` panels_fp32) keeps them in int4 panels instead (`pack_int4_panels`: fp32
    scales and offsets, ~0.75 byte a weight), widened to fp32 a panel at a time in the kernel. Where the dense
    linears run on the panels and the CPU has AVX512-BF16 (no AMX), the same int4 panels are widened to fp32 and
    rounded to bf16 pairs a panel at a time (`panel_linear_bf16_int4`), for a bf16 model and for an fp32 one (its
    activations rounded to bf16, as on AMX)."""

    __slots__ = (
        "_amx",
        "_direct_rows",
        "_int16",
        "_native",
        "_pairs",
        "_panels",
        "_rows",
        "bias",
        "group_size",
        "out_dtype",
        "out_features",
        "packed",
        "scales_zeros",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        native: FusedOps | None = None,
        kernel: LinearKernel = "aten",
    ) -> None:
        self.group_size = int4_group_size(weight.shape[1])
        q, scale, zero = quantize_int4(weight, self.group_size)
        # the int4 panels' kernel: bf16 pair panels (the weights rounded to bf16 in it), or the fp32 panels
        self._pairs = native is not None and on_pairs(native, kernel, weight)
        self._panels: Callable[..., torch.Tensor] | None = None
        if native is not None and self._pairs:
            self._panels = _pair_kernel(native.panel_linear_bf16_int4, dtype)
        elif native is not None and dtype == torch.float32 and kernel == "panels_fp32":
            self._panels = native.panel_linear_int4
        # whether those are the fp32 panels and multiply int16 activations here (AVX2 hosts)
        self._int16 = (
            native is not None
            and self._panels is not None
            and not self._pairs
            and native.panel_int4_int16(weight.shape[1], self.group_size)
        )
        self._native = native if dtype == torch.bfloat16 and not self._pairs else None
        if native is not None and self._panels is not None:
            self.packed, self.scales_zeros = pack_int4_panels(q, scale, zero, native.f32_panel_cols())
        elif self._native is not None:
            self.packed = pack_int4_rows(q)
            # [N, K/G, 2]: one row's groups together, as int4_to_bf16 reads them
            self.scales_zeros = torch.stack([scale, zero], dim=-1).contiguous().to(torch.bfloat16)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # [K/G, N, 2] as the kernel wants it.
            self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)
        self.bias = bias.float().contiguous() if self._pairs and bias is not None else bias  # (added in fp32)
        self.out_features = weight.shape[0]
        self.out_dtype = dtype
        self._rows = fp8_chunk_rows(*weight.shape)  # the same bf16 tiles as fp8's, for the same cache reason
        self._direct_rows, self._amx = direct_rows(self._native, kernel, weight)

    @property
    def path(self) -> str:
        """Which kernel multiplies this layer, for the worker's log."""
        if self._panels is not None and self._pairs:
            return "the bf16 pair panels (panel_linear_bf16_int4: each panel widened, rounded to bf16 once per pass)"
        if self._panels is not None and self._int16:
            return (
                "the int4 panels times int16 activations (panel_linear_int4: no AVX-512 here, and AVX2's integer "
                "multiply-add outruns its fp32 FMAs), each panel put on an int16 grid per column and 64 inputs once "
                "per pass, x rounded per row and 64 inputs"
            )
        if self._panels is not None:
            return "the fp32 panels (panel_linear_int4: each panel widened to fp32 once per pass)"
        if self._native is not None:
            direct = "amx_linear_int4" if self._amx else "int4_gemv_bf16"
            return f"{direct} up to {self._direct_rows} rows, int4_to_bf16 tiles and a bf16 GEMM past"
        return _torch_path("_weight_int4pack_mm_for_cpu, bf16 activations inside")

    def stack_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """What the extension's `decode_layers` multiplies by for this layer, where its panels serve the model's
        dtype: a bf16 model's on the pair panels, an fp32 model's on the fp32 panels (the int4 panels, the bias, the
        groups' scales and offsets). None elsewhere (the layer runs from Python), as RowScaledLinear's."""
        if self._panels is None or self._pairs != (self.out_dtype == torch.bfloat16):
            return None
        return self.packed, self.bias, self.scales_zeros

    def _tile(self, start: int, end: int) -> torch.Tensor:
        assert self._native is not None
        return self._native.int4_to_bf16(self.packed[start:end], self.scales_zeros[start:end], self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights the layer computes with (on the int16 path, `path`, as the kernel has them before it puts
        them on its int16 grid: `testing.int4_grid` gives the grid's values)."""
        if self._panels is not None:
            w = unpack_int4_panels(self.packed, self.scales_zeros, self.out_features)
            return (w.bfloat16() if self._pairs else w).to(dtype)  # pairs: rounded to bf16 in the kernel
        if self._native is not None:
            return self._tile(0, self.out_features).to(dtype)
        k = self.packed.shape[1] * 2  # via an identity matmul: torch's packed layout is private
        eye = torch.eye(k, dtype=torch.bfloat16)
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_zeros)
        return w_t.t().to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels is not None:
            run, packed, sz, n, g = self._panels, self.packed, self.scales_zeros, self.out_features, self.group_size
            return on_rows(x, n, lambda r: run(r, packed, sz, n, g, self.bias))
        if self._native is not None:
            if _few_rows(x, self._direct_rows):
                direct = self._native.amx_linear_int4 if self._amx else self._native.int4_gemv_bf16
                y = direct(x, self.packed, self.scales_zeros, self.group_size)
            else:
                y = _tiled_linear(x, self.out_features, self._rows, self._tile)
            return y if self.bias is None else y + self.bias
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed, self.group_size, self.scales_zeros
        ).to(self.out_dtype)
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.packed, self.scales_zeros, self.bias)


class Bf16Inside:
    """A quantized layer of an fp32 model whose products run in bf16: activations rounded to bf16 on the way in,
    the output widened on the way out, as torch's own CPU int4 kernel does inside. On CPUs with AMX that puts fp32
    models' fp8 and int4 weights on the AMX kernels (`amx_linear_fp8` / `amx_linear_int4`): with fp32 products they
    ran at 0.66x (fp8) and 0.75x (int4) the fp32 model's speed on W. bf16's rounding of an activation (~0.4%) is far
    under the weights' own error (fp8 ~2.6% a weight, int4 more)."""

    __slots__ = ("inner", "out_features")

    def __init__(self, inner: Linear) -> None:
        self.inner = inner
        self.out_features = inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.bfloat16)).to(x.dtype)

    @property
    def path(self) -> str:
        """Which kernel multiplies this layer, for the worker's log."""
        return f"bf16 products: {self.inner.path}"  # type: ignore[attr-defined]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights the layer computes with."""
        return self.inner.dequantize(dtype)  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quantization: str | None,
    dtype: torch.dtype,
    kernel: LinearKernel = "aten",
    native: FusedOps | None = None,
    amx: FusedOps | None = None,
) -> Linear:
    """A linear layer over `weight` [out, in] in `dtype`, quantized as asked (None = dense, run by `kernel`);
    `native`: the extension's fused ops where they run (fp8 and int4 dequantize with them for bf16 activations);
    `amx`: the extension where its AMX kernels run, for an fp32 model's quantized layers (`Bf16Inside`)."""
    if quantization is None:
        return make_dense_linear(weight, bias, dtype, kernel, native)
    if amx is not None and dtype == torch.float32 and weight.device.type == "cpu":
        return Bf16Inside(make_linear(weight, bias, quantization, torch.bfloat16, "amx_bf16", amx))
    b = None if bias is None else bias.to(dtype)
    if quantization == "fp8":
        return Fp8Linear(weight, b, dtype, native, kernel)
    if quantization == "int8":
        return Int8Linear(weight, b, dtype, native, kernel)
    if quantization == "int4":
        if weight.device.type != "cpu":
            raise ValueError("int4 weight-only quantization uses torch's CPU int4 kernel: run it on device cpu")
        return Int4Linear(weight, b, dtype, native, kernel)
    raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS} or None")
