"""A stand-in OpenAI worker for gateway tests and benchmarks: raw asyncio HTTP/1.1, cheap enough for thousands of
concurrent streams on one core, and scriptable to misbehave.

It answers `POST /v1/chat/completions` and `/v1/completions` (SSE when `stream` is true: one `data:` event per
token (`tokens_per_event` tokens per event: what a stop string that holds text back looks like), `max_tokens`
tokens (default `tokens`), `delay` seconds apart, a usage event when `stream_options.include_usage` asks for it,
then `[DONE]`; else one JSON body with `usage`), `GET /ready`, `GET /stats` (its counters as JSON) and
`GET /v1/models`. Its `mode` makes it answer as the worker does: 503 `draining` (with Retry-After), 503
`engine_dead` (the engine died, maybe because of this very request), 429 `queue_full`, 429 `tokenizer_busy`, a
429 with another code, 400 (a client error); or hang before the first byte, close the connection before answering
(reset), or fail mid-stream after `fail_after` events. It records every request, every client disconnect before
completion, and its open connections.

Run as a process: `python -m gateway.stub --count 4 --delay 0.01` (prints `listening on URL URL ...`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

MODES = ("ok", "400", "503", "engine_dead", "429", "429_tokenizer", "429_other", "hang", "reset", "midstream")
# mode -> (status, body, headers) of the error answers; the bodies carry the worker's codes
# (worker_image/worker/server: admission.py, generation.py, tokenizing.py, app.py)
_ERRORS: dict[str, tuple[int, bytes, dict[str, str]]] = {
    "503": (503, b'{"error": {"message": "draining", "code": "draining"}}', {"retry-after": "2"}),
    "engine_dead": (
        503,
        b'{"error": {"message": "the engine has failed", "code": "engine_dead"}}',
        {"retry-after": "1"},
    ),
    "400": (400, b'{"error": {"message": "max_tokens too large", "code": "bad_request"}}', {}),
    "429": (429, b'{"error": {"message": "queue full", "code": "queue_full"}}', {"retry-after": "1"}),
    "429_tokenizer": (429, b'{"error": {"message": "tokenizer busy", "code": "tokenizer_busy"}}', {"retry-after": "1"}),
    "429_other": (429, b'{"error": {"message": "slow down", "code": "rate_limit_exceeded"}}', {"retry-after": "1"}),
}


@dataclass
class StubStats:
    requests: int = 0  # completion requests received
    completed: int = 0  # completion responses fully written
    disconnects: int = 0  # clients that went away before their response completed
    active: int = 0  # completion requests being answered now
    connections: int = 0  # open TCP connections now
    max_connections: int = 0
    bodies: list[dict] = field(default_factory=list)  # last request bodies (bounded)


@dataclass
class StubWorker:
    """One stub worker; change `mode`, `delay`, `tokens`, `fail_after` and `ready` at any time."""

    host: str = "127.0.0.1"
    port: int = 0
    mode: str = "ok"
    delay: float = 0.0
    tokens: int = 8
    fail_after: int = 2
    tokens_per_event: int = 1
    ready: bool = True
    model: str = "stub"
    keep_bodies: int = 64
    stats: StubStats = field(default_factory=StubStats)
    _server: asyncio.Server | None = None
    _conns: dict[asyncio.Task, asyncio.StreamWriter] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> StubWorker:
        self._server = await asyncio.start_server(self._conn, self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task, writer in list(self._conns.items()):
                writer.transport.abort()
                task.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        s = self.stats
        s.connections += 1
        s.max_connections = max(s.max_connections, s.connections)
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = writer
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            s.connections -= 1
            self._conns.pop(task, None)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection should end."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if method == "GET":
            return await self._get(path, writer)
        if path not in ("/v1/chat/completions", "/v1/completions"):
            await _respond(writer, 404, b'{"error": {"message": "not found"}}')
            return True
        return await self._completion(path, json.loads(body or b"{}"), reader, writer)

    async def _get(self, path: str, writer: asyncio.StreamWriter) -> bool:
        if path == "/ready":
            await _respond(writer, 200 if self.ready else 503, b'{"ready": %s}' % (b"true" if self.ready else b"false"))
        elif path == "/health":
            await _respond(writer, 200, b'{"status": "ok"}')
        elif path == "/stats":
            await _respond(
                writer, 200, json.dumps({k: v for k, v in asdict(self.stats).items() if k != "bodies"}).encode()
            )
        elif path == "/v1/models":
            await _respond(
                writer, 200, json.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode()
            )
        else:
            await _respond(writer, 404, b'{"error": {"message": "not found"}}')
        return True

    async def _completion(
        self, path: str, body: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        s = self.stats
        s.requests += 1
        s.bodies.append(body)
        del s.bodies[: -self.keep_bodies]
        mode = self.mode
        if mode in _ERRORS:
            await _respond(writer, *_ERRORS[mode])
            return True
        if mode == "reset":
            return False  # close without a byte
        s.active += 1
        done = False
        try:
            if mode == "hang":
                await reader.read()  # until the client closes
                return False
            n = int(body.get("max_tokens") or self.tokens)
            chat = path.endswith("chat/completions")
            if body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                done = await self._stream(reader, writer, n, chat, mode == "midstream", usage)
                return done
            await asyncio.sleep(self.delay * n)
            text = "".join(f"tok{i} " for i in range(n))
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            )
            answer = {
                "id": "cmpl-stub",
                "object": "chat.completion" if chat else "text_completion",
                "model": self.model,
                "choices": [{**choice, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
            }
            await _respond(writer, 200, json.dumps(answer).encode())
            done = True
            return True
        finally:
            s.active -= 1
            if done:
                s.completed += 1
            elif mode != "midstream":
                s.disconnects += 1

    async def _stream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int, chat: bool, fail: bool, usage: bool
    ) -> bool:
        """Stream n tokens; False when it stopped early (failure injected, or the client went away)."""
        eof = asyncio.ensure_future(reader.read(1)) if self.delay else None  # completes when the client closes
        try:
            return await self._events(writer, n, chat, fail, eof, usage)
        finally:
            if eof is not None:
                eof.cancel()
                await asyncio.gather(eof, return_exceptions=True)  # the next request's read must not race it

    async def _events(
        self, writer: asyncio.StreamWriter, n: int, chat: bool, fail: bool, eof: asyncio.Future | None, usage: bool
    ) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        per = max(1, self.tokens_per_event)
        events = -(-n // per)
        for i in range(events):
            if fail and i == self.fail_after:
                writer.transport.abort()  # connection reset in the middle of the body
                return False
            if i and eof is not None:
                await asyncio.wait([eof], timeout=self.delay)
                if eof.done():
                    return False
            if chat:
                delta = {"role": "assistant", "content": f"tok{i} "} if i == 0 else {"content": f"tok{i} "}
                choice = {"index": 0, "delta": delta, "finish_reason": None if i < events - 1 else "length"}
            else:
                choice = {"index": 0, "text": f"tok{i} ", "finish_reason": None if i < events - 1 else "length"}
            event = (
                b"data: "
                + json.dumps(
                    {"id": "cmpl-stub", "object": obj, "created": created, "model": self.model, "choices": [choice]}
                ).encode()
                + b"\n\n"
            )
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        if usage:  # the worker's last event before [DONE]: no choices, the request's usage
            counts = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            event = (
                b"data: "
                + json.dumps(
                    {
                        "id": "cmpl-stub",
                        "object": obj,
                        "created": created,
                        "model": self.model,
                        "choices": [],
                        "usage": counts,
                    },
                    separators=(",", ":"),
                ).encode()
                + b"\n\n"
            )
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()
        return True


async def _respond(
    writer: asyncio.StreamWriter, status: int, body: bytes, headers: dict[str, str] | None = None
) -> None:
    reason = {
        200: "OK",
        400: "Bad Request",
        404: "Not Found",
        429: "Too Many Requests",
        503: "Service Unavailable",
    }.get(status, "X")
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )
    await writer.drain()


def main() -> None:  # pragma: no cover - exercised by the soak test and the benchmark as a subprocess
    p = argparse.ArgumentParser(description="Stub OpenAI worker(s) for gateway tests and benchmarks.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="port of the first worker (0: any free port for each)")
    p.add_argument("--count", type=int, default=1, help="workers to run in this process, one port each")
    p.add_argument("--delay", type=float, default=0.0, help="seconds between streamed tokens")
    p.add_argument("--tokens", type=int, default=8, help="tokens per answer when the request sets no max_tokens")
    p.add_argument("--mode", choices=MODES, default="ok")
    args = p.parse_args()

    async def run() -> None:
        workers = []
        for i in range(args.count):
            port = args.port + i if args.port else 0
            w = StubWorker(host=args.host, port=port, delay=args.delay, tokens=args.tokens, mode=args.mode)
            workers.append(await w.start())
        print("listening on " + " ".join(w.url for w in workers), flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":  # pragma: no cover
    main()
