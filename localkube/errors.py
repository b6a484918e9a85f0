"""Kubernetes-style API errors.

Every failure the API server reports is a ``Status`` object with the ``code``, ``reason`` and ``details`` a real
kube-apiserver would send, because kubectl, client-go and the kubernetes Python client print and branch on them
(kopf, for one, retries on 409 and gives up on 422).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Cause:
    """One field-level problem, rendered as a ``StatusCause``."""

    field: str
    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, ...
    message: str

    def to_dict(self) -> dict:
        return {"reason": self.reason, "message": self.message, "field": self.field}

    def describe(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


def render_value(value: object) -> str:
    """Render a value inside an error message roughly the way Go's ``%#v`` does for JSON data."""
    if isinstance(value, str):
        return json.dumps(value)
    if value is None:
        return '"null"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def invalid_value(path: str, value: object, detail: str) -> Cause:
    return Cause(path, "FieldValueInvalid", f"Invalid value: {render_value(value)}: {detail}")


def required_value(path: str, detail: str = "") -> Cause:
    return Cause(path, "FieldValueRequired", "Required value" + (f": {detail}" if detail else ""))


def not_supported(path: str, value: object, supported: list) -> Cause:
    listed = ", ".join(render_value(v) for v in supported)
    return Cause(
        path, "FieldValueNotSupported", f"Unsupported value: {render_value(value)}: supported values: {listed}"
    )


def forbidden(path: str, detail: str) -> Cause:
    return Cause(path, "FieldValueForbidden", f"Forbidden: {detail}")


def duplicate(path: str, value: object) -> Cause:
    return Cause(path, "FieldValueDuplicate", f"Duplicate value: {render_value(value)}")


@dataclass
class ApiError(Exception):
    """An error answered as a ``Status`` object."""

    code: int
    reason: str
    message: str
    name: str | None = None
    group: str | None = None
    kind: str | None = None
    causes: list[Cause] = field(default_factory=list)
    retry_after: int | None = None

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict:
        details: dict = {}
        if self.name is not None:
            details["name"] = self.name
        if self.group:
            details["group"] = self.group
        if self.kind is not None:
            details["kind"] = self.kind
        if self.causes:
            details["causes"] = [c.to_dict() for c in self.causes]
        if self.retry_after is not None:
            details["retryAfterSeconds"] = self.retry_after
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if details:
            body["details"] = details
        return body


def qualified(resource: str, group: str) -> str:
    """``pods`` for the core group, ``inferencedeployments.llmfleet.io`` otherwise (as the API server names them)."""
    return f"{resource}.{group}" if group else resource


def not_found(resource: str, group: str, name: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'{qualified(resource, group)} "{name}" not found', name=name, group=group, kind=resource
    )


def already_exists(resource: str, group: str, name: str) -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{qualified(resource, group)} "{name}" already exists',
        name=name,
        group=group,
        kind=resource,
    )


def conflict(resource: str, group: str, name: str, detail: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified(resource, group)} "{name}": {detail}',
        name=name,
        group=group,
        kind=resource,
    )


def stale(resource: str, group: str, name: str) -> ApiError:
    return conflict(
        resource,
        group,
        name,
        "the object has been modified; please apply your changes to the latest version and try again",
    )


def invalid(kind: str, group: str, name: str, causes: list[Cause]) -> ApiError:
    described = [c.describe() for c in causes]
    summary = described[0] if len(described) == 1 else "[" + ", ".join(described) + "]"
    title = f"{kind}.{group}" if group else kind
    return ApiError(
        422, "Invalid", f'{title} "{name}" is invalid: {summary}', name=name, group=group, kind=kind, causes=causes
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def method_not_allowed(message: str = "the server does not allow this method on the requested resource") -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)


def unsupported_media_type(content_type: str, supported: list[str]) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: {', '.join(supported)}"
        + (f" (got {content_type})" if content_type else ""),
    )


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def forbidden_error(resource: str, group: str, name: str, message: str) -> ApiError:
    return ApiError(403, "Forbidden", message, name=name, group=group, kind=resource)


def not_found_path() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")
