"""Quantization report: weight memory per variant and quality against the unquantized model.

Quality is measured under teacher forcing on a fixed set of chat prompts (see `worker.model.quality`):
greedy-token agreement (top-1 equal) and mean KL(reference || variant) over 24 generated positions each. The
agreement is a count over few positions: each variant's row says how many matched and its 95% interval
(`QualityReport.agreement_interval`), and the reference's near ties (`near_ties`) are printed once: a variant's
agreement within the interval of another's is not shown to differ from it by this prompt set.

    .venv/bin/python bench/quant.py                    # SmolLM2 (bundled), fp32 reference
    .venv/bin/python bench/quant.py --model PATH --tokens 16 --json
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a tip for learning to play the guitar.",
    "What does a CPU do?",
]
NEAR_TIE_NATS = (0.1, 0.5)  # log-probability gaps under which the reference's top two tokens count as near ties
VARIANTS = [
    ("fp32", "float32", None),
    ("bf16", "bfloat16", None),
    ("int8", "float32", "int8"),
    ("fp8", "float32", "fp8"),
    ("int4", "float32", "int4"),
    ("int8-bf16", "bfloat16", "int8"),  # int8 weights, bf16 activations: the bf16 GEMM units do the work
    ("fp8-bf16", "bfloat16", "fp8"),
    ("int4-bf16", "bfloat16", "int4"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled://smollm2-135m-instruct", help="model source (default: SmolLM2)")
    ap.add_argument("--tokens", type=int, default=24, help="generated positions compared per prompt")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()

    from worker.model.quality import compare, near_ties
    from worker.model.quality import reference as make_reference
    from worker.model.runner import ModelRunner
    from worker.model.source import resolve_model_source

    path = str(resolve_model_source(args.model))
    rows = []
    reference = ModelRunner(path, num_blocks=4)
    prompts = [
        reference.tokenizer.encode(reference.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
        if reference.tokenizer.chat_template
        else reference.tokenizer.encode(p)
        for p in PROMPTS
    ]
    ref = make_reference(reference, prompts, max_tokens=args.tokens)
    for name, dtype, quant in VARIANTS:
        t0 = time.perf_counter()
        runner = reference if name == "fp32" else ModelRunner(path, num_blocks=4, dtype=dtype, quantization=quant)
        load_s = time.perf_counter() - t0
        report = compare(ref, runner)
        lo, hi = report.agreement_interval()
        linear_bytes = sum(
            layer.qkv.nbytes + layer.o_proj.nbytes + layer.gate_up.nbytes + layer.down.nbytes
            for layer in runner.model.layers
        )
        rows.append(
            {
                "variant": name,
                "weights_mb": round(runner.weight_bytes / 1e6, 1),
                "linear_weights_mb": round(linear_bytes / 1e6, 1),
                "agreement": round(report.agreement, 4),
                "matches": report.matches,
                "agreement_interval": [round(lo, 3), round(hi, 3)],
                "mean_kl": round(report.mean_kl, 5),
                "positions": report.positions,
                "load_s": round(load_s, 2),
            }
        )
    ties = {str(nats): near_ties(ref, nats) for nats in NEAR_TIE_NATS}
    if args.json:
        print(json.dumps({"model": args.model, "variants": rows, "near_ties": ties}, indent=2))
        return
    print(f"model: {args.model}  ({len(PROMPTS)} prompts x {args.tokens} positions, teacher-forced)")
    print(
        f"{'variant':9} {'weights MB':>10} {'linears MB':>10} {'agreement':>9} {'matched':>9} "
        f"{'95% interval':>13} {'mean KL':>9}"
    )
    for r in rows:
        lo, hi = r["agreement_interval"]
        print(
            f"{r['variant']:9} {r['weights_mb']:10.1f} {r['linear_weights_mb']:10.1f} "
            f"{r['agreement']:9.3f} {r['matches']:4}/{r['positions']:<4} {lo:6.3f}-{hi:.3f} {r['mean_kl']:9.5f}"
        )
    print(
        "reference positions whose top two tokens are within "
        + ", ".join(f"{nats} nats: {n}" for nats, n in ties.items())
    )
    print("(embeddings/lm_head stay unquantized: the tied 49152x576 table is 113 MB of SmolLM2's fp32 weights)")


if __name__ == "__main__":
    main()
