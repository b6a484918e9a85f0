"""The O(1) upstream pool: keep-alive reuse, bounds, disconnect on early close, pool timeout, stale connections."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.testing import eventually, stubs
from gateway.transport import PooledTransport


def client(t: PooledTransport, **kw: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=t, **{"timeout": 10, **kw})  # type: ignore[arg-type]


async def test_keep_alive_connections_are_reused() -> None:
    async with stubs(1, tokens=3) as (w,):
        t = PooledTransport()
        async with client(t) as c:
            for _ in range(5):
                r = await c.post(w.url + "/v1/completions", json={"prompt": "x"})
                assert r.json()["choices"][0]["text"] == "tok0 tok1 tok2 "
            assert t.connections == 1 and w.stats.max_connections == 1
        assert t.connections == 0
        await eventually(lambda: w.stats.connections == 0, "closing the client closed its idle connection")


async def test_idle_connections_are_bounded() -> None:
    async with stubs(1, delay=0.01, tokens=5) as (w,):
        t = PooledTransport(max_keepalive_connections=3)
        async with client(t) as c:
            await asyncio.gather(
                *(c.post(w.url + "/v1/completions", json={"prompt": "x", "stream": True}) for _ in range(10))
            )
            assert w.stats.max_connections == 10
            assert t.connections == 3
            await eventually(lambda: w.stats.connections == 3, "surplus connections were closed")


async def test_closing_a_response_early_closes_its_connection() -> None:
    async with stubs(1, delay=0.01, tokens=1000) as (w,):
        t = PooledTransport()
        async with client(t) as c:
            async with c.stream("POST", w.url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                async for _ in r.aiter_raw():
                    break
            assert t.connections == 0
            await eventually(
                lambda: w.stats.disconnects == 1 and w.stats.connections == 0, "the server saw the disconnect"
            )


async def test_pool_timeout_when_every_slot_is_busy() -> None:
    async with stubs(1, mode="hang") as (w,):
        t = PooledTransport(max_connections=1)
        async with client(t, timeout=httpx.Timeout(10, pool=0.1)) as c:
            hung = asyncio.create_task(c.post(w.url + "/v1/completions", json={}))
            await eventually(lambda: w.stats.active == 1, "the first request holds the slot")
            with pytest.raises(httpx.PoolTimeout):
                await c.post(w.url + "/v1/completions", json={})
            hung.cancel()
            await asyncio.gather(hung, return_exceptions=True)
            assert t.connections == 0


async def test_an_idle_connection_closed_by_the_server_is_not_reused() -> None:
    async with stubs(1, tokens=1) as (w,):
        t = PooledTransport()
        async with client(t) as c:
            assert (await c.post(w.url + "/v1/completions", json={})).status_code == 200
            for writer in list(w._conns.values()):  # the server closes its idle keep-alive connection
                writer.close()
            await eventually(lambda: w.stats.connections == 0, "the server closed it")
            assert (await c.post(w.url + "/v1/completions", json={})).status_code == 200
            assert w.stats.requests == 2


async def test_connect_errors_are_httpx_errors_and_free_the_slot() -> None:
    t = PooledTransport(max_connections=1)
    async with client(t) as c:
        for _ in range(3):
            with pytest.raises(httpx.ConnectError):
                await c.get("http://127.0.0.1:9/")  # discard port: nothing listens
    assert t.connections == 0
