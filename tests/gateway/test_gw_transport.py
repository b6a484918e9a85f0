"""The O(1) upstream pool: keep-alive reuse, bounds, disconnect on early close, pool timeout, stale connections, and
`open` (the proxy's path) over http and https."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator

import httpx
import pytest
import trustme

from gateway.testing import eventually, stubs
from gateway.transport import PooledTransport, Timeouts, header, read_all


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


# ------------------------------------------------------------------ PooledTransport.open: the proxy's direct path

TIMEOUTS = Timeouts(connect=5, read=10, write=5, pool=5)


async def test_open_streams_a_plain_http_answer_and_reuses_the_connection() -> None:
    async with stubs(1, tokens=3) as (w,):
        t = PooledTransport()
        for _ in range(3):
            r = await t.open(w.url + "/v1/completions", [(b"content-type", b"application/json")], b"{}", TIMEOUTS)
            try:
                assert r.status == 200 and header(r, b"content-type") == "application/json"
                assert json.loads(await read_all(r))["choices"][0]["text"] == "tok0 tok1 tok2 "
            finally:
                await r.stream.aclose()
        assert t.connections == 1 and w.stats.max_connections == 1
        await t.aclose()


@contextlib.asynccontextmanager
async def tls_server(stall_after: int | None = None) -> AsyncIterator[tuple[int, ssl.SSLContext, list[bytes]]]:
    """An https server answering each request with a chunked body of three chunks (or `stall_after` chunks, then
    nothing); yields its port, a client context trusting it, and the request heads it read."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                heads.append(head)
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for i in range(3 if stall_after is None else stall_after):
                    writer.write(b"8\r\ndata: %d\n\r\n" % i)
                    await writer.drain()
                if stall_after is not None:
                    await reader.read()
                    return
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    try:
        yield srv.sockets[0].getsockname()[1], client_ctx, heads
    finally:
        srv.close()


async def test_open_over_https_streams_and_reuses_the_connection() -> None:
    async with tls_server() as (port, ctx, heads):
        t = PooledTransport(ssl_context=ctx)
        for _ in range(2):
            r = await t.open(f"https://127.0.0.1:{port}/v1/chat/completions?x=1", [], b'{"a":1}', TIMEOUTS)
            try:
                assert r.status == 200 and header(r, b"content-type") == "text/event-stream"
                assert await read_all(r) == b"data: 0\ndata: 1\ndata: 2\n"
            finally:
                await r.stream.aclose()
        assert t.connections == 1
        assert len(heads) == 2 and all(h.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n") for h in heads)
        assert all(b"host: 127.0.0.1:%d" % port in h.lower() for h in heads)
        await t.aclose()


async def test_a_stalled_https_body_is_a_read_timeout_once_set() -> None:
    async with tls_server(stall_after=1) as (port, ctx, _):
        t = PooledTransport(ssl_context=ctx)
        r = await t.open(f"https://127.0.0.1:{port}/", [], b"{}", TIMEOUTS)
        chunks = aiter(r.stream)
        assert await anext(chunks) == b"data: 0\n"
        r.stream.set_read_timeout(0.1)
        with pytest.raises(httpx.ReadTimeout):
            await asyncio.wait_for(anext(chunks), 30)
        await r.stream.aclose()
        assert t.connections == 0  # a body not read to its end closes its connection
        await t.aclose()
