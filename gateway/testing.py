"""Helpers for testing and benchmarking the gateway: a real gateway (uvicorn on loopback) inside the caller's event
loop, stub workers, a discovery source with a fixed table, and a bounded poll.

Used by tests/gateway and bench/gateway_proxy.py; nothing here runs in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import httpx
import uvicorn

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.discovery import StaticBackend
from gateway.routing import (
    DeploymentRoute,
    Endpoint,
    RevisionRoute,
    RoutingTable,
    VariantRoute,
)
from gateway.settings import GatewaySettings
from gateway.sources import Source
from gateway.state import GatewayState
from gateway.stub import StubWorker


@dataclass
class RunningGateway:
    url: str
    state: GatewayState
    server: uvicorn.Server
    metrics_url: str  # the internal metrics server's base URL (GET {metrics_url}/metrics)

    def client(self, **kw: object) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30, **kw)  # type: ignore[arg-type]

    async def metrics_text(self) -> str:
        """The exposition the internal metrics server serves."""
        async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
            r = await c.get(self.metrics_url + "/metrics")
            r.raise_for_status()
            return r.text


@contextlib.asynccontextmanager
async def run_gateway(
    source: Source,
    keys: dict[str, str] | None = None,
    settings: GatewaySettings | None = None,
    seed: int = 7,
    open_mode: bool = False,
) -> AsyncIterator[RunningGateway]:
    """A gateway on free loopback ports (its metrics server too, whatever `settings` say) authenticating with
    `keys`; without keys it refuses every request (fail closed) unless `open_mode` asks for open mode by name.
    A Kubernetes source with a Secret replaces the key store when it starts."""
    settings = (settings or GatewaySettings(health_interval_seconds=0.05)).model_copy(
        update={"metrics_host": "127.0.0.1", "metrics_port": 0}
    )
    if open_mode and keys:
        raise ValueError("open_mode accepts everyone: give keys or open_mode, not both")
    store = KeyStore.open(settings.default_tier) if open_mode else KeyStore(keys or {}, settings.default_tier)
    app = create_app(settings, source, store, rng=random.Random(seed))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", backlog=4096)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        task.cancel()
        raise RuntimeError("the gateway did not start")
    port = server.servers[0].sockets[0].getsockname()[1]
    assert app.metrics_server is not None, "run_gateway always sets a metrics port"
    try:
        yield RunningGateway(
            f"http://127.0.0.1:{port}", app.gateway, server, f"http://127.0.0.1:{app.metrics_server.port}"
        )
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def stubs(n: int, **kw: object) -> AsyncIterator[list[StubWorker]]:
    workers = [await StubWorker(**kw).start() for _ in range(n)]  # type: ignore[arg-type]
    try:
        yield workers
    finally:
        for w in workers:
            await w.stop()


def static(model: str, workers: Sequence[StubWorker], variant: str = "default") -> StaticBackend:
    return StaticBackend(model=model, variant=variant, urls=tuple(w.url for w in workers))


@dataclass
class FixedSource:
    """A discovery source publishing a table the test builds (and may replace with `publish`)."""

    table: RoutingTable
    state: GatewayState | None = None

    async def start(self, state: GatewayState) -> None:
        self.state = state
        state.set_table(self.table)

    async def stop(self) -> None:
        self.state = None

    def publish(self, table: RoutingTable) -> None:
        assert self.state is not None
        self.table = table
        self.state.set_table(table)


def one_variant_table(
    model: str, workers: Sequence[StubWorker], variant: str = "default", tiers: tuple[str, ...] = ()
) -> RoutingTable:
    return RoutingTable(
        {
            model: DeploymentRoute(
                model=model,
                name=model,
                namespace="ns",
                variants=(variant_route(variant, 1, workers, tiers=tiers),),
            )
        }
    )


def variant_route(
    name: str, weight: float, workers: Sequence[StubWorker], tiers: tuple[str, ...] = (), revision: str = "r1"
) -> VariantRoute:
    eps = tuple(Endpoint(url=w.url, name=w.url, variant=name, revision=revision) for w in workers)
    return VariantRoute(name=name, weight=weight, tiers=frozenset(tiers), revisions=(RevisionRoute(revision, 1, eps),))


async def eventually(predicate: Callable[[], bool], what: str, attempts: int = 500, step: float = 0.01) -> None:
    """Poll a condition a bounded number of times (behaviour, not timing: the bound is generous)."""
    for _ in range(attempts):
        if predicate():
            return
        await asyncio.sleep(step)
    raise AssertionError(f"never happened: {what}")


def chat(model: str = "m", stream: bool = False, content: str = "hello", **extra: object) -> dict[str, object]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": content}], **extra}


@dataclass
class Process:
    """A child process started by `spawn`; `stop` terminates it (then kills it) and reaps it."""

    proc: asyncio.subprocess.Process
    first_line: str
    output: list[str] = field(default_factory=list)  # the last lines it printed after the first (bounded)
    _drain: asyncio.Task[None] | None = None

    async def _keep_reading(self) -> None:
        """Read the rest of its output so a full pipe never blocks it."""
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.output.append(line.decode(errors="replace").rstrip())
            del self.output[:-200]

    async def stop(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@contextlib.asynccontextmanager
async def spawn(
    *args: str, ready_prefix: str = "", timeout: float = 60.0, env: dict[str, str] | None = None
) -> AsyncIterator[Process]:
    """Run a child process; wait (bounded) for a stdout line starting with `ready_prefix` when one is given."""
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT if ready_prefix else None, env=env
    )
    p = Process(proc, "")
    try:
        if ready_prefix:
            assert proc.stdout is not None
            async with asyncio.timeout(timeout):
                while not p.first_line.startswith(ready_prefix):
                    line = await proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"{args[0]} exited before printing {ready_prefix!r}")
                    p.first_line = line.decode().strip()
            p._drain = asyncio.create_task(p._keep_reading())
        yield p
    finally:
        await p.stop()


async def wait_http_ok(url: str, attempts: int = 600, step: float = 0.05) -> None:
    """Poll GET url until it answers 200 (bounded)."""
    async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
        for _ in range(attempts):
            try:
                if (await c.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(step)
    raise RuntimeError(f"{url} never answered 200")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text -> {series: value} (series with labels as written)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
