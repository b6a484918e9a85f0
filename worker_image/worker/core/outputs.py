"""The typed seams between the scheduler (no torch) and the model runner (torch).

The runner is stateless with respect to scheduling: each step it receives, for every scheduled request, the
tokens to compute, their starting position, the full block table and whether to sample. It keeps only
per-request sampling state (seeded generators), dropped when the request id appears in `finished_req_ids`.
A failure the runner can pin on one request is reported in `ModelRunnerOutput.failed` instead of raised, so one
request's bad state ends that request and never the whole batch.

Speculative decoding: a `ScheduledSeq` with `draft_token_ids` computes the request's last known token followed by
the drafts (`token_ids` ends with them) and samples at every one of those positions; the runner verifies them
(`worker.core.spec_decode`) and reports the tokens the request gains in `ModelRunnerOutput.verified_token_ids`
instead of `sampled_token_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.core.lora import LoraSpec
from worker.core.request import Logprob, SamplingParams


@dataclass(slots=True)  # not frozen: a frozen dataclass sets each field through object.__setattr__, 1.6 -> 0.6 us a
class ScheduledSeq:  # seq, 64 of them in every step at 64 running
    """One request's share of a step."""

    req_id: str
    token_ids: list[int]  # tokens whose KV this step computes (prefill chunk, recompute chunk or 1 decode token)
    start_pos: int  # position of token_ids[0] == num_computed_tokens before the step
    # The request's whole block table (covers start_pos + len(token_ids) tokens): the KV manager's own list, valid
    # for this step only (the next schedule() may extend it), so a runner reads it and never keeps it.
    block_ids: list[int]
    sample: bool  # True when this step reaches the end of the known tokens: sample the next token
    sampling_params: SamplingParams
    num_output_tokens: int = 0  # tokens generated so far (sampler state such as min_tokens)
    eos_token_id: int | None = None
    # With `prompt_logprobs`: the prompt tokens that this chunk's positions predict (position start_pos + i
    # predicts prompt_targets[i]); empty otherwise, and once every prompt logprob is known.
    prompt_targets: tuple[int, ...] = ()
    # Speculative decoding: the last len(draft_token_ids) entries of token_ids are drafts to verify (sample is True)
    draft_token_ids: tuple[int, ...] = ()
    # LoRA: the request's adapter and the slot the scheduler gave it (the runner loads the adapter into that slot
    # when the slot holds another one); None / -1 for the base model
    lora: LoraSpec | None = None
    lora_slot: int = -1


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    num_batched_tokens: int
    finished_req_ids: frozenset[str] = frozenset()  # ended since the last step: runner drops their state
    preempted_req_ids: frozenset[str] = frozenset()

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class ModelRunnerOutput:
    """Sampled token per request that had `sample=True` (and its logprob when asked); the tokens gained by
    requests that verified drafts."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float] = field(default_factory=dict)
    top_logprobs: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # request -> logprobs of its ScheduledSeq.prompt_targets, in order
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    # request -> why the runner could not run or sample it this step (its own parameters or state, e.g. a
    # generator it could not seed): the scheduler ends that request with an error, the rest of the batch goes on
    failed: dict[str, str] = field(default_factory=dict)
    # request scheduled with drafts -> the tokens it gains: its accepted drafts, then the target's own next token
    # (1 .. len(drafts) + 1 tokens; `worker.core.spec_decode.accepted_prefix`)
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
