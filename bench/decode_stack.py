"""A decode step's layers in one native call against the same calls made one by one from Python, on W, in one run.

Why it exists: `decode_layers` (LlamaModel.decode_stack) runs a pure decode step's layers (two norms, four linears,
RoPE, the cache write and attention each, ~300 calls for SmolLM2) from C++ instead of from Python through their
bindings, and claims the time between the calls back. This runs W through one engine, its rounds alternating the
stack on and off (first one, then the other, then the other way round: the host's speed moves within minutes, so
the figure that counts is the median of the within-round ratios), checks that both give the same tokens, and
prints each round's seconds and the ratio python / stack. The LAST line printed is one JSON object.

    .venv/bin/python bench/decode_stack.py --dtype bfloat16 --rounds 5
    .venv/bin/python bench/decode_stack.py --dtype bfloat16 --quantization int8
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from engine import add_shape_args, shape_args, smollm2_on_w
from kv_layout import spread


def run(
    dtype: str,
    requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    rounds: int,
    quantization: str | None = None,
) -> dict[str, Any]:
    """W through one engine `rounds` times each way: seconds per round (python, stack), the ratios' spread, and
    whether every round gave the same tokens. Exits where this model has no stack here."""
    from worker.core.request import SamplingParams

    llm, work = smollm2_on_w(dtype, requests, prompt_len, output_len, quantization=quantization)
    model = llm.engine.runner.model
    stack = model.decode_stack
    if stack is None:
        raise SystemExit(
            f"no decode stack for {dtype} {quantization or 'dense'} here: its linears run on {model.linear_kernel}"
        )
    llm.generate([work[0][0][:32]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up

    def once(tag: str) -> tuple[float, list[list[int]]]:
        core = llm.engine
        for i, (prompt, n) in enumerate(work):
            core.add_request(f"{tag}.{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        tokens: dict[str, list[int]] = {f"{tag}.{i}": [] for i in range(len(work))}
        start = time.perf_counter()
        while core.has_unfinished_requests():
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
        return time.perf_counter() - start, list(tokens.values())

    seconds: dict[str, list[float]] = {"python": [], "stack": []}
    outputs: list[list[list[int]]] = []
    for r in range(rounds):
        for way in ("python", "stack") if r % 2 == 0 else ("stack", "python"):
            model.decode_stack = stack if way == "stack" else None
            secs, toks = once(f"{way}{r}")
            seconds[way].append(secs)
            outputs.append(toks)
    model.decode_stack = stack
    ratios = [p / s for p, s in zip(seconds["python"], seconds["stack"])]
    return {
        "dtype": dtype,
        "quantization": quantization,
        "requests": requests,
        "python_s": [round(s, 3) for s in seconds["python"]],
        "stack_s": [round(s, 3) for s in seconds["stack"]],
        "python_over_stack": spread(ratios),
        "same_tokens": all(toks == outputs[0] for toks in outputs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default=None, choices=["int8", "fp8", "int4"], help="weights (default: dense)")
    ap.add_argument("--rounds", type=int, default=5, help="runs each way, alternated")
    add_shape_args(ap)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    requests, prompt, output = shape_args(args)
    result = run(args.dtype, requests, prompt, output, args.rounds, args.quantization)
    r = result["python_over_stack"]
    print(f"{args.dtype} {args.quantization or 'dense'}, {requests} requests, {args.rounds} rounds each way")
    print(f"  python: {result['python_s']} s")
    print(f"  stack:  {result['stack_s']} s")
    print(f"  python / stack: {r['median']:.3f}x [{r['min']:.3f}-{r['max']:.3f}], same tokens: {result['same_tokens']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
