"""An httpx transport with an O(1) connection pool, for thousands of concurrent upstream streams.

Why: httpcore's `AsyncConnectionPool` rescans every connection for every queued request each time a request
starts or a response closes, and its keep-alive check counts all connections once per idle connection: O(n^2)
per event. At ~1000 concurrent streams that alone consumed 70% of a core and stretched a 0.4 s stream to tens of
seconds in our measurements; it is how Python routers fall over at about that concurrency.

This transport keeps, per origin, a LIFO stack of idle HTTP/1.1 connections (httpcore's public
`AsyncHTTPConnection`, so the wire protocol, timeouts and TLS are httpcore's own). A request takes the most
recently used idle connection that is still usable (an idle connection the server closed reads as expired and is
dropped) or opens a new one; when its response is closed the connection goes back to the stack if it is idle and
the stack has room, else it is closed. A response closed before its body was fully read closes its connection, so
the upstream server sees the disconnect. `max_connections` bounds connections in use (requests beyond it wait up
to the pool timeout, then `httpx.PoolTimeout`); `max_keepalive_connections` bounds the idle ones.

Plain-http origins (the workers) use `gateway.h1.H1Connection` instead of httpcore's connection: the same
interface on httptools' C parser, at a fraction of httpcore's CPU per streamed chunk (the figures are there);
https origins stay on httpcore.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpcore
import httpx

from gateway.h1 import H1Connection, encode_request

# Most specific first: the first match wins.
_EXCEPTIONS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
)

Origin = tuple[bytes, bytes, int]
Connection = httpcore.AsyncHTTPConnection | H1Connection


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Upstream timeouts in seconds, httpx's four (None: no limit); `read` bounds each wait for data."""

    connect: float | None
    read: float | None
    write: float | None
    pool: float | None

    def as_extension(self) -> dict[str, float | None]:
        return {"connect": self.connect, "read": self.read, "write": self.write, "pool": self.pool}


class UpstreamStream(Protocol):
    """A response body: raw chunks as they arrive; `aclose` ends the response and frees its connection."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    def set_read_timeout(self, seconds: float | None) -> None:
        """From now on a wait for the next chunk ends in `httpx.ReadTimeout` after `seconds`."""

    async def aclose(self) -> None: ...


class UpstreamResponse(Protocol):
    """What `PooledTransport.open` returns: the status, the raw header list and the body stream."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> list[tuple[bytes, bytes]]: ...

    @property
    def stream(self) -> UpstreamStream: ...


@dataclass(frozen=True, slots=True)
class CoreResponse:
    """An https response (httpcore) in `UpstreamResponse`'s shape."""

    status: int
    headers: list[tuple[bytes, bytes]]
    stream: UpstreamStream


def header(response: UpstreamResponse, name: bytes) -> str | None:
    """The first value of header `name` (lowercase) in `response`, None when it has none."""
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def read_all(response: UpstreamResponse) -> bytes:
    """The whole body of `response` (the caller still closes it)."""
    return b"".join([chunk async for chunk in response.stream])


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except httpx.HTTPError:
        raise
    except Exception as exc:
        for source, target in _EXCEPTIONS:
            if isinstance(exc, source):
                raise target(str(exc)) from exc
        raise


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, stream: Any, release: Callable[[], None]) -> None:
        # httpcore's response stream: typed `Iterable[bytes] | AsyncIterable[bytes]`, async here (async pool)
        self._stream = stream
        self._release = release
        self._released = False
        self._read_timeout: float | None = None  # on top of httpcore's own, which stays the request's

    def set_read_timeout(self, seconds: float | None) -> None:
        self._read_timeout = seconds

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped():
            parts = aiter(self._stream)
            while True:
                try:
                    async with asyncio.timeout(self._read_timeout):
                        part = await anext(parts)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise httpx.ReadTimeout(f"no data for {self._read_timeout:g} s") from None
                yield part

    async def aclose(self) -> None:
        try:
            with _mapped():
                await self._stream.aclose()
        finally:
            if not self._released:
                self._released = True
                self._release()


class PooledTransport(httpx.AsyncBaseTransport):
    """See the module docstring."""

    def __init__(
        self,
        max_connections: int = 4096,
        max_keepalive_connections: int = 512,
        keepalive_expiry: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._max_idle = max_keepalive_connections
        self._expiry = keepalive_expiry
        self._ssl = ssl_context
        self._idle: dict[Origin, list[Connection]] = {}
        self._idle_count = 0
        self._in_use = 0
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def connections(self) -> int:
        """Open connections: in use plus idle."""
        return self._in_use + self._idle_count

    def _checkout(self, origin: Origin) -> Connection | None:
        stack = self._idle.get(origin)
        while stack:
            conn = stack.pop()
            self._idle_count -= 1
            if conn.is_idle() and not conn.has_expired():
                return conn
            self._close_later(conn)
        return None

    def _close_later(self, conn: Connection) -> None:
        if isinstance(conn, H1Connection):
            conn.close()
            return
        task = asyncio.ensure_future(conn.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _checkin(self, origin: Origin, conn: Connection) -> None:
        self._in_use -= 1
        self._slots.release()
        if conn.is_idle() and not conn.is_closed() and self._idle_count < self._max_idle:
            self._idle.setdefault(origin, []).append(conn)
            self._idle_count += 1
        elif not conn.is_closed():
            self._close_later(conn)

    async def _acquire(self, timeout: float | None) -> None:
        """Take a connection slot, waiting at most `timeout` seconds (`httpx.PoolTimeout`)."""
        if self._slots.locked():
            try:
                async with asyncio.timeout(timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no upstream connection slot became free in time") from None
        else:  # a free slot: no timer to set up
            await self._slots.acquire()
        self._in_use += 1

    def _h1(self, origin: Origin, conn: Connection | None) -> H1Connection:
        """`conn` when it is a plain-http connection (the idle one checked out), else a new one to `origin`."""
        if isinstance(conn, H1Connection):
            return conn
        return H1Connection(origin[1].decode("ascii"), origin[2], keepalive_expiry=self._expiry)

    def _core(self, origin: Origin, conn: Connection | None) -> httpcore.AsyncHTTPConnection:
        """`conn` when it is an httpcore connection (the idle one checked out), else a new one to `origin`."""
        if isinstance(conn, httpcore.AsyncHTTPConnection):
            return conn
        return httpcore.AsyncHTTPConnection(
            origin=httpcore.Origin(*origin), keepalive_expiry=self._expiry, ssl_context=self._ssl
        )

    async def _core_send(
        self, origin: Origin, core: httpcore.AsyncHTTPConnection, request: httpcore.Request
    ) -> httpcore.Response:
        """Send on an httpcore connection with httpx's errors; a failed send closes it and frees its slot."""
        try:
            with _mapped():
                return await core.handle_async_request(request)
        except BaseException:
            await core.aclose()
            self._checkin(origin, core)
            raise

    async def open(
        self, url: str, headers: list[tuple[bytes, bytes]], body: bytes, timeouts: Timeouts
    ) -> UpstreamResponse:
        """POST `body` to `url` and read the response head: the proxy's path, with no `httpx.Request` to build.

        The response's stream yields the raw body chunks; closing it returns the connection to the pool (or
        closes it when the body was not read to its end). Errors are httpx's, as for `handle_async_request`."""
        parts = urlsplit(url)
        scheme = parts.scheme.encode("ascii")
        host = (parts.hostname or "").encode("ascii")
        port = parts.port or (443 if scheme == b"https" else 80)
        origin: Origin = (scheme, host, port)
        target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
        await self._acquire(timeouts.pool)
        conn = self._checkout(origin)
        if scheme != b"http":
            return await self._core_open(origin, conn, target.encode("ascii"), headers, body, timeouts)
        h1 = self._h1(origin, conn)
        try:
            data, close_after = encode_request(b"POST", target.encode("ascii"), parts.netloc.encode(), headers, body)
            return await h1.request(
                data,
                close_after=close_after,
                connect=timeouts.connect,
                read=timeouts.read,
                write=timeouts.write,
                on_close=lambda: self._checkin(origin, h1),
            )
        except BaseException:
            h1.close()
            self._checkin(origin, h1)
            raise

    async def _core_open(
        self,
        origin: Origin,
        conn: Connection | None,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeouts: Timeouts,
    ) -> UpstreamResponse:
        """`open` for an https origin, on httpcore."""
        core = self._core(origin, conn)
        netloc = origin[1] if origin[2] == 443 else b"%s:%d" % (origin[1], origin[2])
        names = {name.lower() for name, _ in headers}
        if b"host" not in names:  # httpcore sends the headers it is given, nothing more
            headers = [(b"host", netloc), *headers]
        if b"content-length" not in names and b"transfer-encoding" not in names:
            headers = [*headers, (b"content-length", str(len(body)).encode())]
        request = httpcore.Request(
            method=b"POST",
            url=httpcore.URL(scheme=origin[0], host=origin[1], port=origin[2], target=target),
            headers=headers,
            content=body,
            extensions={"timeout": timeouts.as_extension()},
        )
        response = await self._core_send(origin, core, request)
        stream = _ResponseStream(response.stream, lambda: self._checkin(origin, core))
        return CoreResponse(response.status, response.headers, stream)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin: Origin = (url.raw_scheme, url.raw_host, url.port or (443 if url.raw_scheme == b"https" else 80))
        timeouts = request.extensions.get("timeout", {})
        await self._acquire(timeouts.get("pool"))
        conn = self._checkout(origin)
        if origin[0] == b"http":
            return await self._h1_request(request, origin, conn)
        core = self._core(origin, conn)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        response = await self._core_send(origin, core, core_request)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream, lambda: self._checkin(origin, core)),
            extensions=response.extensions,
        )

    async def _h1_request(self, request: httpx.Request, origin: Origin, conn: Connection | None) -> httpx.Response:
        h1 = self._h1(origin, conn)
        try:
            response = await h1.handle_async_request(request, on_close=lambda: self._checkin(origin, h1))
        except BaseException:
            h1.close()
            self._checkin(origin, h1)
            raise
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=response.stream,
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        for stack in self._idle.values():
            for conn in stack:
                await conn.aclose()
        self._idle.clear()
        self._idle_count = 0
        await asyncio.gather(*self._closing, return_exceptions=True)
