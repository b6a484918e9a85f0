"""OpenAI-style error bodies for every 4xx/5xx the worker answers, including FastAPI's own validation errors.

Clients (the `openai` SDK, the gateway) read `{"error": {"message", "type", "param", "code"}}`; a router reads
`Retry-After` on 429/503 to decide when or where to retry.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

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

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
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


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
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
    """Route every error FastAPI/Starlette can produce through the OpenAI error shape."""

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

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()
