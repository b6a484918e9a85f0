"""Bounded soak: 1000 concurrent SSE streams through `llmfleet gateway` (its own process) to stub workers (another
process) on loopback: zero errors, every token delivered, and afterwards no leaked tasks, requests or connections.
Each stream is 20 tokens 50 ms apart, so 1000 of them overlap even on a slow machine."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

from gateway.testing import parse_metrics, spawn, wait_http_ok
from gateway.transport import PooledTransport
from llmfleet.processes import free_ports

STREAMS = 1000
TOKENS = 20
KEY = "sk-soak-test-key"


async def metrics(base: str) -> dict[str, float]:
    """The gateway's series, from its internal metrics port."""
    async with httpx.AsyncClient(base_url=base, timeout=10, trust_env=False) as c:
        return parse_metrics((await c.get("/metrics")).text)


async def stub_stats(urls: list[str]) -> list[dict]:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as c:
        return [(await c.get(u + "/stats")).json() for u in urls]


@pytest.mark.slow
async def test_soak_1000_concurrent_streams(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY} soak\n")
    # per-key limits stay on, sized so the soak itself is never refused (the default tiers cap a key's concurrency)
    tier = {
        "name": "soak",
        "priority": 20,
        "bypass_queue": True,
        "requests_per_minute": 1_000_000,
        "tokens_per_minute": 1_000_000_000,
        "max_concurrent_requests": 2 * STREAMS,
    }
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"tiers": [tier], "default_tier": "soak"}))
    port, metrics_port = free_ports(2)
    metrics_base = f"http://127.0.0.1:{metrics_port}"
    async with spawn(
        sys.executable,
        "-m",
        "gateway.stub",
        "--count",
        "4",
        "--delay",
        "0.05",
        "--tokens",
        str(TOKENS),
        ready_prefix="listening on",
    ) as stub:
        urls = stub.first_line.removeprefix("listening on ").split()
        args = [
            "-m",
            "llmfleet.cli",
            "gateway",
            "--port",
            str(port),
            "--backend",
            "soak=" + ",".join(urls),
            "--api-keys-file",
            str(keys),
            "--config",
            str(config),
            "--log-level",
            "warning",
            "--metrics-port",
            str(metrics_port),
        ]
        async with spawn(sys.executable, *args) as _gateway:
            base = f"http://127.0.0.1:{port}"
            await wait_http_ok(base + "/ready")
            # the load generator uses the gateway's O(1) pool too: httpx's default pool is O(n^2) at this concurrency
            transport = PooledTransport(max_keepalive_connections=STREAMS)
            headers = {"authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(
                base_url=base, timeout=60, transport=transport, trust_env=False, headers=headers
            ) as c:
                # warm up one stream, then take the baseline
                r = await c.post(
                    "/v1/chat/completions",
                    json={"model": "soak", "stream": True, "messages": [{"role": "user", "content": "warm"}]},
                )
                assert r.status_code == 200
                before = await metrics(metrics_base)

                async def one(i: int) -> tuple[int, int, bool]:
                    body = {"model": "soak", "stream": True, "messages": [{"role": "user", "content": f"request {i}"}]}
                    async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                        data = (await resp.aread()).decode()
                    return resp.status_code, data.count("data: {"), data.rstrip().endswith("data: [DONE]")

                async with asyncio.timeout(120):
                    results = await asyncio.gather(*(one(i) for i in range(STREAMS)), return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                assert errors == [], f"{len(errors)} streams failed, first: {errors[:1]!r}"
                assert all(r == (200, TOKENS, True) for r in results), [r for r in results if r != (200, TOKENS, True)][
                    :5
                ]

                # afterwards: the gateway's task count returns to the baseline and nothing is outstanding
                after = await metrics(metrics_base)
                for _ in range(200):
                    if after["llmfleet_gateway_asyncio_tasks"] <= before["llmfleet_gateway_asyncio_tasks"]:
                        break
                    await asyncio.sleep(0.05)
                    after = await metrics(metrics_base)
            assert after["llmfleet_gateway_asyncio_tasks"] == before["llmfleet_gateway_asyncio_tasks"]
            assert after["llmfleet_gateway_in_flight_requests"] == 0
            assert all(
                v == 0 for k, v in after.items() if k.startswith("llmfleet_gateway_backend_outstanding_requests")
            )
            assert after['llmfleet_gateway_requests_total{adapter="",model="soak",status="200"}'] == STREAMS + 1
            assert sum(v for k, v in after.items() if k.startswith("llmfleet_gateway_errors_total")) == 0
            stats = await stub_stats(urls)
            assert sum(s["completed"] for s in stats) == STREAMS + 1
            assert sum(s["disconnects"] for s in stats) == 0 and sum(s["active"] for s in stats) == 0
            # the streams really overlapped (each lasts >= 1 s): print the peak for the record, require a quarter
            peak = sum(s["max_connections"] for s in stats)
            print(f"peak concurrent upstream connections: {peak}")
            assert peak >= STREAMS // 4
            # upstream connections: only idle keep-alive ones remain, bounded by the pool, and both ends agree
            # (each stub counts the connection its /stats answer travels on: minus one each)
            for _ in range(100):
                upstream = (await metrics(metrics_base))["llmfleet_gateway_upstream_connections"]
                stub_side = sum(s["connections"] - 1 for s in await stub_stats(urls))
                if stub_side == upstream:
                    break
                await asyncio.sleep(0.05)
            assert upstream <= 512
            assert stub_side == upstream
