"""The body the gateway sends upstream: every stream asks the worker for usage, spliced into the client's bytes when
that is safe, re-serialized otherwise; what the worker receives always parses to the client's body plus the option."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.usage import upstream_body

INCLUDE = {"include_usage": True}


@pytest.mark.parametrize(
    ("raw", "sent", "client_asked", "spliced"),
    [
        # not a stream: sent as it came
        (b'{"model":"m","prompt":"x"}', {"model": "m", "prompt": "x"}, True, True),
        (b'{"model":"m","stream":false}', {"model": "m", "stream": False}, True, True),
        # a stream without stream_options: spliced before the closing brace (whitespace kept or trimmed)
        (b'{"model":"m","stream":true}', {"model": "m", "stream": True, "stream_options": INCLUDE}, False, True),
        (b' {"model": "m", "stream": true} \n', {"model": "m", "stream": True, "stream_options": INCLUDE}, False, True),
        (
            b'{"model":"m","stream":true,"x":{"y":"}"}}',
            {"model": "m", "stream": True, "x": {"y": "}"}, "stream_options": INCLUDE},
            False,
            True,
        ),
        (
            '{"model":"é","stream":true}'.encode(),
            {"model": "é", "stream": True, "stream_options": INCLUDE},
            False,
            True,
        ),
        # the client asked for usage itself: sent as it came
        (
            b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}',
            {"model": "m", "stream": True, "stream_options": INCLUDE},
            True,
            True,
        ),
        # stream_options without include_usage: merged and re-serialized
        (
            b'{"model":"m","stream":true,"stream_options":{"include_usage":false,"z":1}}',
            {"model": "m", "stream": True, "stream_options": {"include_usage": True, "z": 1}},
            False,
            False,
        ),
        (
            b'{"model":"m","stream":true,"stream_options":null}',
            {"model": "m", "stream": True, "stream_options": INCLUDE},
            False,
            False,
        ),
        # an escaped key is the same key once parsed: merged, never a duplicate
        (
            b'{"model":"m","stream":true,"stream\\u005foptions":{}}',
            {"model": "m", "stream": True, "stream_options": INCLUDE},
            False,
            False,
        ),
        # UTF-16 parses too, but is never spliced
        (
            '{"model":"m","stream":true}'.encode("utf-16"),
            {"model": "m", "stream": True, "stream_options": INCLUDE},
            False,
            False,
        ),
    ],
)
def test_the_upstream_body_asks_for_usage(raw: bytes, sent: dict[str, Any], client_asked: bool, spliced: bool) -> None:
    body = json.loads(raw)
    out, asked = upstream_body(raw, body)
    assert json.loads(out) == sent
    assert asked is client_asked
    assert out.count(b"stream_options") <= 1
    if spliced:
        assert out.startswith(raw.rstrip()[:-1])  # the client's bytes, then at most the option
