"""A lean HTTP/1.1 client connection for plain-http upstreams: an `asyncio.Protocol` fed to httptools' C parser.

Why: the gateway's CPU per streamed token was 48-81 us at 64-512 streams against 12-22 us for vllm-router (Rust).
A cProfile of the gateway at 512 streams put ~1.2 s of the proxy pump's 1.72 s on the upstream read path (httpx
`aiter_raw` -> httpcore `http11._receive_event` -> h11's pure-Python parsing and anyio stream reads), against
0.29 s for sending to the client. Here one upstream read is one `data_received` call, one `feed_data` into
llhttp (which also decodes chunked bodies) and one `on_body` callback appending to a list; the reader takes what
is there, waiting on a future only when nothing is.

`H1Connection` offers what `gateway.transport.PooledTransport` uses of httpcore's `AsyncHTTPConnection`:
`handle_async_request`, `is_idle`, `has_expired`, `is_closed` and `aclose` (plus a synchronous `close`). It takes
the `httpx.Request` as it is (no httpcore request to build) and returns an `H1Response` whose stream is an
`httpx.AsyncByteStream`. https stays on httpcore.

Behaviour:
- The request head and body go out in one `transport.write`; a body given as an iterable (sync or async) is
  collected first, sent with its `content-length`, or chunk-encoded when the request says `transfer-encoding:
  chunked`.
- Body chunks are delivered as they arrive; chunks that arrived before the reader asked are joined. More than
  `_HIGH_WATER` bytes unread pauses reading from the socket until the reader takes them (backpressure).
- The connection is reusable (idle) once the whole response was received, the server and the request agreed on
  keep-alive and the response was closed; a response closed before its end closes the connection, so the server
  sees the disconnect. An idle connection the server closed (or wrote to) reads as expired.
- Timeouts (`request.extensions["timeout"]`, httpx semantics): connect bounds the TCP connect, write the wait for
  a full send buffer to drain, read each wait for data (the head and every body chunk). The read timeout is one
  lazily re-armed timer per connection, not a timer per chunk.
- Errors are httpx's, as httpcore would raise them: a failed connect is `ConnectError` (`ConnectTimeout`), a
  server that closes before the response head `RemoteProtocolError` ("Server disconnected without sending a
  response."), a reset `ReadError`, a body cut short or a malformed response `RemoteProtocolError`, a read that
  waited too long `ReadTimeout`.

Imports: the standard library, httptools, and httpx for its exception and stream types; nothing else of ours.
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import Callable, Iterable
from typing import Any, cast

import httptools
import httpx

_HIGH_WATER = 256 * 1024  # unread body bytes above which reading from the socket pauses

_NEW, _ACTIVE, _IDLE, _CLOSED = range(4)
_NO_BODY_STATUS = frozenset({204, 304})


async def _collect(stream: Any) -> bytes:
    """The whole body of an httpx request stream (bytes given as content, or a sync/async iterable)."""
    if isinstance(stream, httpx.ByteStream):  # content given as bytes
        return b"".join(stream)
    if hasattr(stream, "__aiter__"):
        return b"".join([part async for part in stream])
    return b"".join(stream)


def encode_request(
    method: bytes, target: bytes, netloc: bytes, headers: Iterable[tuple[bytes, bytes]], body: bytes
) -> tuple[bytes, bool]:
    """A request's head and body as one buffer, and whether it asked for `connection: close`.

    A `Host` header is added when `headers` has none (`netloc`); the body is sent with its `content-length`, or
    chunk-encoded when the headers say `transfer-encoding: chunked`. A header holding CR or LF is refused
    (`httpx.LocalProtocolError`): it would split the request."""
    out = [method, b" ", target, b" HTTP/1.1\r\n"]
    has_host = chunked = close_after = False
    length: bytes | None = None
    for name, value in headers:
        if b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name:
            raise httpx.LocalProtocolError(f"invalid character in the header {name!r}")
        lower = name.lower()
        if lower == b"host":
            has_host = True
        elif lower == b"content-length":
            length = value
        elif lower == b"transfer-encoding":
            chunked = value.lower() == b"chunked"
        elif lower == b"connection" and value.lower() == b"close":
            close_after = True
        out += (name, b": ", value, b"\r\n")
    if not has_host:
        out[4:4] = (b"Host: ", netloc, b"\r\n")
    if chunked:
        body = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)) if body else b"0\r\n\r\n"
    elif length is not None:
        if length.strip() != str(len(body)).encode():
            raise httpx.LocalProtocolError("content-length does not match the body")
    elif body or method in (b"POST", b"PUT", b"PATCH"):
        out += (b"Content-Length: ", str(len(body)).encode(), b"\r\n")
    out += (b"\r\n", body)
    return b"".join(out), close_after


class H1Response:
    """A response head and its body stream (the attributes of `httpcore.Response` the pool uses)."""

    __slots__ = ("extensions", "headers", "status", "stream")

    def __init__(
        self, status: int, headers: list[tuple[bytes, bytes]], stream: _Body, extensions: dict[str, Any]
    ) -> None:
        self.status = status
        self.headers = headers
        self.stream = stream
        self.extensions = extensions


class _Body(httpx.AsyncByteStream):
    """The body of one response: iterating yields its chunks as they arrive; `aclose` ends the response (and
    calls `on_close` once)."""

    def __init__(self, conn: H1Connection, on_close: Callable[[], None] | None) -> None:
        self._conn = conn
        self._on_close = on_close
        self._closed = False

    def __aiter__(self) -> _Body:
        return self

    def set_read_timeout(self, seconds: float | None) -> None:
        """From now on each wait for the next chunk ends in `httpx.ReadTimeout` after `seconds` (the connection's
        one lazily re-armed timer: no timer per chunk)."""
        self._conn.set_read_timeout(seconds)

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        conn = self._conn
        if not conn._chunks:
            if conn._body_done:
                raise StopAsyncIteration
            await conn._wait()
            if not conn._chunks:
                raise StopAsyncIteration
        return conn._take()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._conn._response_closed()
        if self._on_close is not None:
            self._on_close()


class H1Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to `host:port`, one request at a time; see the module docstring."""

    def __init__(self, host: str, port: int, keepalive_expiry: float | None = None) -> None:
        self._host = host
        self._port = port
        self._expiry = keepalive_expiry
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: asyncio.Transport | None = None
        self._fd = -1
        self._parser = httptools.HttpResponseParser(self)
        self._state = _NEW
        self._idle_since = 0.0
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None
        # the response being read
        self._head_request = False
        self._close_after = False  # the request asked for `connection: close`
        self._status = 0
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_done = False
        self._informational = False
        self._body_done = False
        self._until_eof = False  # a body delimited by the server closing the connection
        self._keep_alive = False
        self._extra = False  # bytes after the end of the response: never reuse
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._error: httpx.HTTPError | None = None
        self._waiter: asyncio.Future[None] | None = None
        # the read timeout: one timer, re-armed lazily from the start of the current wait
        self._read_timeout: float | None = None
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- the pool's interface ---------------------------------------------------------------------------------

    def is_idle(self) -> bool:
        return self._state == _IDLE

    def is_closed(self) -> bool:
        return self._state == _CLOSED

    def has_expired(self) -> bool:
        """Closed, idle past the keep-alive expiry, or idle with something to read (the server closed it or
        wrote to it, and the loop has not run the callbacks yet)."""
        if self._state == _CLOSED:
            return True
        if self._state != _IDLE:
            return False
        assert self._loop is not None
        if self._expiry is not None and self._loop.time() - self._idle_since > self._expiry:
            return True
        # poll, not select: select() refuses descriptors >= 1024, which a gateway with a thousand streams has
        poller = select.poll()
        try:
            poller.register(self._fd, select.POLLIN)
            events = poller.poll(0)
        except (OSError, ValueError):
            return True
        return bool(events)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection now (idempotent); a reader waiting on it gets a `ReadError`."""
        if self._state == _CLOSED:
            return
        self._state = _CLOSED
        if self._transport is not None:
            self._transport.close()
        self._cancel_timer()
        if not self._body_done and self._error is None:
            self._error = httpx.ReadError("the connection was closed")
        self._wake()
        self._wake_drain()

    async def handle_async_request(
        self, request: httpx.Request, on_close: Callable[[], None] | None = None
    ) -> H1Response:
        """Send an `httpx.Request` and read the response head; `on_close` runs once when the response is closed."""
        timeouts = request.extensions.get("timeout") or {}
        try:
            data, close_after = encode_request(
                request.method.encode("ascii"),
                request.url.raw_path or b"/",
                request.url.netloc,
                request.headers.raw,
                await _collect(request.stream),
            )
        except httpx.LocalProtocolError as e:
            e.request = request
            raise
        try:
            return await self.request(
                data,
                head=request.method == "HEAD",
                close_after=close_after,
                connect=timeouts.get("connect"),
                read=timeouts.get("read"),
                write=timeouts.get("write"),
                on_close=on_close,
            )
        except httpx.HTTPError as e:
            e.request = request
            raise

    async def request(
        self,
        data: bytes,
        *,
        head: bool = False,
        close_after: bool = False,
        connect: float | None = None,
        read: float | None = None,
        write: float | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> H1Response:
        """Send an encoded request (`encode_request`) and read the response head: the proxy's path, with no
        `httpx.Request` to build. `head`: it is a HEAD request (no body follows the head); `close_after`: it asked
        for `connection: close`. Timeouts in seconds (None: none); `on_close` runs once when the response is
        closed."""
        if self._state == _ACTIVE or self._state == _CLOSED:
            raise RuntimeError(f"an HTTP/1.1 connection in state {self._state} cannot take a request")
        self._head_request = head
        self._close_after = close_after
        try:
            if self._transport is None:
                await self._connect(connect)
            transport = self._transport
            assert transport is not None
            if self._state == _CLOSED or transport.is_closing():
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            self._start_response(read)
            transport.write(data)
            if self._write_paused:
                await self._drained(write)
            while not self._head_done:
                await self._wait()
        except BaseException:
            self.close()
            raise
        version = self._parser.get_http_version()
        extensions = {"http_version": b"HTTP/" + version.encode(), "reason_phrase": self._reason}
        return H1Response(self._status, self._headers, _Body(self, on_close), extensions)

    # -- sending ------------------------------------------------------------------------------------------

    async def _connect(self, timeout: float | None) -> None:
        loop = self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: self, self._host, self._port)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {self._host}:{self._port} timed out") from None
        except OSError as e:
            raise httpx.ConnectError(str(e) or type(e).__name__) from None

    async def _drained(self, timeout: float | None) -> None:
        assert self._loop is not None
        self._drain = self._loop.create_future()
        try:
            async with asyncio.timeout(timeout):
                await self._drain
        except TimeoutError:
            raise httpx.WriteTimeout("sending the request timed out") from None
        finally:
            self._drain = None
        if self._state == _CLOSED:
            raise httpx.WriteError("the connection was closed while sending the request")

    def _wake_drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- reading ------------------------------------------------------------------------------------------

    def _start_response(self, read_timeout: float | None) -> None:
        self._state = _ACTIVE
        self._status = 0
        self._reason = b""
        self._headers = []
        self._head_done = self._informational = self._body_done = self._until_eof = False
        self._keep_alive = self._extra = False
        self._chunks = []
        self._buffered = 0
        self._error = None
        self._read_timeout = read_timeout

    async def _wait(self) -> None:
        """Wait until the parser delivers something; raise the response's error if it failed."""
        if self._error is None:
            loop = self._loop
            assert loop is not None
            fut = self._waiter = loop.create_future()
            if self._read_timeout is not None:
                self._since = loop.time()
                if self._timer is None:
                    self._timer = loop.call_at(self._since + self._read_timeout, self._check_timeout)
            try:
                await fut
            finally:
                self._waiter = None
        if self._error is not None and not self._chunks:
            raise type(self._error)(str(self._error))  # a fresh one per raise

    def set_read_timeout(self, seconds: float | None) -> None:
        """The read timeout from now on; a timer armed with the old one is re-armed with the new."""
        self._read_timeout = seconds
        self._cancel_timer()
        fut = self._waiter
        if seconds is not None and fut is not None and not fut.done() and self._loop is not None:
            self._timer = self._loop.call_at(self._since + seconds, self._check_timeout)

    def _wake(self) -> None:
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _check_timeout(self) -> None:
        self._timer = None
        fut = self._waiter
        if fut is None or fut.done() or self._read_timeout is None:
            return  # not waiting now: the next wait re-arms
        assert self._loop is not None
        due = self._since + self._read_timeout
        if self._loop.time() >= due:
            self._fail(httpx.ReadTimeout(f"no data from {self._host}:{self._port} for {self._read_timeout:g} s"))
        else:
            self._timer = self._loop.call_at(due, self._check_timeout)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, error: httpx.HTTPError) -> None:
        """The response failed: the reader gets `error` after what arrived before it; the connection closes."""
        if self._error is None and not self._body_done:
            self._error = error
        self.close()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            if self._transport is not None and self._state == _ACTIVE:
                self._transport.resume_reading()
        return data

    def _response_closed(self) -> None:
        if self._state != _ACTIVE:
            return
        self._cancel_timer()
        self._chunks = []
        self._buffered = 0
        if self._body_done and self._keep_alive and not self._extra and not self._close_after:
            assert self._loop is not None and self._transport is not None
            if self._paused:
                self._paused = False
                self._transport.resume_reading()
            self._state = _IDLE
            self._idle_since = self._loop.time()
        else:
            self.close()

    # -- asyncio.Protocol -----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        if self._state != _ACTIVE or self._body_done:
            if self._state != _CLOSED:  # bytes outside a response: the server is confused; never reuse
                self._extra = True
                if self._state == _IDLE:
                    self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("the server switched protocols; only HTTP/1.1 is supported"))
        except httptools.HttpParserError as e:
            self._fail(httpx.RemoteProtocolError(f"malformed response from {self._host}:{self._port}: {e}"))

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._state == _ACTIVE and not self._body_done and self._error is None:
            if exc is not None:
                self._error = httpx.ReadError(str(exc) or type(exc).__name__)
            elif not self._head_done:
                self._error = httpx.RemoteProtocolError("Server disconnected without sending a response.")
            elif self._until_eof:
                self._body_done = True  # the close delimits the body
            else:
                self._error = httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        self._state = _CLOSED
        self._cancel_timer()
        self._wake()
        self._wake_drain()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    # -- httptools callbacks --------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._body_done:
            self._extra = True

    def on_status(self, status: bytes) -> None:
        if not self._extra:
            self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._extra:
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._extra:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # informational: the real head follows
            self._informational = True
            self._headers = []
            self._reason = b""
            return
        self._status = status
        self._head_done = True
        if self._head_request or status in _NO_BODY_STATUS:
            if self._head_request:  # llhttp would read a body the server does not send: never reuse
                self._extra = True
                self._body_done = True
        else:
            delimited = False
            for name, _ in self._headers:
                if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
                    delimited = True
            self._until_eof = not delimited
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._extra:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self._extra or self._body_done:
            return
        self._body_done = True
        self._keep_alive = self._parser.should_keep_alive()
        self._cancel_timer()
        self._wake()
