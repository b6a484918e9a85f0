"""Requests and their sampling parameters: the unit the scheduler, the runner and the server share.

Pure Python (no torch) so the scheduler and its tests stay light. Mirrors vLLM v1's `Request` /
`SamplingParams` closely enough that people who know vLLM find their way, nothing more.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a request ended. Values are what the OpenAI API reports as `finish_reason`."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client disconnect, explicit abort, deadline, drain timeout


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


FINISHED_STATUSES = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Logprob:
    """The log probability of one token under the model's raw distribution, and the `top` most likely tokens at
    its position as (token id, logprob), most likely first (empty unless alternatives were asked for)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` means greedy.

    Validation raises `ValueError` with a message that names the field and the allowed range, so the server can
    turn it into a 400 directly.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disabled) or positive, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: set logprobs too")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(eq=False)
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
