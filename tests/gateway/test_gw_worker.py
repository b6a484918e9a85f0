"""The gateway in front of the real worker server (around its fake engine): a client disconnect frees the engine's
request and KV cache, and a draining worker's 503 sends requests to another worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from gateway.routing import DeploymentRoute, Endpoint, RevisionRoute, RoutingTable, VariantRoute
from gateway.sources import StaticSource
from gateway.testing import FixedSource, StaticBackend, chat, eventually, run_gateway

fake_engine = pytest.importorskip("worker.server.fake_engine")
serve = pytest.importorskip("worker.server.serve")
worker_settings = pytest.importorskip("worker.server.settings")


@contextlib.asynccontextmanager
async def workers(n: int, **engine_kw: object) -> AsyncIterator[list]:
    """n live workers on 127.0.0.1 in this event loop; yields (server, engine, url) triples."""
    started = []
    try:
        for _ in range(n):
            engine = fake_engine.FakeEngine(**engine_kw)
            settings = worker_settings.WorkerSettings(
                model="fake://fake-model", engine="fake", host="127.0.0.1", port=0
            )
            server = serve.WorkerServer(engine, settings, configure_logging=False, log_level="warning")
            task = asyncio.create_task(server.serve())
            started.append((server, engine, task))
            await eventually(lambda s=server, t=task: s.server.started or t.done(), "the worker started")
            await eventually(lambda s=server: s.service.loaded, "the engine loaded")
        yield [(s, e, f"http://127.0.0.1:{s.port}") for s, e, _ in started]
    finally:
        for server, _, _task in started:
            server.server.should_exit = True
        await asyncio.gather(*(t for _, _, t in started), return_exceptions=True)


async def test_client_disconnect_frees_the_workers_request_and_kv_cache() -> None:
    async with workers(1, itl_s=0.02) as [(server, engine, url)]:
        source = StaticSource([StaticBackend("fake-model", "default", (url,))])
        async with run_gateway(source, open_mode=True) as gw, gw.client() as c:
            body = chat(model="fake-model", stream=True, max_tokens=1000)
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for chunk in r.aiter_raw():
                    seen += chunk.count(b"data:")
                    if seen >= 3:
                        break
                assert engine.stats().num_running == 1 and engine.stats().kv_cache_usage > 0
            await eventually(lambda: len(set(engine.aborted)) == 1, "the engine aborted the request")
            await eventually(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0, "KV freed")
            assert len(server.service.inflight) == 0
            assert gw.state.outstanding == {}


async def test_a_draining_workers_503_is_retried_on_another_worker() -> None:
    async with workers(2) as [(draining, d_engine, d_url), (_, engine, url)]:
        eps = tuple(Endpoint(url=u, name=u, variant="default", revision="r") for u in (d_url, url))
        table = RoutingTable(
            {
                "fake-model": DeploymentRoute(
                    "fake-model",
                    "fake-model",
                    variants=(VariantRoute("default", 1, revisions=(RevisionRoute("r", 1, eps),)),),
                )
            }
        )
        draining.service.begin_drain("test")  # lame duck: answers 503 + Retry-After to new requests
        async with run_gateway(FixedSource(table), open_mode=True) as gw, gw.client() as c:
            for i in range(6):
                r = await c.post("/v1/chat/completions", json=chat(model="fake-model", stream=i % 2 == 0, max_tokens=4))
                assert r.status_code == 200, r.text
    assert d_engine.submitted == [] and len(engine.submitted) == 6
