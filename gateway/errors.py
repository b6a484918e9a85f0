"""OpenAI-style error bodies, so OpenAI SDKs raise their usual typed exceptions for gateway errors."""

from __future__ import annotations

import json

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
    504: "api_error",
}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}` as JSON bytes."""
    err = {"message": message, "type": _TYPES.get(status, "api_error"), "param": param, "code": code}
    return json.dumps({"error": err}).encode()


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An SSE event carrying an error (OpenAI SDKs raise on an event whose JSON has an `error` key)."""
    return b"data: " + error_body(status, message, code) + b"\n\n"
