"""Gateway overhead: TTFT, per-token latency and throughput through the gateway vs direct to the same workers.

Stub workers (one process, `gateway.stub`: one SSE event per token, `--delay` seconds apart) stand in for the
engine so the numbers isolate the gateway. For each concurrency (default 1, 64 and 512 concurrent streams) the
same load runs twice, direct (round-robin over the workers) and through `llmfleet gateway` (its own process, with
API-key auth and per-key limits on), and the report gives the ratios gateway/direct. Every loop is bounded in count and time.

    .venv/bin/python bench/gateway_proxy.py                          # 1, 64, 512 streams, 32 tokens, 10 ms apart
    .venv/bin/python bench/gateway_proxy.py --streams 1,64 --tokens 16 --json
    .venv/bin/python bench/gateway_proxy.py --stacks uvloop,asyncio   # the default server stack vs asyncio + h11

The load generator, the workers and the gateway share the machine's cores, so absolute figures depend on it;
the ratios are the point. TTFT is measured from sending the request to the first `data:` event; per-token
latency (ITL) is (last event - first event) / (tokens - 1) of a stream, so bursts count as they are felt;
throughput is tokens delivered per second over the run. The gateway's own CPU time per request and per token
(Linux /proc) is the figure least disturbed by other load on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.testing import spawn, wait_http_ok
from gateway.transport import PooledTransport
from llmfleet.processes import free_ports

KEY = "sk-bench-gateway-key"
# The gateway's server stacks (`llmfleet gateway --loop/--http`): the default, uvloop + httptools, against plain
# asyncio + h11, the stack it ran on before; `--stacks` picks which to run, one gateway process each.
STACKS = {
    "uvloop": ["--loop", "uvloop", "--http", "httptools"],
    "asyncio": ["--loop", "asyncio", "--http", "h11"],
}


@dataclass
class Run:
    ttft: list[float]
    itl: list[float]
    tokens: int
    errors: int
    seconds: float

    def summary(self) -> dict[str, float]:
        return {
            "ttft_p50_ms": 1000 * statistics.median(self.ttft) if self.ttft else float("nan"),
            "ttft_p95_ms": 1000 * _p95(self.ttft),
            "itl_p50_ms": 1000 * statistics.median(self.itl) if self.itl else float("nan"),
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "errors": self.errors,
        }


def gateway_config(path: Path, streams: int) -> None:
    """Limits on, sized so that the load itself is never refused: the cost of checking them is what we measure."""
    tier = {
        "name": "premium",
        "priority": 20,
        "bypass_queue": True,
        "requests_per_minute": 10_000_000,
        "tokens_per_minute": 10_000_000_000,
        "max_concurrent_requests": 2 * streams,
    }
    path.write_text(json.dumps({"tiers": [tier], "default_tier": "premium"}))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), 0.0 where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _p95(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.95 * len(s)))]


async def one_stream(c: httpx.AsyncClient, url: str, tokens: int, i: int, run: Run) -> None:
    body = {
        "model": "bench",
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": f"request {i}"}],
    }
    start = time.perf_counter()
    first = last = None
    n = 0
    async with c.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            run.errors += 1
            await r.aread()
            return
        async for chunk in r.aiter_raw():
            events = chunk.count(b"data: {")
            if not events:
                continue
            last = time.perf_counter()
            if first is None:
                first = last
                run.ttft.append(first - start)
            n += events
    if n != tokens:
        run.errors += 1
    run.tokens += n
    if first is not None and last is not None and n > 1:
        run.itl.append((last - first) / (n - 1))  # time per output token after the first


async def load(urls: list[str], streams: int, per_stream: int, tokens: int, headers: dict[str, str]) -> Run:
    """`streams` concurrent clients, each sending `per_stream` streamed requests one after another."""
    run = Run([], [], 0, 0, 0.0)
    transport = PooledTransport(max_keepalive_connections=max(streams, 16))
    async with httpx.AsyncClient(transport=transport, timeout=120, headers=headers, trust_env=False) as c:

        async def client(k: int) -> None:
            for j in range(per_stream):
                url = urls[(k * per_stream + j) % len(urls)] + "/v1/chat/completions"
                try:
                    await one_stream(c, url, tokens, k * per_stream + j, run)
                except httpx.HTTPError:
                    run.errors += 1

        start = time.perf_counter()
        async with asyncio.timeout(600):
            await asyncio.gather(*(client(k) for k in range(streams)))
        run.seconds = time.perf_counter() - start
    return run


@contextlib.asynccontextmanager
async def stub_workers(count: int, delay: float, tokens: int) -> AsyncIterator[list[str]]:
    """`count` stub workers (one process, `gateway.stub`); yields their base URLs."""
    args = ["-m", "gateway.stub", "--count", str(count), "--delay", str(delay), "--tokens", str(tokens)]
    async with spawn(sys.executable, *args, ready_prefix="listening on") as stub:
        yield stub.first_line.removeprefix("listening on ").split()


@contextlib.asynccontextmanager
async def gateway_process(urls: list[str], streams: int, extra: Sequence[str] = ()) -> AsyncIterator[Gateway]:
    """`llmfleet gateway` in its own process routing model `bench` to `urls`, with one premium key (`KEY`) and
    limits sized for `streams` (`gateway_config`); yields it once `/ready` answers."""
    with tempfile.TemporaryDirectory() as tmp:
        keys, config = Path(tmp) / "keys.txt", Path(tmp) / "gateway.json"
        keys.write_text(f"{KEY} premium\n")
        gateway_config(config, streams)
        port, metrics_port = free_ports(2)
        gw_args = [
            *("-m", "llmfleet.cli", "gateway", "--port", str(port), "--backend", "bench=" + ",".join(urls)),
            *("--api-keys-file", str(keys), "--config", str(config), "--log-level", "warning"),
            *("--metrics-port", str(metrics_port), *extra),
        ]
        async with spawn(sys.executable, *gw_args) as proc:
            url = f"http://127.0.0.1:{port}"
            await wait_http_ok(url + "/ready")
            yield Gateway(url, proc.proc.pid, {"authorization": f"Bearer {KEY}"})


@dataclass(frozen=True)
class Gateway:
    """A running proxy process: its URL, its pid (for CPU time) and the headers that authenticate to it."""

    url: str
    pid: int
    auth: dict[str, str]


async def bench(args: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    async with stub_workers(args.workers, args.delay, args.tokens) as urls:
        for stack in args.stacks:
            async with gateway_process(urls, max(args.streams), STACKS[stack]) as gw:
                rows += await bench_gateway(args, urls, gw, stack)
    return rows


async def bench_gateway(args: argparse.Namespace, urls: list[str], gw: Gateway, stack: str) -> list[dict[str, object]]:
    """The load levels against one gateway process running on `stack` (see STACKS), each also run direct."""
    rows: list[dict[str, object]] = []
    await load([gw.url], 1, 2, args.tokens, gw.auth)  # warm up both paths
    await load(urls, 1, 2, args.tokens, {})
    for streams in args.streams:
        per_stream = min(args.max_per_stream, max(1, args.requests // streams))
        direct = (await load(urls, streams, per_stream, args.tokens, {})).summary()
        cpu0 = cpu_seconds(gw.pid)
        through_run = await load([gw.url], streams, per_stream, args.tokens, gw.auth)
        cpu = cpu_seconds(gw.pid) - cpu0
        through = through_run.summary()
        rows.append(
            {
                "stack": stack,
                "streams": streams,
                "requests": streams * per_stream,
                "direct": direct,
                "gateway": through,
                "ttft_added_ms": through["ttft_p50_ms"] - direct["ttft_p50_ms"],
                "ttft_ratio": through["ttft_p50_ms"] / direct["ttft_p50_ms"],
                "itl_added_ms": through["itl_p50_ms"] - direct["itl_p50_ms"],
                "itl_ratio": through["itl_p50_ms"] / direct["itl_p50_ms"],
                "throughput_ratio": through["tokens_per_s"] / direct["tokens_per_s"],
                "gateway_cpu_ms_per_request": 1000 * cpu / (streams * per_stream),
                "gateway_cpu_us_per_token": 1e6 * cpu / max(1, through_run.tokens),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,64,512", help="comma-separated concurrency levels")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per streamed answer")
    ap.add_argument("--delay", type=float, default=0.01, help="seconds between tokens at the stub workers")
    ap.add_argument("--workers", type=int, default=4, help="stub workers (one process)")
    ap.add_argument("--requests", type=int, default=1024, help="requests per run (at least one per stream)")
    ap.add_argument("--max-per-stream", type=int, default=16, help="most requests one stream sends in a run")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument(
        "--stacks",
        default="uvloop",
        help=f"comma-separated gateway stacks of {sorted(STACKS)}; with two, their gateway CPU per token is compared",
    )
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    args.stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    unknown = [s for s in args.stacks if s not in STACKS]
    if unknown:
        ap.error(f"unknown stack(s) {unknown}; known: {sorted(STACKS)}")
    rows = asyncio.run(bench(args))
    if args.json:
        print(
            json.dumps({"cpus": os.cpu_count(), "tokens": args.tokens, "delay_s": args.delay, "rows": rows}, indent=2)
        )
        return
    print(
        f"gateway vs direct: {args.workers} stub workers, {args.tokens} tokens/answer {1000 * args.delay:.0f} ms apart, "
        f"{os.cpu_count()} CPUs shared by load generator, workers and gateway"
    )
    head = (
        f"{'stack':>8} {'streams':>7} {'TTFT p50 direct/gw ms':>22} {'+ms':>7} {'ratio':>6} {'ITL p50 direct/gw ms':>21} {'+ms':>6} "
        f"{'ratio':>6} {'tok/s direct/gw':>16} {'ratio':>6} {'errors':>6} {'gw CPU ms/req':>13} {'us/token':>8}"
    )
    print(head)
    for r in rows:
        d, g = r["direct"], r["gateway"]
        print(
            f"{r['stack']:>8} {r['streams']:>7} {d['ttft_p50_ms']:>10.2f}/{g['ttft_p50_ms']:<11.2f} {r['ttft_added_ms']:>7.2f} {r['ttft_ratio']:>6.2f} "  # type: ignore[index]
            f"{d['itl_p50_ms']:>10.2f}/{g['itl_p50_ms']:<10.2f} {r['itl_added_ms']:>6.2f} {r['itl_ratio']:>6.2f} "  # type: ignore[index]
            f"{d['tokens_per_s']:>7.0f}/{g['tokens_per_s']:<8.0f} {r['throughput_ratio']:>6.2f} {d['errors'] + g['errors']:>6} "  # type: ignore[index]
            f"{r['gateway_cpu_ms_per_request']:>13.2f} {r['gateway_cpu_us_per_token']:>8.0f}"
        )
    if len(args.stacks) == 2:
        first, second = args.stacks
        cpu = {(r["stack"], r["streams"]): r["gateway_cpu_us_per_token"] for r in rows}
        for streams in args.streams:
            ratio = cpu[(first, streams)] / cpu[(second, streams)]  # type: ignore[operator]
            print(f"gateway CPU per token at {streams} streams: {first}/{second} = {ratio:.2f}")


if __name__ == "__main__":
    main()
