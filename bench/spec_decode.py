"""Speculative decoding by prompt lookup: our engine with and without it, on a copy-heavy workload, in one run.

The workload is what prompt lookup is for: chat prompts that ask the model to repeat, lightly edit or continue
a passage given in the prompt ("repeat this passage", "fix the typo and rewrite it in full", ...), answered
greedily (so both runs produce the same tokens: the bench checks it) with the chat template of the model.

* batch 1: the requests one after another (`max_num_seqs=1`): inter-token latency p50 and p99 (time between
  a request's outputs divided by the tokens they carried, as bench/engine.py measures it) and tokens/s;
  target: ITL p50 with speculation <= 0.6x without.
* batch 64: 64 such requests at once (`max_num_seqs=64`), `--rounds` runs per system in ABBA order: tokens/s of
  the median run; target: no loss (speculation switches itself off while more than `disable_by_batch_size`
  requests decode).

Prints a table, the ratios, the acceptance rate, and as its LAST line one JSON object.

    .venv/bin/python bench/spec_decode.py                 # SmolLM2-135M fp32 (~4 min on 2 idle cores)
    .venv/bin/python bench/spec_decode.py --quick         # fewer and shorter requests: a smoke run
    .venv/bin/python bench/spec_decode.py --threads 1     # one torch thread (robust on a busy shared machine)
    .venv/bin/python bench/spec_decode.py --num-tokens 6 --lookup-max 4 --lookup-min 2 --disable-by-batch-size 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

PASSAGES = [
    "The river begins high in the mountains, where snow melts into small streams each spring. The streams join "
    "in a narrow valley and run past old stone bridges, quiet farms and a mill that has ground flour for two "
    "hundred years. By the time the water reaches the town it is wide and slow, and children fish from the "
    "wooden docks while boats carry apples and timber down to the sea.",
    "To install the tool, download the archive for your platform and unpack it into a folder of your choice. "
    "Add that folder to your PATH, open a new terminal and run the command with the --version flag to check "
    "that it works. If the command is not found, make sure the folder is on your PATH and that the file is "
    "marked as executable. Configuration lives in a file named config.toml in your home directory.",
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n"
    "            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n    return result\n",
    "Our meeting on Thursday covered three topics. First, the budget for the new year was approved with a small "
    "increase for training. Second, the office will move to the third floor in March, and each team will get "
    "a larger room. Third, we agreed to hold a short review every Friday afternoon to share progress and plan "
    "the next week.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into "
    "sugar and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, which "
    "contain the green pigment chlorophyll. The sugar feeds the plant, and the oxygen is released into the air "
    "that animals and people breathe.",
    "Dear Maria, thank you for your letter and for the photos of the garden. The roses look wonderful this "
    "year, and I can see that the new apple tree is growing well. We are all fine here. Tom has started his new "
    "job at the library and likes it very much. I hope to visit you in the summer. With love, Anna.",
]
INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word:\n\n{p}",
    "Rewrite the following passage in full, changing nothing but fixing any typo:\n\n{p}",
    "Copy this text:\n\n{p}",
    "Here is a passage. Write it out again exactly as it is.\n\n{p}",
]


def make_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = INSTRUCTIONS[i % len(INSTRUCTIONS)].format(p=PASSAGES[i % len(PASSAGES)])
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def make_llm(path: str, prompts: list[list[int]], *, max_tokens: int, max_num_seqs: int, dtype: str, speculative: Any):
    from engine import cache_blocks
    from worker.core.request import SamplingParams
    from worker.engine.llm import LLM

    need = sum(len(p) + max_tokens for p in prompts)
    llm = LLM(
        path,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        num_blocks=cache_blocks(need, len(prompts)),
        enable_prefix_caching=False,  # rounds repeat the prompts: keep the comparison about decoding
        speculative=speculative,
    )
    # Warm-up at full size (every prompt's prefill and a few decodes): the first large step of a process pays for
    # fresh memory (page faults on the KV cache and on the largest temporaries); neither system should pay it
    # inside its measurement.
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return llm


class Tally:
    """What one system measured, summed over its runs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.outputs: list[list[int]] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.wall = 0.0
        self.runs = 0
        self.run_tok_s: list[float] = []  # tokens/s of each run

    def run(self, llm: Any, prompts: list[list[int]], max_tokens: int) -> None:
        """All prompts at once (the engine's max_num_seqs decides the batch); greedy, EOS ends a request."""
        from worker.core.request import SamplingParams

        core = llm.engine
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        outputs: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            rid = f"{self.runs}-{i}"
            core.add_request(rid, prompt, params)
            outputs[rid] = []
        last: dict[str, float] = {}
        while core.has_unfinished_requests():
            outs = core.step()
            now = time.perf_counter()
            for o in outs:
                if not o.new_token_ids:
                    continue
                self.tokens += len(o.new_token_ids)
                outputs[o.request_id] += o.new_token_ids
                if o.request_id in last:
                    self.itl.append((now - last[o.request_id]) / len(o.new_token_ids))
                last[o.request_id] = now
        wall = time.perf_counter() - t0
        self.wall += wall
        self.run_tok_s.append(sum(len(v) for v in outputs.values()) / wall)
        self.outputs += [outputs[f"{self.runs}-{i}"] for i in range(len(prompts))]
        self.runs += 1

    def summary(self, llm: Any) -> dict[str, Any]:
        result: dict[str, Any] = {
            "system": self.name,
            "runs": self.runs,
            "wall_s": round(self.wall, 2),
            "tokens": self.tokens,
            "tok_s": round(self.tokens / self.wall, 2),
            "tok_s_median_run": round(pct(self.run_tok_s, 50), 2),
            "itl_p50_ms": round(pct(self.itl, 50) * 1e3, 2),
            "itl_p99_ms": round(pct(self.itl, 99) * 1e3, 2),
        }
        stats = llm.engine.stats().spec_decode
        if stats is not None:
            result |= {
                "drafts": stats.num_drafts,
                "draft_tokens": stats.num_draft_tokens,
                "accepted_tokens": stats.num_accepted_tokens,
                "acceptance_rate": round(stats.acceptance_rate, 3),
            }
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled://smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="3 requests at batch 1, 16 at 'batch 64', 48 tokens")
    ap.add_argument("--batch1-requests", type=int, default=6)
    ap.add_argument("--batch-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4, help="runs of the big batch per system (ABBA order)")
    ap.add_argument("--num-tokens", type=int, default=None, help="drafts per step (default: the engine's)")
    ap.add_argument("--lookup-max", type=int, default=None)
    ap.add_argument("--lookup-min", type=int, default=None)
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's). 1 is far less sensitive to other load on a shared machine: "
        "with all cores busy elsewhere, every OpenMP barrier of a multi-threaded step waits for a descheduled thread",
    )
    args = ap.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    from worker.core.config import SpeculativeConfig
    from worker.model.source import resolve_model_source
    from worker.model.tokenizer import Tokenizer

    given = {
        "num_speculative_tokens": args.num_tokens,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    spec = SpeculativeConfig(**{k: v for k, v in given.items() if v is not None})
    path = str(resolve_model_source(args.model))
    tokenizer = Tokenizer(path)
    n1, nb, max_tokens = args.batch1_requests, args.batch_requests, args.max_tokens
    if args.quick:
        n1, nb, max_tokens = min(n1, 3), min(nb, 16), min(max_tokens, 48)
    prompts1 = make_prompts(tokenizer, n1)
    prompts_b = make_prompts(tokenizer, nb)

    def progress(name: str) -> None:
        print(f"[bench] {time.strftime('%H:%M:%S')} {name} ...", file=sys.stderr, flush=True)

    common = dict(max_tokens=max_tokens, dtype=args.dtype)
    # Batch 1: each request on both engines back to back (alternating which goes first), so that load from
    # elsewhere on the machine hits both alike.
    progress(f"batch 1: {n1} requests, each without and with speculation")
    plain_llm = make_llm(path, prompts1, max_num_seqs=1, speculative=None, **common)
    spec_llm = make_llm(path, prompts1, max_num_seqs=1, speculative=spec, **common)
    b1 = {"plain": Tally("batch1_plain"), "spec": Tally("batch1_spec")}
    for i, prompt in enumerate(prompts1):
        order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
        for key in order:
            b1[key].run(plain_llm if key == "plain" else spec_llm, [prompt], max_tokens)
    results = [b1["plain"].summary(plain_llm), b1["spec"].summary(spec_llm)]
    del plain_llm, spec_llm
    # Batch N: whole runs in the order plain, spec, spec, plain, ... (ABBA cancels a linear drift in load).
    plain_llm = make_llm(path, prompts_b, max_num_seqs=nb, speculative=None, **common)
    spec_llm = make_llm(path, prompts_b, max_num_seqs=nb, speculative=spec, **common)
    bb = {"plain": Tally(f"batch{nb}_plain"), "spec": Tally(f"batch{nb}_spec")}
    for r in range(args.rounds):
        for key in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
            progress(f"batch {nb}: round {r + 1}/{args.rounds}, {key}")
            bb[key].run(plain_llm if key == "plain" else spec_llm, prompts_b, max_tokens)
    results += [bb["plain"].summary(plain_llm), bb["spec"].summary(spec_llm)]
    identical = b1["plain"].outputs == b1["spec"].outputs and bb["plain"].outputs == bb["spec"].outputs
    b1_plain, b1_spec, bb_plain, bb_spec = results
    ratios = {
        "batch1_itl_p50_spec_over_plain": round(b1_spec["itl_p50_ms"] / b1_plain["itl_p50_ms"], 3),
        "batch1_tok_s_spec_over_plain": round(b1_spec["tok_s_median_run"] / b1_plain["tok_s_median_run"], 3),
        # the median run of each: one run hit by a load spike from elsewhere does not decide it
        f"batch{nb}_tok_s_spec_over_plain": round(bb_spec["tok_s_median_run"] / bb_plain["tok_s_median_run"], 3),
    }
    print(f"{'system':<16}{'tok/s':>9}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'accept':>9}{'wall s':>9}")
    for r in results:
        acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
        print(
            f"{r['system']:<16}{r['tok_s']:>9.1f}{r['itl_p50_ms']:>12.2f}{r['itl_p99_ms']:>12.2f}{acc:>9}"
            f"{r['wall_s']:>9.1f}"
        )
    for k, v in ratios.items():
        print(f"{k}: {v}")
    print(f"greedy outputs identical with and without speculation: {identical}")
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "threads": args.threads,
                "speculative": spec.model_dump(),
                "max_tokens": max_tokens,
                "outputs_identical": identical,
                "ratios": ratios,
                "systems": results,
            }
        )
    )


if __name__ == "__main__":
    main()
