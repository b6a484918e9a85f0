"""LoRA adapters in PEFT format for our Llama: load and validate one against the base model, and apply the deltas
of the adapters in a batch to the model's (fused) projections.

Why it exists: one base model serves many fine-tunes (S-LoRA / Punica). An adapter adds `scale * x @ A^T @ B^T`
to a projection's output (`scale = lora_alpha / r`, or `/ sqrt(r)` with rsLoRA), which equals serving the merged
weight `W + scale * B @ A`. Our Llama fuses q/k/v into one GEMM and gate/up into another, so an adapter's deltas
are fused the same way: the A matrices of q, k and v are concatenated (one GEMM for `x @ A^T`) and their B
matrices laid out block-diagonally over the fused output's column slices (one GEMM adds every sub-projection's
delta to its own slice; a sub-projection the adapter does not target has zero rows there). The scale is folded
into B at load.

Resident adapters live in a `LoraStore`: per layer and fused group, one tensor of all slots' A (`[slots, in,
max_rank * parts]`, sub-projection m in columns m * max_rank ..) and, per sub-projection, one of their B (`[slots,
max_rank, out]`), zero-padded to the largest rank (vLLM and Punica stack them the same way), so a step's adapters
need no gathering of weights; B is applied per sub-projection (no block-diagonal zeros: a third of the memory and
of the B-side FLOPs for q/k/v) and the slices are concatenated into the fused output's layout. A batch mixes rows of several adapters and of the base: the
runner orders sequences so that the rows of one adapter are contiguous runs. The single-token (decode) rows of all
adapters go through two batched matmuls per group (`torch.bmm` over the slots, rows gathered into a [slots,
rows per slot] layout, padding masked to zero, results added back with `index_add_`), a handful of ops whatever the
number of adapters; so do the prefill chunks of the step with them when the padding stays bounded (`plan_batch`),
else each multi-token run (a prefill chunk) adds `(x @ A) @ B` to its rows in place. Base rows are untouched, and
a batch without adapters takes no extra step at all.

What is checked at load (`load_lora`, errors are `LoraError` saying what is wrong and how to fix it): the folder
holds `adapter_config.json` and `adapter_model.safetensors`; the config is plain LoRA (no DoRA, no bias, no
modules_to_save, no per-module rank/alpha patterns, not fan_in_fan_out: Llama's projections are nn.Linear); the
rank is at most `max_lora_rank`; every tensor is the lora_A/lora_B of a q/k/v/o/gate/up/down projection of an
existing layer, with both halves present and shapes that match the base model.

Imports torch, safetensors and `worker.model.config` only (the engine's model package; nothing of the server).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from worker.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# projection -> (fused group in our Llama, index of its slice in that group)
PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoraError(ValueError):
    """An adapter that cannot be served on this base model; the message says what is wrong and how to fix it."""


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one decoder layer."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (hidden, cfg.q_size),
        "k_proj": (hidden, cfg.kv_size),
        "v_proj": (hidden, cfg.kv_size),
        "o_proj": (cfg.q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of PEFT's `adapter_config.json` this engine uses."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def read_adapter_config(folder: Path, max_rank: int) -> AdapterConfig:
    path = folder / CONFIG_FILE
    try:
        raw: Any = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraError(
            f"{folder} has no {CONFIG_FILE}: a PEFT adapter folder needs it (save it with PEFT's save_pretrained)"
        ) from None
    except (OSError, ValueError) as err:
        raise LoraError(f"cannot read {path}: {err}") from None
    if not isinstance(raw, dict):
        raise LoraError(f"{path} must hold a JSON object")

    def refuse(field: str, why: str) -> LoraError:
        return LoraError(f"{path}: {field} {why}; this engine serves plain LoRA adapters (retrain or merge it)")

    if raw.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"is {raw.get('peft_type')!r}, not LORA")
    if raw.get("use_dora"):
        raise refuse("use_dora", "is true (DoRA is not supported)")
    if raw.get("bias", "none") != "none":
        raise refuse("bias", f"is {raw.get('bias')!r} (trained biases are not supported; only 'none')")
    if raw.get("modules_to_save"):
        raise refuse("modules_to_save", f"is {raw.get('modules_to_save')!r} (fully trained modules are not supported)")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise refuse("rank_pattern/alpha_pattern", "is set (per-module ranks are not supported)")
    if raw.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out", "is true, but Llama's projections are nn.Linear (it must be false)")
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"{path}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraError(
            f"{path}: the adapter's rank r={r} exceeds max_lora_rank={max_rank}: start the worker with "
            f"--max-lora-rank {r} (or more), or use an adapter of rank at most {max_rank}"
        )
    alpha = raw.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in PROJECTIONS]
        if unknown:
            raise LoraError(
                f"{path}: target_modules names {unknown}, which this engine cannot adapt; supported: "
                f"{', '.join(PROJECTIONS)}"
            )
        targets = tuple(targets)
    elif targets is not None and not isinstance(targets, str):
        raise LoraError(f"{path}: target_modules must be a list of module names or a string, got {targets!r}")
    return AdapterConfig(r=r, lora_alpha=float(alpha), target_modules=targets, use_rslora=bool(raw.get("use_rslora")))


@dataclass(frozen=True)
class LoraDelta:
    """One fused projection group's delta: `out += (x @ a_t) @ b_t` (scale folded into b_t)."""

    a_t: torch.Tensor  # [in, r * parts]
    b_t: torch.Tensor  # [r * parts, out of the fused group]
    members: tuple[int, ...] = (0,)  # which sub-projections of the group (index in GROUPS) the r-blocks are

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.addmm_(x.mm(self.a_t), self.b_t)


@dataclass(frozen=True)
class LoadedLora:
    """An adapter's weights on the base model's device and dtype: per layer, the delta of each fused group it
    targets."""

    name: str
    path: str
    rank: int
    scale: float
    layers: tuple[dict[str, LoraDelta], ...]

    @property
    def nbytes(self) -> int:
        return sum(
            d.a_t.numel() * d.a_t.element_size() + d.b_t.numel() * d.b_t.element_size()
            for layer in self.layers
            for d in layer.values()
        )


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        other = (
            " (adapter_model.bin found: convert it to safetensors)" if (folder / "adapter_model.bin").exists() else ""
        )
        raise LoraError(f"{folder} has no {WEIGHTS_FILE}{other}: save the adapter with safe_serialization=True")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise LoraError(f"cannot read {path}: {err}") from None


def load_lora(
    path: str | Path,
    cfg: ModelConfig,
    *,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    name: str = "",
) -> LoadedLora:
    """Read and validate the PEFT adapter folder at `path` for the base model `cfg`; raise LoraError if unusable."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"adapter folder {folder} does not exist (or is not a folder)")
    acfg = read_adapter_config(folder, max_rank)
    tensors = _read_tensors(folder)
    shapes = projection_shapes(cfg)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in PROJECTIONS:
            raise LoraError(
                f"{folder / WEIGHTS_FILE}: tensor {key!r} is not the lora_A/lora_B weight of a q/k/v/o/gate/up/down "
                "projection of a decoder layer; this engine adapts only those (remove other modules from the adapter)"
            )
        layer, proj, half = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_hidden_layers:
            raise LoraError(
                f"{key}: layer {layer} does not exist, the base model has {cfg.num_hidden_layers} layers "
                "(was the adapter trained on another base model?)"
            )
        found.setdefault((layer, proj), {})[half] = tensor
    if not found:
        raise LoraError(f"{folder / WEIGHTS_FILE} holds no LoRA weights")
    if isinstance(acfg.target_modules, tuple):
        wanted = {t.rsplit(".", 1)[-1] for t in acfg.target_modules}
        stray = sorted({proj for _, proj in found} - wanted)
        if stray:
            raise LoraError(f"{folder}: weights for {stray}, which target_modules {list(acfg.target_modules)} omits")
    r = acfg.r
    for (layer, proj), halves in found.items():
        prefix = f"layer {layer} {proj}"
        if set(halves) != {"A", "B"}:
            missing = "lora_B" if "A" in halves else "lora_A"
            raise LoraError(f"{folder / WEIGHTS_FILE}: {prefix} has no {missing}.weight (a truncated adapter?)")
        fan_in, fan_out = shapes[proj]
        a, b = halves["A"], halves["B"]
        if tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
            raise LoraError(
                f"{prefix}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base model, which "
                f"needs ({r}, {fan_in}) and ({fan_out}, {r}) for rank {r}: the adapter was trained on another base "
                "model (or its r in adapter_config.json is wrong)"
            )
    scale = acfg.scale
    dev = torch.device(device)
    layers: list[dict[str, LoraDelta]] = []
    for layer in range(cfg.num_hidden_layers):
        deltas: dict[str, LoraDelta] = {}
        for group, members in GROUPS.items():
            present = [p for p in members if (layer, p) in found]
            if not present:
                continue
            a_cat = torch.cat([found[(layer, p)]["A"].float() for p in present])  # [r * parts, in]
            out_total = sum(shapes[p][1] for p in members)
            b_bd = torch.zeros(out_total, r * len(present))
            row = 0
            for p in members:
                if p in present:
                    j = present.index(p)
                    b_bd[row : row + shapes[p][1], j * r : (j + 1) * r] = found[(layer, p)]["B"].float() * scale
                row += shapes[p][1]
            deltas[group] = LoraDelta(
                a_t=a_cat.t().contiguous().to(device=dev, dtype=dtype),
                b_t=b_bd.t().contiguous().to(device=dev, dtype=dtype),
                members=tuple(members.index(p) for p in present),
            )
        layers.append(deltas)
    return LoadedLora(name=name or folder.name, path=str(folder), rank=r, scale=scale, layers=tuple(layers))


class LoraStore:
    """The weights of the adapters resident in `max_loras` slots, stacked per layer and fused group and padded to
    `max_rank` (an adapter of lower rank, or without some group, leaves zeros there)."""

    def __init__(
        self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shapes = projection_shapes(cfg)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.a: list[dict[str, torch.Tensor]] = []  # layer -> group -> [slots, in, max_rank * parts]
        self.b: list[dict[str, list[torch.Tensor]]] = []  # layer -> group -> per part [slots, max_rank, out]
        self.cols = {g: [shapes[m][1] for m in members] for g, members in GROUPS.items()}  # out size of each part
        for _ in range(cfg.num_hidden_layers):
            a, b = {}, {}
            for group, members in GROUPS.items():
                fan_in = shapes[members[0]][0]
                a[group] = torch.zeros(max_loras, fan_in, max_rank * len(members), dtype=dtype, device=device)
                b[group] = [torch.zeros(max_loras, max_rank, shapes[m][1], dtype=dtype, device=device) for m in members]
            self.a.append(a)
            self.b.append(b)

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in self.a for t in layer.values()]
        tensors += [t for layer in self.b for parts in layer.values() for t in parts]
        return sum(t.numel() * t.element_size() for t in tensors)

    def put(self, slot: int, lora: LoadedLora) -> None:
        """Copy an adapter's weights into a slot (replacing whatever was there)."""
        rank, width = lora.rank, self.max_rank
        for layer, deltas in enumerate(lora.layers):
            for group, sizes in self.cols.items():
                a, parts = self.a[layer][group][slot], [b[slot] for b in self.b[layer][group]]
                a.zero_()
                for b in parts:
                    b.zero_()
                delta = deltas.get(group)
                if delta is None:
                    continue
                for j, m in enumerate(delta.members):
                    col = sum(sizes[:m])
                    a[:, m * width : m * width + rank].copy_(delta.a_t[:, j * rank : (j + 1) * rank])
                    parts[m][:rank].copy_(delta.b_t[j * rank : (j + 1) * rank, col : col + sizes[m]])


@dataclass(frozen=True)
class LoraBatch:
    """Which rows of a step's flattened batch use which resident adapter (rows of no run are base rows).

    `segments`: (start, end, slot) runs whose deltas are added run by run. `gather`/`mask`: the batched part (the
    decode rows of several adapters): `gather` lists, for slots lo..lo+n-1 in turn, `width` row indices each (a
    slot's own rows, then padding that repeats a valid row), `mask` [n, width, 1] is 1 for real rows, 0 for padding.
    """

    store: LoraStore
    segments: tuple[tuple[int, int, int], ...] = ()
    gather: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    slot_lo: int = 0
    num_slots: int = 0
    width: int = 0

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        a_all, b_parts = self.store.a[layer][group], self.store.b[layer][group]
        rank = self.store.max_rank
        if self.gather is not None and self.mask is not None:
            lo, hi = self.slot_lo, self.slot_lo + self.num_slots
            xg = x.index_select(0, self.gather).view(self.num_slots, self.width, x.shape[1])
            xa = torch.bmm(xg, a_all[lo:hi]).mul_(self.mask)
            if len(b_parts) == 1:
                y = torch.bmm(xa, b_parts[0][lo:hi])
            else:
                y = torch.cat(
                    [torch.bmm(xa[:, :, m * rank : (m + 1) * rank], b[lo:hi]) for m, b in enumerate(b_parts)], -1
                )
            out.index_add_(0, self.gather, y.view(-1, out.shape[1]))
        for start, end, slot in self.segments:
            xa = x[start:end].mm(a_all[slot])
            if len(b_parts) == 1:
                out[start:end].addmm_(xa, b_parts[0][slot])
            else:
                out[start:end].add_(
                    torch.cat([xa[:, m * rank : (m + 1) * rank].mm(b[slot]) for m, b in enumerate(b_parts)], -1)
                )


# The batched path pads every slot of its range to the rows of the busiest one; it takes a whole step's runs
# (prefill chunks too) when that padding at most doubles the rows, else only the decode rows.
MAX_PADDING = 2.0


def plan_batch(
    store: LoraStore,
    runs: list[tuple[int, int, int]],
    num_decode: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> LoraBatch:
    """A LoraBatch for (start, end, slot) runs of adapter rows (merged with `segments_of`).

    Every run goes through the batched path (a handful of ops whatever the number of runs: on a GPU each op is a
    launch, and a step of 14 prefill chunks would otherwise loop 14 times per projection) when there are two runs
    or more and padding stays within MAX_PADDING times the rows; otherwise the runs inside the first `num_decode`
    rows (single-token sequences) do when they span two slots or more, and the rest are added run by run."""
    runs = segments_of(runs)
    if len(runs) >= 2 and _padded_rows(runs) <= MAX_PADDING * sum(end - start for start, end, _ in runs):
        return _batched(store, runs, (), dtype, device)
    decode = [r for r in runs if r[1] <= num_decode]
    if len({slot for _, _, slot in decode}) < 2:
        return LoraBatch(store, tuple(runs))
    return _batched(store, decode, tuple(r for r in runs if r[1] > num_decode), dtype, device)


def _rows_by_slot(runs: list[tuple[int, int, int]]) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    for start, end, slot in runs:
        rows.setdefault(slot, []).extend(range(start, end))
    return rows


def _padded_rows(runs: list[tuple[int, int, int]]) -> int:
    """Rows the batched path computes for `runs`: every slot from the lowest to the highest, each as wide as the
    busiest."""
    rows = _rows_by_slot(runs)
    return (max(rows) - min(rows) + 1) * max(len(r) for r in rows.values())


def _batched(
    store: LoraStore,
    runs: list[tuple[int, int, int]],
    rest: tuple[tuple[int, int, int], ...],
    dtype: torch.dtype,
    device: torch.device | str,
) -> LoraBatch:
    """`runs` through the batched path (rows gathered per slot, padding masked), `rest` run by run."""
    rows = _rows_by_slot(runs)
    lo, hi = min(rows), max(rows) + 1
    width = max(len(r) for r in rows.values())
    fill = runs[0][0]
    gather: list[int] = []
    mask: list[float] = []
    for slot in range(lo, hi):
        mine = rows.get(slot, [])
        gather.extend(mine + [fill] * (width - len(mine)))
        mask.extend([1.0] * len(mine) + [0.0] * (width - len(mine)))
    return LoraBatch(
        store,
        rest,
        gather=torch.tensor(gather, dtype=torch.int64, device=device),
        mask=torch.tensor(mask, dtype=dtype, device=device).view(hi - lo, width, 1),
        slot_lo=lo,
        num_slots=hi - lo,
        width=width,
    )


def segments_of(row_slots: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge consecutive (start, end, slot) runs of the same slot that touch; runs of slot -1 (base) are dropped."""
    merged: list[tuple[int, int, int]] = []
    for start, end, slot in row_slots:
        if slot < 0 or end <= start:
            continue
        if merged and merged[-1][2] == slot and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end, slot)
        else:
            merged.append((start, end, slot))
    return merged
