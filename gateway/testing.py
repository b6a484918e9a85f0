"""Helpers for testing and benchmarking the gateway: a real gateway (uvicorn on loopback) inside the caller's event
loop, stub workers, a discovery source with a fixed table, and a bounded poll.

Used by tests/gateway and bench/gateway.py; nothing here runs in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import httpx
import uvicorn

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.discovery import StaticBackend
from gateway.routing import DeploymentRoute, Endpoint, RevisionRoute, RoutingTable, VariantRoute
from gateway.settings import GatewaySettings
from gateway.sources import Source
from gateway.state import GatewayState
from gateway.stub import StubWorker


@dataclass
class RunningGateway:
    url: str
    state: GatewayState
    server: uvicorn.Server

    def client(self, **kw: object) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30, **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def run_gateway(
    source: Source,
    keys: dict[str, str] | None = None,
    settings: GatewaySettings | None = None,
    seed: int = 7,
) -> AsyncIterator[RunningGateway]:
    settings = settings or GatewaySettings(health_interval_seconds=0.05)
    app = create_app(settings, source, KeyStore(keys or {}, settings.default_tier), rng=random.Random(seed))
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
    try:
        yield RunningGateway(f"http://127.0.0.1:{port}", app.state.gateway, server)
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


def one_variant_table(model: str, workers: Sequence[StubWorker], variant: str = "default", tiers: tuple[str, ...] = ()) -> RoutingTable:
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


def variant_route(name: str, weight: float, workers: Sequence[StubWorker], tiers: tuple[str, ...] = (), revision: str = "r1") -> VariantRoute:
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
