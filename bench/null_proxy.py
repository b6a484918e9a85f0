"""The Python floor for `bench/gateway_vs_router.py`: a proxy on our gateway's stack that does nothing else.

Why: at a burst of 512 new streams on 2 shared cores our gateway adds ~45-70 ms TTFT p50 and vllm-router adds none
that can be told from noise. This proxy separates what the stack costs from what the gateway's features cost. It
runs on the same server stack as `llmfleet gateway` (uvicorn with uvloop and httptools, access log off, the same
garbage-collector tuning) and forwards through the same upstream transport (`gateway.transport.PooledTransport`,
the `gateway.h1` connection), round-robin over the workers, streaming the answer back chunk by chunk. It has no
authentication, no limits, no admission queue, no routing table, no metrics, no retries and no disconnect watch.

`--spin-us N` burns N microseconds of CPU per request before it is forwarded: the sensitivity of TTFT under a
burst to per-request CPU. Adding work on this proxy's path until its figures match the gateway's shows how much of
the gap is CPU and how much is anything else.

    python bench/null_proxy.py --port 8081 --spin-us 0 http://127.0.0.1:9001 http://127.0.0.1:9002

Imports: the standard library, uvicorn, starlette's ASGI types, and `gateway.transport` / `gateway.cli` (what the
gateway itself uses).
"""

from __future__ import annotations

import argparse
import itertools
import time

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.cli import tune_garbage_collector
from gateway.transport import PooledTransport, Timeouts

TIMEOUTS = Timeouts(connect=5.0, read=60.0, write=5.0, pool=5.0)


def spin(seconds: float) -> None:
    """Busy-wait: CPU time on the event loop's thread, as the gateway's own per-request work is. Counted in the
    thread's CPU time, not the wall's: on a busy host a wall-clock spin is descheduled part of the time and burns
    less than asked (its test read 1.51 s of CPU for 2 s asked while a benchmark ran beside it)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def null_proxy(urls: list[str], spin_s: float = 0.0) -> ASGIApp:
    """The ASGI app: `GET /ready` answers 200; any other request is forwarded as a POST to the next worker."""
    workers = itertools.cycle(urls)
    pool: list[PooledTransport] = []  # created in the server's loop (lifespan startup)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            pool.append(PooledTransport(max_keepalive_connections=4096))
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await pool[0].aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/ready":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        if spin_s:
            spin(spin_s)
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        upstream = await pool[0].open(
            next(workers) + scope["path"], [(b"content-type", b"application/json")], body, TIMEOUTS
        )
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
        stream = upstream.stream
        try:
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await stream.aclose()
        await send({"type": "http.response.body", "body": b""})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--spin-us", type=float, default=0.0, help="CPU microseconds burnt per request before forwarding")
    ap.add_argument("urls", nargs="+", help="worker base URLs")
    args = ap.parse_args()
    app = null_proxy(args.urls, args.spin_us / 1e6)
    tune_garbage_collector()
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        loop="uvloop",
        http="httptools",
        backlog=4096,
        access_log=False,
    )


if __name__ == "__main__":
    main()
