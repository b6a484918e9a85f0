"""The front of the gateway's public app: request ids, the API-key gate, generic 500s, and the proxy's direct routes.

Why it exists: these hold for every route alike (the proxy, `/v1/models`, `/internal/*`, unknown paths), so they
live once in front of them rather than in each handler.

`DirectRoutes` is the outermost ASGI app: the proxy's routes (every token of every stream passes through them) go
straight to their endpoints, skipping the ~15 layers of FastAPI/Starlette routing and middleware that each
streamed chunk would otherwise cross (the larger part of the gateway's CPU per token that was not the wire
itself, in `bench/gateway_vs_router.py`'s profiles); everything else enters the FastAPI app, where
`GatewayMiddleware` does the same work for its routes. A direct endpoint gets the request id and puts it on its
responses, and answers its own unexpected exceptions with the generic 500 (`internal_error_message`).

- Request id: a caller's `x-request-id` (1-128 of `A-Za-z0-9._:-`) is kept, any other value is replaced by a new
  one; the id is put into the request's headers (the proxy forwards it to the worker) and onto every response.
- API-key gate: while the key store has no key loaded (`KeyStore.unavailable`, e.g. the Secret is missing), every
  request except the probes (`/health`, `/ready`) gets 503 with that reason in OpenAI's error shape: the gateway
  fails closed and says why.
- Generic 500: an exception escaping a handler is logged with its traceback and the request id; the caller gets
  500 with a generic message naming the request id, never the exception's text. (After the response has started,
  the exception propagates and the server cuts the connection: a truncated stream must not look complete.)

Imports: starlette's ASGI types, `gateway.errors` and `gateway.state` only.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import error_body
from gateway.state import GatewayState

log = logging.getLogger("llmfleet.gateway")

REQUEST_ID_HEADER = b"x-request-id"
PROBE_PATHS = frozenset({"/health", "/ready"})
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")

# A route served outside the FastAPI app: called with the request id (see the module docstring).
DirectEndpoint = Callable[[Scope, Receive, Send, bytes], Awaitable[None]]


def request_id(presented: bytes | None) -> bytes:
    """The caller's id when it is well-formed, else a new random one."""
    if presented is not None and _REQUEST_ID.fullmatch(presented):
        return presented
    return uuid.uuid4().hex.encode()


def internal_error_message(rid: str) -> str:
    return f"internal error in the gateway (request id {rid}); the details are in the gateway's log"


def presented_request_id(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == REQUEST_ID_HEADER:
            return value
    return None


async def refused_without_keys(state: GatewayState, path: str, send: Send, rid: bytes) -> bool:
    """Answer 503 (and return True) while no API key is loaded, unless `path` is a probe."""
    reason = state.keys.unavailable
    if reason is None or path in PROBE_PATHS:
        return False
    retry = str(state.settings.retry_after_seconds).encode()
    body = error_body(503, reason, "api_keys_not_loaded")
    await _send_error(send, 503, body, [(b"retry-after", retry), (REQUEST_ID_HEADER, rid)])
    return True


class DirectRoutes:
    """The outermost app: `routes` (path -> endpoint) served directly, everything else by `app`."""

    def __init__(self, app: ASGIApp, state: GatewayState, routes: dict[str, DirectEndpoint]) -> None:
        self.app = app
        self.state = state
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        rid = request_id(presented_request_id(scope))
        if not await refused_without_keys(self.state, scope["path"], send, rid):
            await endpoint(scope, receive, send, rid)


async def _send_error(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


class GatewayMiddleware:
    """Request id, API-key gate and generic 500s in front of `app` (see the module docstring)."""

    def __init__(self, app: ASGIApp, state: GatewayState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        presented = None
        headers = []
        for name, value in scope["headers"]:
            if name == REQUEST_ID_HEADER:
                presented = value
            else:
                headers.append((name, value))
        rid = request_id(presented)
        headers.append((REQUEST_ID_HEADER, rid))
        scope = {**scope, "headers": headers}
        started = False

        async def send_with_id(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                out = list(message.get("headers", ()))
                if not any(name.lower() == REQUEST_ID_HEADER for name, _ in out):
                    out.append((REQUEST_ID_HEADER, rid))
                message = {**message, "headers": out}
            await send(message)

        if await refused_without_keys(self.state, scope["path"], send_with_id, rid):
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("%s %s failed (request id %s)", scope.get("method"), scope.get("path"), rid.decode())
            if started:
                raise
            body = error_body(500, internal_error_message(rid.decode()), "internal_error")
            await _send_error(send_with_id, 500, body, [])
