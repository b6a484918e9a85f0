"""Dense linear kernels: which library multiplies the model's (unquantized) linear layers, and the packed layer.

Why it exists: on CPU the same `y = x @ W.T` runs at very different speeds depending on the library and the
weight layout. `bench/linear_kernels.py` measured SmolLM2-135M's shapes (one decoder layer: fused QKV, o,
fused gate+up, down; and the 49152x576 head) with torch 2.13.0+cpu, 2 threads, on an Intel Xeon with
avx512_bf16, avx512_vnni and AMX (GFLOP/s, layer group, M rows):

    path                      M=1   M=16   M=64  M=256  M=512
    fp32 MKL (F.linear)        25    151    296    375    411
    fp32 oneDNN, prepacked     19    206    323    407    414
    bf16 F.linear              22    349    848   1734   2319
    bf16 oneDNN, prepacked     32    490   1417   2295   2203

So bf16 with the weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`
+ `_linear_pointwise`: the path inductor's CPU weight prepacking emits) is 1.3-1.7x plain bf16 `F.linear` for
decode-sized batches and 3-6x fp32 MKL. oneDNN fp32 is 0.77-1.4x MKL, slower for single rows, and rounds
differently (~1e-4 absolute), which would cost the token-for-token greedy match with transformers that fp32
promises. MKL's own packed sgemm (`torch.ops.mkl._mkl_linear`) only pays at the one batch size it was packed for
and falls back to `F.linear` at any other, so it is not used.

fp32 on CPUs with AVX512F runs on our own kernel (`PanelLinear`, `kernels.panel_linear_f32`, stop 30): the weight
is packed once at load into panels of 48 output columns, [panels, in, 48], and each step broadcasts 8 rows' input
k into a panel's 48 weights of k (24 accumulators); while a thread multiplies one panel it prefetches its next
into L2, spread over the blocks. MKL packs the weight on every call, which is what costs it at decode sizes. Over
30 SmolLM2 layers streamed from DRAM (`bench/linear_kernels.py --layers 30 --groups layer,head --paths
fp32_mkl,fp32_panels --rows 1,4,16,32,64,128,256,512,2048`), GFLOP/s, one run (stop 31):

    rows                        1      4     16     32     64    128    256    512   2048
    panels (ours)            13.9   48.1    147    220    311    376    366    382    379
    MKL (F.linear)           13.2   29.8     86    151    216    286    308    361    378

and the 49152x576 head 1.5-2.0x MKL at 4-64 rows. Two changes at stop 31 took 2048 rows from 0.9x to 1.0x MKL:
the input step unrolled by 2, and y written with streaming stores past one 256-row pass (a prompt chunk's y, up to
25 MB a projection, outgrows the caches, and plain stores read each line from DRAM first). Its sums run over
chunks of 64 inputs, added up at the end: its error against float64 stays under MKL's (a single running sum had
~3x it), and SmolLM2's fp32 greedy output still matches transformers' token for token. A tied head's panels also
serve the embedding lookups (`rows`), so the embedding is held once.

CPUs with AVX2 + FMA and no AVX-512 (Zen 1-3, Intel before Ice Lake) run the same panels 4 rows x 24 columns at
a time (16 registers of 8 lanes), summed in the same order, so the two paths give the same bits. Same command on
an AMD EPYC Zen 3 (AVX2 only; stop 33):

    rows                        1      4     16     32     64    128    256    512   2048
    panels (ours, AVX2)       5.9   20.0   54.3   90.1    110    116    126    113    135
    MKL (F.linear)            3.6    8.6   23.9   43.3   64.3   94.2   98.9    108    113

The same command at stop 55, on a faster Zen 3 host (family 25 model 1), after the AVX2 pass began writing its
outputs row by row (so that streaming stores fill whole 64-byte lines; column group by column group they left the
write-combining buffers half full, ~10% of a 2048-row layer's time in perf), one run:

    rows                        1      4     16     32     64    128    256    512   2048
    panels (ours, AVX2)      16.4   52.0    137    122    123    143    155    167    171
    MKL (F.linear)            7.7   14.5   61.7   90.8   97.2    144    157    144    165

bf16 on CPUs with AVX512-BF16 and no AMX (Zen 4/5, Cooper Lake) runs the same panels with each row of a panel
holding one pair of inputs for its 48 columns, [panels, in / 2, 48, 2] (`pack_pair_panels`), so that one
`vdpbf16ps` multiplies a row's pair of x (a 32-bit broadcast) into 16 columns: twice an fp32 FMA's work (a
register-only loop on the Zen 5 of stop 42 reads 960 GFLOP/s against 520 for fp32 FMAs, 2 threads). The sums are
fp32, rounded once (an output head keeps them: `fp32_out`). oneDNN's prepacked bf16 linear was the path before.
Same command with `--paths bf16_onednn,bf16_panels,bf16_aten` on that Zen 5 (stop 42), GFLOP/s:

    rows                        1      4     16     32     64    128    256    512   2048
    bf16 panels (ours)       43.8    169    637    866    911    956    981    989    992
    oneDNN, prepacked        37.4    137    379    520    614    780    869    923    960
    F.linear, plain weight   24.3   90.7    281    413    550    717    834    896    920

Past one 256-row pass y goes out with streaming stores (0.88 -> 1.0x oneDNN at 2048 rows), and a tied head's
panels serve the embedding, so one copy of each weight is held.

On CPUs with AMX (Sapphire Rapids and later) our own AMX kernel (`kernels.amx_linear`) runs batches of up to
`AMX_MAX_ROWS` rows on the plain weight, and torch's matmul the rest. Over 30 SmolLM2 layers with their own weights
(so they stream from DRAM, as in a decode step: 212 MB), GFLOP/s, 2 threads, one run (`bench/linear_kernels.py
--layers 30 --groups layer --paths bf16_amx,bf16_onednn,bf16_aten --rows 1,16,64,128,256,512,1024`):

    rows                        1      16      64     128     256     512    1024
    AMX kernel (ours)          27     409     916    1233    1391    1739    1755   (F.linear from 512)
    oneDNN, prepacked          19     285     819    1187    1576    1605    1708
    F.linear, plain weight     13     178     536     862    1149    1739    1736

At 1-16 rows the kernel streams the weights as fast as the memory gives them (7.9 ms for the 212 MB at one row);
at 64 it is ~1.5x that, stalled on tile loads. At 256 rows oneDNN is faster (compute-bound there) and from 512 the
plain weight serves F.linear as well as a prepacked one. So the plain weight serves both and nothing is packed: no
second copy of a tied output head, no reorder at load.

`choose_linear_kernel` is the pure decision (device, dtype, CPU flags, which torch ops exist -> kind and a
reason the worker logs); `make_dense_linear` builds the layer of that kind. Fused projections are the
caller's business (llama.py concatenates QKV and gate+up before calling). Imports torch only: the model
package (worker/model) uses it, nothing here knows about the server.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

LinearKernel = Literal["aten", "onednn_bf16", "amx_bf16", "panels_fp32", "panels_bf16"]
PANEL_KERNELS = ("panels_fp32", "panels_bf16")  # the kinds `PanelLinear` runs
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # any one: oneDNN then has native bf16 dot products
ONEDNN_LINEAR = "onednn_linear"  # name of the capability `available_kernels` reports
AMX_LINEAR = "amx_linear"  # the capability of our extension's AMX linear (`FusedOps.amx_linear_ready`)
AMX_CPU_FLAGS = ("amx_bf16", "amx_tile")  # both: the tile unit and its bf16 dot products
AMX_MAX_ROWS = 256  # up to here the AMX kernel beats F.linear on the same plain weight (the table above)
F32_PANELS = "f32_panels"  # the capability of our extension's fp32 panel linear (`FusedOps.f32_panels_ready`)
# ... and that it takes its AVX-512 path (`FusedOps.vector_isa`: the CPU's widest, capped by ATEN_CPU_CAPABILITY as
# torch's own kernels are; without it the panels take their AVX2 + FMA path)
F32_PANELS_AVX512 = "f32_panels_avx512"
BF16_PANELS = "bf16_panels"  # the capability of our extension's bf16 panel linear (`FusedOps.bf16_panels_ready`)


class AmxOps(Protocol):
    """What this module needs of the native extension (`kernels.FusedOps` has it)."""

    def amx_linear_ready(self) -> bool: ...

    def amx_linear(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool
    ) -> torch.Tensor: ...

    def f32_panels_ready(self) -> bool: ...

    def vector_isa(self) -> str: ...

    def f32_panel_cols(self) -> int: ...

    def panel_linear_f32(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def bf16_panels_ready(self) -> bool: ...

    def panel_linear_bf16(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, fp32_out: bool
    ) -> torch.Tensor: ...

    def panel_weight_rows(self, packed: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor: ...


def read_cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where there is no /proc/cpuinfo)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def available_kernels(native: AmxOps | None = None) -> frozenset[str]:
    """Which optional kernels this build has: oneDNN's prepacked linear (a torch build with mkldnn), and with
    `native` (the extension's ops, where it builds) its AMX linear where the CPU and OS let it run, and its fp32
    panels with the vector path they take here (the extension's own choice, so the log says what runs)."""
    have: set[str] = set()
    if native is not None and native.amx_linear_ready():
        have.add(AMX_LINEAR)
    if native is not None and native.f32_panels_ready():
        have.add(F32_PANELS)
        if native.vector_isa() == "avx512":
            have.add(F32_PANELS_AVX512)
    if native is not None and native.bf16_panels_ready():
        have.add(BF16_PANELS)
    try:
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 (raises when the op is absent)
            torch.ops.mkldnn._linear_pointwise  # noqa: B018
            have.add(ONEDNN_LINEAR)
    except (AttributeError, RuntimeError):
        pass
    return frozenset(have)


def choose_linear_kernel(
    device: str | torch.device, dtype: torch.dtype, cpu_flags: frozenset[str], kernels: frozenset[str]
) -> tuple[LinearKernel, str]:
    """Which kernel runs the dense linears, and why (one line for the worker log)."""
    dev = torch.device(device).type
    if dev != "cpu":
        return "aten", f"device {dev}: torch's default matmul"
    if dtype == torch.float32:
        if F32_PANELS_AVX512 in kernels:
            return "panels_fp32", (
                "fp32 on a CPU with AVX512F: our kernel on weights packed once in panels (1.3-1.7x MKL at 4-128 rows, 1.0x at 2048)"
            )
        if F32_PANELS in kernels:
            return "panels_fp32", (
                "fp32 on a CPU with AVX2 + FMA: our kernel on weights packed once in panels (1.3-3.6x MKL at 1-64 rows, 1.0x from 128)"
            )
        return "aten", "fp32 on CPU: MKL sgemm (oneDNN fp32 is not faster here and rounds differently)"
    if dtype != torch.bfloat16:
        return "aten", f"{dtype} on CPU: torch's default matmul (only bf16 has a packed oneDNN path)"
    units = [f for f in BF16_CPU_FLAGS if f in cpu_flags]
    if all(f in cpu_flags for f in AMX_CPU_FLAGS) and AMX_LINEAR in kernels:
        return "amx_bf16", (
            f"bf16 on a CPU with AMX: our AMX kernel on the plain weights up to {AMX_MAX_ROWS} rows, torch's matmul past"
        )
    if not units:
        return "aten", f"bf16 on a CPU without {' or '.join(BF16_CPU_FLAGS)}: torch's default matmul"
    if BF16_PANELS in kernels:
        return "panels_bf16", (
            "bf16 on a CPU with avx512_bf16 and no AMX: our kernel on weights packed once in panels of input pairs"
            " (1.25-1.55x oneDNN at 1-64 rows, 1.0x at 2048)"
        )
    if ONEDNN_LINEAR not in kernels:
        return "aten", "bf16: this torch build lacks oneDNN's prepacked linear (mkldnn), torch's default matmul"
    return "onednn_bf16", f"bf16 on a CPU with {'+'.join(units)}: oneDNN linear, weights reordered once at load"


def resolve_auto_dtype(
    device: str | torch.device, cpu_flags: frozenset[str], kernels: frozenset[str]
) -> tuple[str, str]:
    """What `dtype: auto` means here (a torch dtype name), and why: bf16 where the linears have a native bf16
    path (GPUs; CPUs with AVX512-BF16/AMX and oneDNN, where bf16 runs the layer GEMMs 3-6x faster than fp32 MKL),
    fp32 elsewhere (bf16 without native dot products is emulated and slower than fp32)."""
    dev = torch.device(device).type
    if dev != "cpu":
        return "bfloat16", f"device {dev}: bf16 tensor cores"
    kind, reason = choose_linear_kernel(device, torch.bfloat16, cpu_flags, kernels)
    if kind != "aten":
        return "bfloat16", reason
    return "float32", f"fp32, because {reason}"


class DenseLinear:
    """`F.linear` over a plain weight: the fallback on every device."""

    __slots__ = ("bias", "out_features", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.weight, self.bias)


class PackedLinear:
    """oneDNN linear with the weight reordered once into oneDNN's blocked layout (CPU only).

    The packed weight is an opaque mkldnn tensor; `dequantize` gives the plain weight back for tests and tools.
    """

    __slots__ = ("_bytes", "bias", "in_features", "out_features", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if weight.device.type != "cpu":
            raise ValueError("oneDNN packed linears run on device cpu; use DenseLinear elsewhere")
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.bias = bias
        self._bytes = nbytes_of(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The plain [out, in] weight the layer multiplies by."""
        return self.packed.to_dense().to(dtype).reshape(self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self._bytes


class AmxLinear(DenseLinear):
    """bf16 over a plain weight: our AMX kernel for up to `AMX_MAX_ROWS` rows (decode), `F.linear` past them.
    `fp32_out`: the kernel's rows come out in fp32, unrounded (the output head: its logits are wanted in fp32, and
    rounding them to bf16 and widening them again cost ~1 ms a step at 64 rows of 49k); F.linear's stay bf16."""

    __slots__ = ("_fp32_out", "_native")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native: AmxOps, fp32_out: bool = False) -> None:
        out_features, in_features = weight.shape
        if weight.dtype != torch.bfloat16 or out_features % 16 or in_features % 32:
            raise ValueError(f"the AMX linear takes a bf16 weight [16n, 32k]; got {weight.dtype} {tuple(weight.shape)}")
        super().__init__(weight.contiguous(), None if bias is None else bias.contiguous())
        self._native = native
        self._fp32_out = fp32_out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.dtype != torch.bfloat16 or not 1 <= rows <= AMX_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return on_rows(
            x, self.out_features, lambda r: self._native.amx_linear(r, self.weight, self.bias, self._fp32_out)
        )


class PanelLinear:
    """Our panel kernels over the weight packed once into panels of `f32_panel_cols()` output columns (the
    kernels' comments in kernels.py say why): fp32 [panels, in, cols] (`panel_linear_f32`), or bf16 in panels of
    input pairs, [panels, in / 2, cols, 2] (`panel_linear_bf16`, AVX512-BF16's dot products; a bias is added in
    fp32 before the one rounding; `fp32_out`: no rounding, the sums come out in fp32, as an output head's logits
    are wanted). `rows(ids)` reads weight rows back out of the panels: a tied head's embedding lookups, so the
    embedding is not held twice."""

    __slots__ = ("_lookup", "_run", "bias", "in_features", "out_features", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native: AmxOps, fp32_out: bool = False) -> None:
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(
                f"the panel linear takes an fp32 or bf16 CPU weight [out, in]; got {weight.dtype} {weight.device}"
            )
        self.out_features, self.in_features = weight.shape
        cols = native.f32_panel_cols()
        self._lookup = native.panel_weight_rows
        self._run: Callable[..., torch.Tensor]
        if weight.dtype == torch.float32:
            self.packed, self._run = pack_panels(weight, cols), native.panel_linear_f32
            self.bias = None if bias is None else bias.contiguous()
        else:
            if not native.bf16_panels_ready():
                raise ValueError("the bf16 panel linear needs a CPU with AVX512-BF16 (FusedOps.bf16_panels_ready)")
            if self.in_features % 2:
                raise ValueError(f"the bf16 panel linear takes an even number of inputs; got {self.in_features}")
            self.packed = pack_pair_panels(weight, cols)
            self._run = lambda x, packed, n, bias: native.panel_linear_bf16(x, packed, n, bias, fp32_out)
            self.bias = None if bias is None else bias.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return on_rows(x, self.out_features, lambda r: self._run(r, self.packed, self.out_features, self.bias))

    def stack_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """What the extension's `decode_layers` multiplies by for this layer: (panels, bias, no scales)."""
        return self.packed, self.bias, None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """weight[ids] ([len(ids), in]): F.embedding over the packed weight (the extension's `panel_weight_rows`)."""
        return self._lookup(self.packed, ids, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The plain [out, in] weight the layer multiplies by."""
        if self.packed.dim() == 3:
            return unpack_panels(self.packed, self.out_features).to(dtype)
        return unpack_pair_panels(self.packed, self.out_features).to(dtype)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.packed, self.bias)


def pack_panels(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """weight [out, in] (any dtype) -> [panels, in, cols], panel p = weight[cols p .. cols p + cols - 1].T, the rows
    past `out` zero: the layout the extension's panel linears read (`panel_linear_f32`, `panel_linear_i8`)."""
    out, inp = weight.shape
    panels = -(-out // cols)
    padded = weight.new_zeros(panels * cols, inp)
    padded[:out] = weight
    return padded.view(panels, cols, inp).transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [out_features, in] weight `pack_panels` packed."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]


def pack_pair_panels(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """weight [out, in] (in even) -> [panels, in / 2, cols, 2]: panel p holds columns cols p .. cols p + cols - 1
    (past `out` zero), each row of it one pair of inputs for every column: what `panel_linear_bf16` reads."""
    out, inp = weight.shape
    panels = -(-out // cols)
    padded = weight.new_zeros(panels * cols, inp)
    padded[:out] = weight
    return padded.view(panels, cols, inp // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_pair_panels(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [out_features, in] weight `pack_pair_panels` packed."""
    panels, pairs, cols, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(panels * cols, pairs * 2)[:out_features]


def panels_fit(weight: torch.Tensor) -> bool:
    """Whether `PanelLinear` takes this weight's shape (bf16 panels hold pairs of inputs: an even count)."""
    return weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0


def amx_fits(weight: torch.Tensor) -> bool:
    """Whether the AMX kernel takes this weight's shape ([16n, 32k])."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0


def make_dense_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    kernel: LinearKernel = "aten",
    native: AmxOps | None = None,
) -> DenseLinear | PackedLinear | PanelLinear:
    """An unquantized linear over `weight` [out, in] in `dtype`, run by `kernel` (`amx_bf16` needs `native`, and
    a weight shape it takes; other shapes get torch's matmul)."""
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    if kernel == "amx_bf16":
        if native is None:
            raise ValueError("the amx_bf16 kernel needs the native extension's ops (kernels.load_fused_ops)")
        return AmxLinear(w, b, native) if amx_fits(w) else DenseLinear(w, b)
    if kernel == "onednn_bf16":
        return PackedLinear(w, b)
    if kernel in PANEL_KERNELS:
        if native is None:
            raise ValueError(f"the {kernel} kernel needs the native extension's ops (kernels.load_fused_ops)")
        return PanelLinear(w, b, native) if panels_fit(w) else DenseLinear(w, b)
    return DenseLinear(w, b)


def on_rows(x: torch.Tensor, out_features: int, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`kernel` (which takes contiguous [rows, in] only) over x's rows, the output in x's leading shape. The model's
    own rows go straight in: no reshape, no copy (2.6 us a call, not 5.2, for the AMX kernel)."""
    if x.dim() == 2 and x.is_contiguous():
        return kernel(x)
    y = kernel(x.reshape(-1, x.shape[-1]).contiguous())
    return y.view(*x.shape[:-1], out_features)


def nbytes_of(*tensors: torch.Tensor | None) -> int:
    """Bytes held by the given tensors (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
