"""The gateway benchmark runs end to end on a tiny load (its stub workers, a gateway process, the load generator),
so a change to the gateway's CLI or the bench's set-up cannot leave `bench/gateway_proxy.py` broken unnoticed.
Figures are not judged: only that every stream completed and the report has its shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gateway_proxy import cpu_seconds, load, stub_workers

from gateway.testing import spawn, wait_http_ok
from llmfleet.processes import free_ports

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gateway_benchmark_runs_and_reports() -> None:
    out = subprocess.run(
        [sys.executable, "bench/gateway_proxy.py", "--streams", "1,4", "--requests", "8", "--tokens", "4", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    report = json.loads(out)
    assert [r["streams"] for r in report["rows"]] == [1, 4]
    for r in report["rows"]:
        assert r["direct"]["errors"] == 0 and r["gateway"]["errors"] == 0
        assert "gateway_cpu_us_per_token" in r  # its value may be 0 on a tiny load (10 ms clock ticks)


async def test_the_floor_proxy_streams_every_token_and_spends_the_cpu_it_is_told_to() -> None:
    """`bench/null_proxy.py` (the Python floor of `bench/gateway_vs_router.py`) forwards streamed answers whole,
    round-robin over the workers, and `--spin-us` adds CPU per request: 100 requests at 20 ms each must cost the
    proxy at least 2 s of CPU (a lower bound only: its other work can only add)."""
    (port,) = free_ports(1)
    async with stub_workers(2, 0.0, 3) as urls:
        args = [str(ROOT / "bench" / "null_proxy.py"), "--port", str(port), "--spin-us", "20000", *urls]
        async with spawn(sys.executable, *args) as proxy:
            url = f"http://127.0.0.1:{port}"
            await wait_http_ok(url + "/ready")
            cpu0 = cpu_seconds(proxy.proc.pid)
            run = await load([url], 10, 10, 3, {})
            spent = cpu_seconds(proxy.proc.pid) - cpu0
    assert run.errors == 0 and run.tokens == 100 * 3
    assert spent >= 2.0
