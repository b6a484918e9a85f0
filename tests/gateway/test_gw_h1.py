"""The lean HTTP/1.1 upstream connection (`gateway.h1`): framing, streaming, keep-alive, errors as httpx raises
them, early close, timeouts, cancellation and backpressure, against the stub worker and tiny servers written here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import uvloop

from gateway import h1
from gateway.h1 import H1Connection
from gateway.testing import eventually, stubs

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


# pytest-asyncio deprecates overriding `event_loop_policy` for a conftest hook that would reach every test of the
# folder; this module alone runs on both loops, so it keeps the fixture and silences the notice.
pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture')


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Every test on both loops: the gateway runs on uvloop, whose transports differ from asyncio's."""
    return uvloop.EventLoopPolicy() if request.param == "uvloop" else asyncio.DefaultEventLoopPolicy()


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[int]:
    """A loopback server running `handler` per connection; yields its port."""
    tasks: set[asyncio.Task[None]] = set()

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(reader, writer)
        except (asyncio.CancelledError, ConnectionError):
            pass  # stopped by the test's end, or the client went away
        finally:
            writer.close()
            tasks.discard(task)

    srv = await asyncio.start_server(conn, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await srv.wait_closed()


async def read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def request(url: str, read: float = 10.0, **kw: object) -> httpx.Request:
    r = httpx.Request(kw.pop("method", "POST"), url, **kw)  # type: ignore[arg-type]
    r.extensions["timeout"] = {"connect": 5.0, "read": read, "write": 5.0, "pool": 5.0}
    return r


async def body_of(response: h1.H1Response) -> bytes:
    parts = [part async for part in response.stream]
    await response.stream.aclose()
    return b"".join(parts)


async def test_a_content_length_response_then_keep_alive_reuse() -> None:
    async with stubs(1, tokens=3) as (w,):
        conn = H1Connection("127.0.0.1", w.port)
        for _ in range(2):
            r = await conn.handle_async_request(request(w.url + "/v1/completions", json={"prompt": "x"}))
            assert r.status == 200 and r.extensions["http_version"] == b"HTTP/1.1"
            assert json.loads(await body_of(r))["choices"][0]["text"] == "tok0 tok1 tok2 "
            assert conn.is_idle() and not conn.has_expired()
        assert w.stats.requests == 2 and w.stats.max_connections == 1  # one connection for both
        await conn.aclose()
        await conn.aclose()  # idempotent
        assert conn.is_closed()
        await eventually(lambda: w.stats.connections == 0, "the server saw the close")


async def test_a_chunked_stream_is_delivered_as_it_arrives() -> None:
    first_seen = asyncio.Event()
    sent_last = False

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent_last
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"d\r\ndata: first\n\n\r\n")
        await writer.drain()
        await asyncio.wait_for(first_seen.wait(), 10)  # the last event waits for the client to see the first
        sent_last = True
        writer.write(b"c\r\ndata: last\n\n\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with server(handler) as port:
        conn = H1Connection("127.0.0.1", port)
        r = await conn.handle_async_request(request(f"http://127.0.0.1:{port}/s", content=b"{}"))
        chunks = aiter(r.stream)
        assert await anext(chunks) == b"data: first\n\n"
        assert not sent_last
        first_seen.set()
        assert await anext(chunks) == b"data: last\n\n"
        with pytest.raises(StopAsyncIteration):
            await anext(chunks)
        await r.stream.aclose()
        assert conn.is_idle()
        await conn.aclose()


async def test_the_stub_stream_through_the_pool_reuses_one_connection() -> None:
    from gateway.transport import PooledTransport

    async with stubs(1, delay=0.001, tokens=5) as (w,):
        t = PooledTransport()
        async with httpx.AsyncClient(transport=t, timeout=10) as c:
            for _ in range(3):
                body = json.dumps({"prompt": "x", "stream": True}).encode()
                async with c.stream("POST", w.url + "/v1/completions", content=body) as r:
                    events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                assert len(events) == 6 and events[-1] == "data: [DONE]"
            assert t.connections == 1 and w.stats.max_connections == 1


async def test_a_server_that_closes_before_the_head_is_a_remote_protocol_error() -> None:
    async with stubs(1, mode="reset") as (w,):
        conn = H1Connection("127.0.0.1", w.port)
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await conn.handle_async_request(request(w.url + "/v1/completions", json={}))
        assert conn.is_closed()


async def test_a_body_cut_short_raises_from_the_body_iterator() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
        await writer.drain()

    async with server(handler) as port:
        conn = H1Connection("127.0.0.1", port)
        r = await conn.handle_async_request(request(f"http://127.0.0.1:{port}/", content=b"x"))
        chunks = aiter(r.stream)
        assert await anext(chunks) == b"0123456789"  # what arrived comes first
        with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
            await anext(chunks)
        await r.stream.aclose()
        assert conn.is_closed()


async def test_a_reset_mid_stream_raises_an_httpx_error() -> None:
    async with stubs(1, mode="midstream", fail_after=2, tokens=10, delay=0.001) as (w,):
        conn = H1Connection("127.0.0.1", w.port)
        r = await conn.handle_async_request(request(w.url + "/v1/completions", json={"stream": True}))
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            async for _ in r.stream:
                pass
        await r.stream.aclose()
        assert conn.is_closed()


async def test_a_malformed_response_is_a_remote_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n")
        await reader.read()

    async with server(handler) as port:
        conn = H1Connection("127.0.0.1", port)
        with pytest.raises(httpx.RemoteProtocolError, match="malformed"):
            await conn.handle_async_request(request(f"http://127.0.0.1:{port}/", content=b"x"))
        assert conn.is_closed()


async def test_a_refused_connect_is_a_connect_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = H1Connection("127.0.0.1", port)
    with pytest.raises(httpx.ConnectError):
        await conn.handle_async_request(request(f"http://127.0.0.1:{port}/", content=b"x"))
    assert conn.is_closed()


async def test_closing_a_response_early_closes_the_socket() -> None:
    async with stubs(1, delay=0.01, tokens=1000) as (w,):
        conn = H1Connection("127.0.0.1", w.port)
        r = await conn.handle_async_request(request(w.url + "/v1/completions", json={"stream": True}))
        assert await anext(aiter(r.stream))
        closed = []
        r.stream._on_close = lambda: closed.append(1)
        await r.stream.aclose()
        await r.stream.aclose()
        assert closed == [1] and conn.is_closed()
        await eventually(lambda: w.stats.disconnects == 1 and w.stats.connections == 0, "the server saw EOF")


async def test_an_idle_connection_the_server_closed_reads_as_expired() -> None:
    async with stubs(1, tokens=1) as (w,):
        conn = H1Connection("127.0.0.1", w.port)
        r = await conn.handle_async_request(request(w.url + "/v1/completions", json={}))
        await body_of(r)
        assert conn.is_idle() and not conn.has_expired()
        for writer in list(w._conns.values()):
            writer.close()
        await eventually(conn.has_expired, "the closed idle connection reads as expired")
        await eventually(conn.is_closed, "and then as closed")


async def test_an_idle_connection_with_a_high_descriptor_is_reused() -> None:
    """A gateway with a thousand streams has sockets numbered above 1024, where select() refuses to look: the
    staleness check must still see an idle, healthy connection as reusable."""
    spare = socket.socket()
    held = [os.dup(spare.fileno()) for _ in range(1100)]  # push the next descriptors past 1024
    try:
        async with stubs(1, tokens=1) as (w,):
            conn = H1Connection("127.0.0.1", w.port)
            await body_of(await conn.handle_async_request(request(w.url + "/v1/completions", json={})))
            assert conn._fd >= 1024
            assert conn.is_idle() and not conn.has_expired()
            await conn.aclose()
    finally:
        for fd in held:
            os.close(fd)
        spare.close()


async def test_an_idle_connection_expires_after_keepalive_expiry() -> None:
    async with stubs(1, tokens=1) as (w,):
        conn = H1Connection("127.0.0.1", w.port, keepalive_expiry=0.05)
        await body_of(await conn.handle_async_request(request(w.url + "/v1/completions", json={})))
        assert not conn.has_expired()
        await asyncio.sleep(0.1)
        assert conn.has_expired()
        await conn.aclose()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA",  # bytes after the end: never reused
    ],
)
async def test_a_response_that_does_not_keep_alive_closes_its_connection(answer: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(answer)
        await reader.read()

    async with server(handler) as port:
        conn = H1Connection("127.0.0.1", port)
        r = await conn.handle_async_request(request(f"http://127.0.0.1:{port}/", content=b"x"))
        assert await body_of(r) == b"ok"
        assert conn.is_closed()


async def test_a_body_delimited_by_the_close_and_an_informational_head() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nx-a: 1\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        writer.close()

    async with server(handler) as port:
        conn = H1Connection("127.0.0.1", port)
        r = await conn.handle_async_request(request(f"http://127.0.0.1:{port}/", content=b"x"))
        assert r.status == 200 and r.headers == [(b"x-a", b"1")]
        assert await body_of(r) == b"part one, part two"
        assert conn.is_closed()


async def test_request_framing_length_chunked_and_host() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await read_head(reader)
            if b"transfer-encoding: chunked" in head.lower():
                body = await reader.readuntil(b"0\r\n\r\n")
            else:
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
            seen.append(head + body)
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

    async def parts() -> AsyncIterator[bytes]:
        yield b"ab"
        yield b"cd"

    async with server(handler) as port:
        url = f"http://127.0.0.1:{port}/p?q=1"
        conn = H1Connection("127.0.0.1", port)
        for req in (request(url, content=b"hello"), request(url, content=parts()), request(url, content=[b"x", b"y"])):
            r = await conn.handle_async_request(req)
            assert r.status == 204 and await body_of(r) == b""
            assert conn.is_idle()
        await conn.aclose()
    assert seen[0].startswith(b"POST /p?q=1 HTTP/1.1\r\n")
    assert f"host: 127.0.0.1:{port}\r\n".encode() in seen[0].lower()
    assert seen[0].endswith(b"\r\n\r\nhello")
    assert seen[1].endswith(b"\r\n\r\n4\r\nabcd\r\n0\r\n\r\n")  # collected, then sent as one chunk
    assert seen[2].endswith(b"\r\n\r\n2\r\nxy\r\n0\r\n\r\n")  # a sync iterable: no length known either


async def test_a_header_with_a_line_break_is_refused() -> None:
    conn = H1Connection("127.0.0.1", 9)
    with pytest.raises(httpx.LocalProtocolError):
        await conn.handle_async_request(request("http://127.0.0.1:9/", content=b"", headers={"x-a": "1\r\nx-b: 2"}))


async def test_a_head_that_never_comes_is_a_read_timeout() -> None:
    async with stubs(1, mode="hang") as (w,):
        conn = H1Connection("127.0.0.1", w.port)
        with pytest.raises(httpx.ReadTimeout):
            await conn.handle_async_request(request(w.url + "/v1/completions", read=0.1, json={}))
        assert conn.is_closed()
        await eventually(lambda: w.stats.connections == 0, "the server saw the close")


async def one_chunk_then_silence(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server that sends a response head and one body chunk, then nothing (a stalled stream)."""
    await read_head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n")
    await reader.read()


@pytest.mark.parametrize("while_waiting", [False, True], ids=["before-the-wait", "during-the-wait"])
async def test_a_shorter_read_timeout_set_after_the_head_applies_to_the_body(while_waiting: bool) -> None:
    """The proxy waits long for the first byte (queue + TTFT), then switches to the shorter between-chunks timeout:
    the timer armed with the long one must not decide when a stalled body fails."""

    async with server(one_chunk_then_silence) as port:
        conn = H1Connection("127.0.0.1", port)
        r = await conn.handle_async_request(request(f"http://127.0.0.1:{port}/", read=3600, content=b"x"))
        chunks = aiter(r.stream)
        assert await anext(chunks) == b"ok"
        loop = asyncio.get_running_loop()
        started = loop.time()
        if while_waiting:
            waiting = asyncio.ensure_future(anext(chunks))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            r.stream.set_read_timeout(0.1)
        else:
            r.stream.set_read_timeout(0.1)
            waiting = asyncio.ensure_future(anext(chunks))
        with pytest.raises(httpx.ReadTimeout):
            await asyncio.wait_for(waiting, 60)  # the old timer would fire after an hour
        assert loop.time() - started < 30
        assert conn.is_closed()


async def test_a_stalled_body_is_a_read_timeout() -> None:
    async with server(one_chunk_then_silence) as port:
        conn = H1Connection("127.0.0.1", port)
        r = await conn.handle_async_request(request(f"http://127.0.0.1:{port}/", read=0.1, content=b"x"))
        with pytest.raises(httpx.ReadTimeout):
            await body_of(r)
        assert conn.is_closed()


async def test_a_cancelled_request_leaves_no_connection() -> None:
    async with stubs(1, mode="hang") as (w,):
        conn = H1Connection("127.0.0.1", w.port)
        task = asyncio.create_task(conn.handle_async_request(request(w.url + "/v1/completions", json={})))
        await eventually(lambda: w.stats.active == 1, "the request reached the server")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert conn.is_closed()
        await eventually(lambda: w.stats.connections == 0, "the server saw the close")


async def test_a_cancelled_body_read_then_aclose_leaves_no_connection() -> None:
    async with stubs(1, delay=0.5, tokens=10) as (w,):
        conn = H1Connection("127.0.0.1", w.port)
        r = await conn.handle_async_request(request(w.url + "/v1/completions", json={"stream": True}))
        chunks = aiter(r.stream)
        await anext(chunks)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await anext(chunks)
        await r.stream.aclose()
        assert conn.is_closed()
        await eventually(lambda: w.stats.connections == 0, "the server saw the close")


async def test_a_slow_reader_pauses_the_socket_then_gets_everything() -> None:
    size = 8 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)
    server_blocked = asyncio.Event()
    sent_all = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for i in range(0, size, 64 * 1024):
            writer.write(payload[i : i + 64 * 1024])
            if writer.transport.get_write_buffer_size() > 0:
                server_blocked.set()  # the client is not reading: the kernel buffers are full
            await writer.drain()
        sent_all.set()
        await reader.read()

    async with server(handler) as port:
        conn = H1Connection("127.0.0.1", port)
        r = await conn.handle_async_request(request(f"http://127.0.0.1:{port}/", content=b"x"))
        await asyncio.wait_for(server_blocked.wait(), 10)
        await asyncio.sleep(0.1)
        assert conn._paused and not sent_all.is_set()
        assert conn._buffered <= h1._HIGH_WATER + 1024 * 1024  # bounded by the high-water mark plus one read
        got = bytearray()
        async for part in r.stream:
            got += part
            await asyncio.sleep(0)
        await r.stream.aclose()
        assert bytes(got) == payload and sent_all.is_set()
        assert conn.is_idle()
        await conn.aclose()
