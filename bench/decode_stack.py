"""A part of the model's work on and off, on W, in one run: the decode stack, gate+up with SiLU in its epilogue,
or the last layer's pruning.

Why it exists: these parts of the model claim time back without changing a token, and each needs its claim
measured on the whole workload, not on its kernel alone:

* `--part stack` (LlamaModel.decode_stack): `decode_layers` runs a pure decode step's layers (two norms, four
  linears, RoPE, the cache write and attention each, ~300 calls for SmolLM2) from C++ instead of from Python through
  their bindings;
* `--part gated` (LlamaModel.gated_mlp): gate+up's panels and silu_and_mul in one pass (`gated_linear`, and the
  stack's gated passes), so that gate+up's output never goes through memory;
* `--part prune` (LlamaModel.prune_last_layer): the last layer's o projection, MLP and final norm run only on the
  rows the step reads (a prompt chunk's last row, decode rows), not on every prompt row, whose K and V are all the
  cache needs from that layer.

This runs W through one engine, its rounds alternating the part off and on (first one, then the other, then the
other way round: the host's speed moves within minutes, so the figure that counts is the median of the within-round
ratios), checks that both give the same tokens, and prints each round's seconds and the ratio off / on. The LAST
line printed is one JSON object.

    .venv/bin/python bench/decode_stack.py --dtype bfloat16 --rounds 5
    .venv/bin/python bench/decode_stack.py --dtype bfloat16 --quantization int8
    .venv/bin/python bench/decode_stack.py --dtype float32 --part gated --rounds 4
    .venv/bin/python bench/decode_stack.py --dtype float32 --part prune --rounds 4
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from engine import add_shape_args, shape_args, smollm2_on_w
from kv_layout import spread

# --part: the model's attribute that holds it (None or False: off)
PARTS = {"stack": "decode_stack", "gated": "gated_mlp", "prune": "prune_last_layer"}


def run(
    dtype: str,
    requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    rounds: int,
    quantization: str | None = None,
    part: str = "stack",
) -> dict[str, Any]:
    """W through one engine `rounds` times each way, `part` (a PARTS key) off and on: seconds per round, the
    ratios' spread, and whether every round gave the same tokens. Exits where this model does not have it here."""
    from worker.core.request import SamplingParams

    llm, work = smollm2_on_w(dtype, requests, prompt_len, output_len, quantization=quantization)
    model = llm.engine.runner.model
    attr = PARTS[part]
    held = getattr(model, attr)
    off = False if isinstance(held, bool) else None
    if held is None:
        raise SystemExit(
            f"no {attr} for {dtype} {quantization or 'dense'} here: its linears run on {model.linear_kernel}"
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

    seconds: dict[str, list[float]] = {"off": [], "on": []}
    outputs: list[list[list[int]]] = []
    for r in range(rounds):
        for way in ("off", "on") if r % 2 == 0 else ("on", "off"):
            setattr(model, attr, held if way == "on" else off)
            secs, toks = once(f"{way}{r}")
            seconds[way].append(secs)
            outputs.append(toks)
    setattr(model, attr, held)
    ratios = [off / on for off, on in zip(seconds["off"], seconds["on"])]
    return {
        "dtype": dtype,
        "quantization": quantization,
        "part": part,
        "requests": requests,
        "off_s": [round(s, 3) for s in seconds["off"]],
        "on_s": [round(s, 3) for s in seconds["on"]],
        "off_over_on": spread(ratios),
        "same_tokens": all(toks == outputs[0] for toks in outputs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default=None, choices=["int8", "fp8", "int4"], help="weights (default: dense)")
    ap.add_argument("--rounds", type=int, default=5, help="runs each way, alternated")
    ap.add_argument("--part", default="stack", choices=sorted(PARTS), help="what is switched off and on")
    add_shape_args(ap)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    requests, prompt, output = shape_args(args)
    result = run(args.dtype, requests, prompt, output, args.rounds, args.quantization, args.part)
    r = result["off_over_on"]
    print(
        f"{args.dtype} {args.quantization or 'dense'}, {args.part}, {requests} requests, {args.rounds} rounds each way"
    )
    print(f"  off: {result['off_s']} s")
    print(f"  on:  {result['on_s']} s")
    print(f"  off / on: {r['median']:.3f}x [{r['min']:.3f}-{r['max']:.3f}], same tokens: {result['same_tokens']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
