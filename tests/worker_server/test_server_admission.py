"""Admission rules, one row per rule: context limit, cap (reject/clamp), defaults, queue full."""

from __future__ import annotations

import pytest
from worker.server.admission import Limits, Load, admit
from worker.server.errors import ApiError

IDLE = Load(engine_waiting=0, engine_running=0, inflight=0)


def limits(cap: int | None = None, policy: str = "reject", max_waiting: int = 4, context: int = 100) -> Limits:
    return Limits(max_model_len=context, max_tokens_cap=cap, policy=policy, max_waiting=max_waiting, retry_after_s=3)


@pytest.mark.parametrize(
    ("prompt", "requested", "default", "lim", "expected"),
    [
        (10, 20, None, limits(), 20),  # fits
        (10, None, None, limits(), 90),  # no max_tokens, no default: the rest of the context
        (10, None, 16, limits(), 16),  # the endpoint's default
        (90, None, 16, limits(), 10),  # a default never exceeds the context
        (10, None, None, limits(cap=32), 32),  # ... nor the cap
        (10, 90, None, limits(), 90),  # exactly the rest of the context
        (10, 50, None, limits(cap=32, policy="clamp"), 32),  # clamp to the cap
        (10, 500, None, limits(policy="clamp"), 90),  # clamp to the context
        (99, 1, None, limits(), 1),  # one token of room
    ],
)
def test_admitted_max_tokens(
    prompt: int, requested: int | None, default: int | None, lim: Limits, expected: int
) -> None:
    assert admit(prompt, requested, default, lim, IDLE).max_tokens == expected


@pytest.mark.parametrize(
    ("prompt", "requested", "lim", "load", "status", "code"),
    [
        (0, 5, limits(), IDLE, 400, "empty_prompt"),
        (100, 5, limits(), IDLE, 400, "context_length_exceeded"),  # prompt fills the context
        (150, None, limits(policy="clamp"), IDLE, 400, "context_length_exceeded"),  # clamping cannot help
        (10, 91, limits(), IDLE, 400, "context_length_exceeded"),
        (10, 33, limits(cap=32), IDLE, 400, "max_tokens_above_cap"),
        (10, 5, limits(max_waiting=2), Load(2, 0, 0), 429, "queue_full"),  # engine queue full
        (10, 5, limits(max_waiting=2), Load(0, 1, 3), 429, "queue_full"),  # admitted, not yet running
        (10, 5, limits(max_waiting=1), Load(0, 1, 1), 200, None),  # nothing waits: admitted
        (10, 5, limits(max_waiting=1), Load(1, 1, 2), 429, "queue_full"),
    ],
)
def test_rejections(prompt: int, requested: int | None, lim: Limits, load: Load, status: int, code: str | None) -> None:
    if status == 200:
        assert admit(prompt, requested, None, lim, load).max_tokens == requested
        return
    with pytest.raises(ApiError) as info:
        admit(prompt, requested, None, lim, load)
    assert (info.value.status, info.value.code) == (status, code)
    if status == 429:
        assert info.value.headers() == {"Retry-After": "3"}
        assert "waiting" in info.value.message


def test_context_error_names_the_numbers() -> None:
    with pytest.raises(ApiError) as info:
        admit(10, 95, None, limits(), IDLE)
    assert "100 tokens" in info.value.message and "105" in info.value.message and "at most 90" in info.value.message
    assert info.value.param == "max_tokens"
