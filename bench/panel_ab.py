"""Two builds of the extension's panel linears, timed in one process, rounds interleaved: is a kernel change faster?

Why it exists: on the shared 2-CPU hosts these benchmarks run on, the machine's speed moves by 1.5x within minutes
(one W run read 60 s of wall, the next 90), so two builds timed one after the other, even alternated run by run,
compare the host's moments more than the kernels. The extension's module name carries a hash of its source, so the
build of another commit loads beside this tree's in the same process; each round times both on the same weights and
inputs, in alternating order, and the figure that counts is the median over rounds of the within-round speed
ratio. What it times: the panel linears (`panel_linear_f32`, `_bf16`, `_i8`, `_fp8`, `_int4`) on SmolLM2-135M's four
projections (QKV and gate+up fused), `--layers` copies each so that the weights stream from DRAM as a decode
step's do; `bf16` (the pair panels, bf16 activations) needs a CPU with AVX512-BF16.

    .venv/bin/python bench/panel_ab.py --base HEAD~1 --rows 1,8,16,32,64,256,2048
    .venv/bin/python bench/panel_ab.py --base 9f305a9 --paths f32,i8 --rounds 9
    .venv/bin/python bench/panel_ab.py --paths i8,fp8 --against f32   # one build, a path against another

`--against` times this tree's paths against another path of the same build (the ratio: path / against, in speed),
so "is int8 faster than fp32 here" is measured the same way as "is this commit faster than that one".

`--base` is built once in a temporary git worktree (about a minute when its source is new; torch caches it); the
other side is this tree's `worker_image`. Prints one line per (path, rows): GFLOP/s of each side (median round)
and the within-round ratio new / base (median, min, max), then one JSON object as its LAST line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from linear_kernels import GROUPS

ROOT = Path(__file__).resolve().parent.parent
SHAPES = GROUPS["layer"]  # [N, K] of one decoder layer, as the engine runs them (QKV and gate+up fused)
PATHS = ("f32", "bf16", "i8", "fp8", "int4")
_BUILD = (
    "import sys; sys.path.insert(0, sys.argv[1]); from worker.model.kernels import _load_module; "
    "m, why = _load_module(); print(m.__file__ if m is not None else 'ERROR ' + str(why))"
)


def module_file(worker_image: Path) -> str:
    """The built extension's shared object for the `worker_image` folder given (built in a child process)."""
    out = (
        subprocess.run([sys.executable, "-c", _BUILD, str(worker_image)], capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    if out.startswith("ERROR"):
        raise RuntimeError(f"the extension does not build from {worker_image}: {out[6:]}")
    return out


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """Commit `rev` checked out in a temporary git worktree (removed afterwards): the base side of an A/B."""
    with tempfile.TemporaryDirectory(prefix="bench_base_") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), rev], check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def base_module_file(rev: str) -> str:
    """The extension of commit `rev`, built from a temporary worktree."""
    with worktree(rev) as tree:
        return module_file(tree / "worker_image")


def load_module_file(path: str) -> Any:
    """Import an extension's shared object by path (its file name is its module name)."""
    name = Path(path).name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ratio_summary(base_s: list[float], new_s: list[float], flops: float) -> dict[str, float]:
    """Rounds' seconds of both sides -> GFLOP/s of each side's median round and the within-round speed ratio
    new / base (base seconds over new seconds): its median, min and max."""
    if len(base_s) != len(new_s) or not base_s:
        raise ValueError("both sides need the same, non-zero number of rounds")
    ratios = [b / n for b, n in zip(base_s, new_s, strict=True)]
    return {
        "base_gflops": round(flops / statistics.median(base_s) / 1e9, 1),
        "new_gflops": round(flops / statistics.median(new_s) / 1e9, 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
    }


def make_layers(layers: int, paths: tuple[str, ...], seed: int = 0) -> list[dict[str, Any]]:
    """`layers` copies of the four projections: per weight its panels for each path asked (and the codes' scales)."""
    import torch
    from worker.model.linear import pack_pair_panels, pack_panels
    from worker.model.quant import FP8, INT8, int4_group_size, pack_int4_panels, quantize_int4

    formats = {"i8": INT8, "fp8": FP8}
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=gen) * k**-0.5
            entry: dict[str, Any] = {"n": n, "k": k}
            if "f32" in paths:
                entry["f32"] = pack_panels(w, 48)
            if "bf16" in paths:
                entry["bf16"] = pack_pair_panels(w.bfloat16(), 48)
            if "int4" in paths:  # group-wise codes, their groups' scales and offsets, and the group size
                group = int4_group_size(k)
                entry["int4"] = (*pack_int4_panels(*quantize_int4(w, group), 48), group)
            for path in paths:
                if path in formats:  # the codes and what one unit of a code is worth, as RowScaledLinear keeps them
                    codes, scale = formats[path].quantize(w)
                    entry[path] = (pack_panels(codes, 48), (scale * formats[path].unit).float().contiguous())
            out.append(entry)
    return out


def one_pass(module: Any, path: str, layers: list[dict[str, Any]], xs: dict[int, Any]) -> float:
    """Seconds for one pass over every layer's projections on `path`."""
    start = time.perf_counter()
    for layer in layers:
        x, n = xs[layer["k"]], layer["n"]
        if path == "f32":
            module.panel_linear_f32(x, layer["f32"], n, None)
        elif path == "bf16":
            module.panel_linear_bf16(x, layer["bf16"], n, None, False)
        elif path == "int4":
            packed, groups, group = layer["int4"]
            module.panel_linear_int4(x, packed, groups, n, group, None)
        else:
            packed, scale = layer[path]
            getattr(module, f"panel_linear_{path}")(x, packed, n, scale, None)
    return time.perf_counter() - start


def compare(
    base: Any, new: Any, paths: tuple[str, ...], rows: list[int], layers: int, rounds: int, against: str | None = None
) -> dict:
    """{path: {rows: ratio_summary}}, both sides timed round by round, the first alternating. A side is a module and
    a path: base's and new's module on each path, or (`against`) new's module on `against` and on each path."""
    import torch

    weights = make_layers(layers, tuple(dict.fromkeys((*paths, *((against,) if against else ())))))
    result: dict[str, dict[str, dict[str, float]]] = {}
    with torch.inference_mode():
        for path in paths:
            result[path] = {}
            sides = {"base": (new, against) if against else (base, path), "new": (new, path)}
            for m in rows:
                xs = {  # x of each side's dtype
                    p: {k: torch.randn(m, k).to(torch.bfloat16 if p == "bf16" else torch.float32) for _, k in SHAPES}
                    for _, p in sides.values()
                }
                flops = sum(2.0 * m * layer["n"] * layer["k"] for layer in weights)
                for module, p in sides.values():  # warm-up: first-touch of outputs, thread pool
                    one_pass(module, p, weights, xs[p])
                times: dict[str, list[float]] = {"base": [], "new": []}
                for r in range(rounds):
                    for side in ("base", "new") if r % 2 == 0 else ("new", "base"):
                        module, p = sides[side]
                        times[side].append(one_pass(module, p, weights, xs[p]))
                result[path][str(m)] = ratio_summary(times["base"], times["new"], flops)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="the commit to compare this tree against (default HEAD)")
    ap.add_argument("--base-module", default=None, help="an already built extension (.so) instead of --base")
    ap.add_argument("--rows", default="1,8,16,32,64,256,2048")
    ap.add_argument("--paths", default="f32", help=f"comma-separated: {','.join(PATHS)}")
    ap.add_argument("--layers", type=int, default=30, help="copies of the projections (30: SmolLM2's, from DRAM)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--against", default=None, help=f"one of {','.join(PATHS)}: time this tree's --paths against it")
    args = ap.parse_args()
    paths = tuple(p for p in args.paths.split(",") if p)
    if not paths or any(p not in PATHS for p in paths) or (args.against and args.against not in PATHS):
        ap.error(f"--paths and --against take {','.join(PATHS)}")
    if args.rounds < 1 or args.layers < 1:
        ap.error("--rounds and --layers must be at least 1")
    rows = [int(r) for r in args.rows.split(",")]

    import torch

    sys.path.insert(0, str(ROOT / "worker_image"))
    new_file = module_file(ROOT / "worker_image")
    base_file = new_file if args.against else args.base_module or base_module_file(args.base)
    base, new = load_module_file(base_file), load_module_file(new_file)
    if "bf16" in (*paths, args.against) and not new.bf16_panels_ready():
        ap.error("--paths bf16 needs a CPU with AVX512-BF16")
    if args.against:
        print(f"base: path {args.against}, new: --paths, both {Path(new_file).name} (this tree)")
    else:
        print(f"base {Path(base_file).name} ({args.base_module or args.base}), new {Path(new_file).name} (this tree)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.layers} layers, {args.rounds} rounds")
    result = compare(base, new, paths, rows, args.layers, args.rounds, args.against)
    for path, by_rows in result.items():
        for m, cell in by_rows.items():
            print(
                f"{path:4s} {int(m):5d} rows: base {cell['base_gflops']:6.1f}  new {cell['new_gflops']:6.1f} GFLOP/s"
                f"   new / base {cell['ratio']:.3f} (rounds {cell['ratio_min']:.3f}-{cell['ratio_max']:.3f})"
            )
    base_name = f"path {args.against}" if args.against else args.base_module or args.base
    print(json.dumps({"base": base_name, "layers": args.layers, "rounds": args.rounds, **result}))


if __name__ == "__main__":
    main()
