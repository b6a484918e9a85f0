"""Requests and their sampling parameters: the unit the scheduler, the runner and the server share.

Pure Python (no torch) so the scheduler and its tests stay light. Mirrors vLLM v1's `Request` /
`SamplingParams` closely enough that people who know vLLM find their way, nothing more.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

from worker.core.lora import LoraSpec


class FinishReason(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() of a member, which logs rely on
    """Why a request ended. Values are what the OpenAI API reports as `finish_reason`."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client disconnect, explicit abort, deadline, drain timeout
    ERROR = "error"  # this request alone failed inside the engine (the server answers it with an error)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    # Members are singletons compared by identity, so identity hashing is sound; Enum's own hashes the name in
    # Python, and the engine asks `is_finished` of every running request in every step.
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


FINISHED_STATUSES = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


# Bounds of every sampling parameter. The server's request models use the same constants, so a value that passes
# the HTTP layer also passes here, and nothing out of these ranges ever reaches a torch op in a batch.
MAX_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI and vLLM take it (torch generators accept all of it)
MAX_INT32 = 2**31 - 1
MAX_TOKEN_ID = MAX_INT32  # token ids and top_k fit in int32 for every backend; the vocabulary is checked at admission
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_TEMPERATURE = 2.0
GREEDY_BELOW_TEMPERATURE = 1e-5  # smaller temperatures sample greedily: dividing logits by them overflows fp32


@dataclass(frozen=True)
class Logprob:
    """The log probability of one token under the model's raw distribution, and the `top` most likely tokens at
    its position as (token id, logprob), most likely first (empty unless alternatives were asked for)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not (low < value if low_open else low <= value) or value > high:
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` means greedy.

    Every field is bounded here (`ValueError` naming the field and its range, which the server turns into a 400);
    what depends on the model (token ids below the vocabulary size) is checked by `check_vocab` when the request
    is admitted. Either way a bad value fails its own request before it joins a batch, never the engine.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled; k >= the vocabulary size keeps every token
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the logprob of each chosen token
    min_tokens: int = 0
    top_logprobs: int = 0  # with logprobs: also the top-k alternatives of each chosen token
    # None: off. k >= 0: the logprob of every prompt token after the first (teacher-forced scoring, OpenAI's
    # `echo` + `logprobs`) and its top-k alternatives. Such requests bypass prefix-cache hits (cached positions
    # have no logits).
    prompt_logprobs: int | None = None
    # (token id, bias) added to that token's logit before sampling (OpenAI's `logit_bias`); a dict is accepted
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((k, v) for k, v in bias))
        self._check()

    def _check(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, MAX_INT32)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, MAX_TOKEN_ID)
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, MAX_TOKEN_ID)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}")
        for token, value in self.logit_bias:
            _check_int("logit_bias token id", token, 0, MAX_TOKEN_ID)
            _check_float("logit_bias value", value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id more than once")
        _check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: set logprobs too")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)

    def check_vocab(self, vocab_size: int | None) -> None:
        """Raise ValueError when a token id this request names is outside the model's vocabulary (at admission)."""
        if vocab_size is None:
            return
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} must name token ids in 0..{vocab_size - 1}; got {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(eq=False, slots=True)  # slots: one object to touch per request in every step, not an object and its dict
class Request:
    """One generation request as the engine tracks it.

    `all_token_ids` = prompt + generated so far. `num_computed_tokens` counts tokens whose KV is in the cache;
    chunked prefill, prefix-cache hits and recompute after preemption all follow from it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0  # lower value = served first (tiers); FCFS within a priority
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # when top_logprobs
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # for prompt tokens 1.. when prompt_logprobs
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why the engine failed this request (status FINISHED_ERROR)
    lora: LoraSpec | None = None  # the LoRA adapter it runs with; None: the base model
    lora_slot: int | None = None  # the adapter slot it holds while running (worker.core.lora.LoraSlots)
    # The output processor's state for it (worker.engine.output_processor), held here so that its step reaches it
    # through the request it already holds, not a lookup by id (1.046-1.051x the step outside the model at 64
    # running, stop 64). Core never reads it.
    output_state: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_logprobs_done(self) -> bool:
        """Every prompt token after the first has its logprob (or none were asked for)."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return not wanted or len(self.prompt_logprobs) >= self.num_prompt_tokens - 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def remaining_tokens(self) -> int:
        """Upper bound of tokens still to generate (drain-time estimate)."""
        return max(0, self.sampling_params.max_tokens - len(self.output_token_ids))
