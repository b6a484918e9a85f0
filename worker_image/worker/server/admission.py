"""Admission control: may this request enter the engine, and with how many tokens to generate?

Pure: a decision from the request's sizes, the settings and a snapshot of the load, so every rule is a row in a
table test. The server turns a rejection into an OpenAI error answer (400 or 429 with `Retry-After`).
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.server.errors import ApiError
from worker.server.settings import MaxTokensPolicy


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_tokens_cap: int | None
    policy: MaxTokensPolicy
    max_waiting: int
    retry_after_s: int


@dataclass(frozen=True)
class Load:
    """What the server knows about the queue when the request arrives."""

    engine_waiting: int  # the engine's own waiting count
    engine_running: int
    inflight: int  # requests the server has admitted and not yet finished (includes the engine's)

    @property
    def waiting(self) -> int:
        """Requests admitted but not running: the engine's queue, plus those handed over but not yet registered
        (a burst arriving in one event-loop turn would otherwise all see an empty queue)."""
        return max(self.engine_waiting, self.inflight - self.engine_running)


@dataclass(frozen=True)
class Admitted:
    max_tokens: int


def check_prompt_bytes(num_bytes: int, max_model_len: int, max_bytes_per_token: int | None) -> None:
    """Refuse, before tokenizing, a prompt whose UTF-8 size proves it cannot fit the context; raise `ApiError`.

    No token stands for more than `max_bytes_per_token` bytes (see `worker.model.tokenizer.max_bytes_per_token`),
    so a prompt of B bytes has at least ceil(B / that) tokens; above (max_model_len - 1) x that, it has at least
    max_model_len tokens, which `admit` would refuse anyway after paying for the tokenization. None: no bound
    is known for this tokenizer, nothing is checked here.
    """
    if max_bytes_per_token is None or num_bytes <= (max_model_len - 1) * max_bytes_per_token:
        return
    at_least = -(-num_bytes // max_bytes_per_token)
    raise ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens, but the prompt has at least {at_least} "
        f"tokens ({num_bytes} bytes; no token of this model stands for more than {max_bytes_per_token}). "
        "Shorten the prompt.",
        param="messages",
        code="context_length_exceeded",
    )


def admit(
    prompt_tokens: int,
    requested_max_tokens: int | None,
    default_max_tokens: int | None,
    limits: Limits,
    load: Load,
) -> Admitted:
    """Admit a request or raise `ApiError`.

    `default_max_tokens` is used when the request names none (`None`: the rest of the context, as vLLM does for
    chat). The cap and the context bound an explicit `max_tokens` by rejecting (400) or clamping, per the policy;
    a default is always clamped.
    """
    context = limits.max_model_len
    if prompt_tokens == 0:
        raise ApiError(400, "the prompt is empty", param="prompt", code="empty_prompt")
    if prompt_tokens >= context:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens, but the prompt has {prompt_tokens} tokens "
            "(at least one token must remain for the completion). Shorten the prompt.",
            param="messages",
            code="context_length_exceeded",
        )
    room = context - prompt_tokens
    bound = room if limits.max_tokens_cap is None else min(room, limits.max_tokens_cap)
    if requested_max_tokens is None:
        wanted = bound if default_max_tokens is None else min(default_max_tokens, bound)
    elif requested_max_tokens <= bound or limits.policy == "clamp":
        wanted = min(requested_max_tokens, bound)
    elif limits.max_tokens_cap is not None and requested_max_tokens > limits.max_tokens_cap:
        raise ApiError(
            400,
            f"max_tokens={requested_max_tokens} is above this server's cap of {limits.max_tokens_cap}; "
            f"ask for at most {limits.max_tokens_cap}",
            param="max_tokens",
            code="max_tokens_above_cap",
        )
    else:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + requested_max_tokens} tokens ({prompt_tokens} in the prompt, {requested_max_tokens} "
            f"for the completion). Reduce the prompt or max_tokens (at most {room}).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if load.waiting >= limits.max_waiting:
        raise ApiError(
            429,
            f"the worker's waiting queue is full ({load.waiting} waiting, limit {limits.max_waiting}); retry later "
            "or on another worker",
            code="queue_full",
            retry_after_s=limits.retry_after_s,
        )
    return Admitted(max_tokens=wanted)
