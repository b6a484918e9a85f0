"""A cap on request bodies, so that no client makes the worker hold (or parse) more than `max_body_bytes`.

Why it exists: the server reads a body into memory before parsing it, and a 60 MB body was read whole. A declared
`Content-Length` above the cap is refused before one byte of the body is read; a chunked body (no length) is
counted as it arrives and refused the moment it passes the cap, so the rest is never read. The answer is a 413
with an OpenAI-style error body and `Connection: close` (the unread rest of the body must not be parsed as the
next request). Imports only the server's errors module.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.server.errors import ApiError


class BodyTooLarge(ApiError):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            413,
            f"the request body is larger than this worker's limit of {max_bytes} bytes "
            "(--max-body-bytes); send a shorter prompt",
            code="body_too_large",
        )

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Connection": "close"}


def declared_length(scope: Scope) -> int | None:
    """The request's `Content-Length` (None when absent: a chunked body)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value)  # the HTTP parser has already refused a malformed one
    return None


class BodyLimit:
    """ASGI middleware: 413 for bodies over `max_bytes`, declared or counted while they arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await BodyTooLarge(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # the route's error handler answers it
            return message

        await self.app(scope, counting_receive, send)
