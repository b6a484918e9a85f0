"""The worker's `usage` report: asking for it on every stream, finding it cheaply, hiding it from clients that did
not ask for it.

Why: the gateway charges a request what the worker says it used (`prompt_tokens + completion_tokens`), not what
it can count in the stream: a stop string that never matches holds text back, so 1,500 generated tokens can arrive
as 2 SSE events. Every streamed request therefore goes upstream with `stream_options.include_usage`, and the worker
(ours and vLLM alike) ends the stream with one event that has no choices and a `usage` object, just before
`[DONE]`. Finding it must not cost every chunk a JSON parse: the proxy scans each chunk once for `"usage"`, and
only a chunk holding the marker `"usage":{` (or `"usage": {`) is parsed (chunks carry `"usage":null` while
include_usage is on, which the marker skips).

Pure functions on bytes and dicts; imports nothing of ours.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

USAGE_MARKERS = (b'"usage":{', b'"usage": {')
_NULL_USAGE = b',"usage":null'  # what the worker adds to every chunk while include_usage is on
_INCLUDE_USAGE = b',"stream_options":{"include_usage":true}'


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens the worker reports for one answer."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def ask_for_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body to send upstream (streams always ask for usage) and whether the client asked for it itself."""
    if not body.get("stream"):
        return body, True  # a plain answer always carries usage
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, True
    merged = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
    return {**body, "stream_options": merged}, False


def upstream_body(raw: bytes, body: dict[str, Any]) -> tuple[bytes, bool]:
    """The bytes to send upstream for a request whose bytes are `raw` and parsed body `body`, and whether the
    client asked for usage itself (`ask_for_usage`).

    A stream without `stream_options` (the common case) gets the option spliced in before its closing brace, so
    the body is not serialized again (a `json.dumps` per request was the gateway's largest per-request cost after
    parsing); any other change re-serializes the merged body. Only a UTF-8 object is spliced (`json.loads` also
    reads UTF-16/32)."""
    sent, client_asked = ask_for_usage(body)
    if sent is body:
        return raw, client_asked
    if "stream_options" not in body:
        stripped = raw.rstrip()
        if stripped.endswith(b"}") and raw.lstrip().startswith(b"{"):
            return stripped[:-1] + _INCLUDE_USAGE + b"}", client_asked
    return json.dumps(sent, separators=(",", ":"), ensure_ascii=False).encode(), client_asked


def parse_usage(value: object) -> Usage | None:
    """A `usage` object's token counts, None unless both are non-negative integers."""
    if not isinstance(value, Mapping):
        return None
    prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens")
    for n in (prompt, completion):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            return None
    return Usage(prompt, completion)  # type: ignore[arg-type]


def usage_of_body(body: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) answer."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return parse_usage(data.get("usage")) if isinstance(data, dict) else None


def has_usage(chunk: bytes) -> bool:
    """Cheap test: could this chunk hold a usage object? (two substring scans, no parsing)"""
    return USAGE_MARKERS[0] in chunk or USAGE_MARKERS[1] in chunk


def take_usage(chunk: bytes, strip: bool) -> tuple[bytes, Usage | None]:
    """The usage carried by a chunk of whole SSE lines, and the chunk to pass on: without the usage-only event
    when `strip` (the client did not ask for it). Events with choices keep their bytes."""
    lines = chunk.split(b"\n")
    found: Usage | None = None
    out: list[bytes] = []
    skip_blank = False
    for line in lines:
        if skip_blank:
            skip_blank = False
            if not line.strip():
                continue
        data = line[5:].strip() if line.startswith(b"data:") else b""
        if data and has_usage(data):
            try:
                event = json.loads(data)
            except (ValueError, RecursionError):
                event = None
            usage = parse_usage(event.get("usage")) if isinstance(event, dict) else None
            if usage is not None:
                found = usage
                if strip and not event.get("choices"):
                    skip_blank = True
                    continue
        out.append(line)
    return b"\n".join(out), found


def strip_null_usage(chunk: bytes) -> bytes:
    """Remove the `"usage":null` the worker adds to each chunk once asked for usage (client did not ask)."""
    return chunk.replace(_NULL_USAGE, b"") if _NULL_USAGE in chunk else chunk
