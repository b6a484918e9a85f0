"""OpenAI-style error bodies for every 4xx/5xx the worker answers, including FastAPI's own validation errors, and
the request id that ties an answer to the worker's log.

Clients (the `openai` SDK, the gateway) read `{"error": {"message", "type", "param", "code"}}`; a router reads
`Retry-After` on 429/503 to decide when or where to retry. A 5xx never carries an exception's type or message
(they can name files, addresses, library internals): its body says "internal error" and the request id, the
`x-request-id` header carries the same id, and the log has the details under it. The id is the caller's
`x-request-id` when that is a plain token (the gateway sends one, so both logs line up), else a new one.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answer. Raise it from a handler, or return `.response()`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def internal_error(request_id: str, code: str = "internal_error") -> ApiError:
    """The 500 a client sees for any failure of ours: no details, only the id to find them in the log."""
    return ApiError(
        500, f"internal server error (request id {request_id}); the details are in the worker's log", code=code
    )


def request_id_of(scope: Scope) -> str:
    """The id `RequestIds` gave this request."""
    return str(scope["state"]["request_id"])


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            return text if _REQUEST_ID.fullmatch(text) else None
    return None


class RequestIds:
    """Gives every HTTP request an id (`request.state.request_id`, the `x-request-id` answer header), and turns
    any exception that escapes the app into a generic 500 naming that id, with the traceback logged under it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_request_id(scope) or f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [h for h in message.get("headers", ()) if h[0].lower() != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ApiError as err:  # raised where no route's handler saw it (a middleware reading the body)
            if not started:
                await err.response()(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s (%s %s) failed", request_id, scope.get("method"), scope.get("path"))
            if not started:
                await internal_error(request_id).response()(scope, receive, send_with_id)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """The first pydantic/FastAPI error as a 400 naming the field (`messages.0.role`), the rest counted."""
    if not errors:
        return ApiError(400, "invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "field required"
    param = ".".join(loc) or None
    text = f"{param}: {message}" if param else message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return ApiError(400, text, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI/Starlette can produce through the OpenAI error shape (unexpected exceptions:
    `RequestIds`, the outermost middleware)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return ApiError(exc.status_code, detail).response()
