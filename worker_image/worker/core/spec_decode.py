"""Speculative decoding bookkeeping shared by the scheduler (no torch) and the runner's sampler.

Why a module of its own: the verification rule and the counters must be one definition for every runner (the
torch `ModelRunner`, the toy runner of the tests) and for the scheduler that applies the result.

The rule. A request scheduled with drafts `d_0..d_{k-1}` computes its last known token and the drafts in one
step; the runner samples the target's token `x_i` at each of the k + 1 positions, in order, each exactly as plain
decoding would sample it there (same logits processing, same per-request random stream), and stops at the first
position whose sample differs from the draft. The request then gains `x_0..x_a`: the accepted drafts
(`x_i == d_i` for i < a) and one more token, the target's own sample at the first mismatch (or the bonus token
after k accepted drafts).

For a greedy request this is token-identical to decoding without speculation. For a sampled request it is exactly
rejection sampling with a point-mass draft (what vLLM does for n-gram drafts): `x_i ~ p_i` equals the draft with
probability `p_i(d_i)` (accept), and given `x_i != d_i` it is distributed as `p_i` with `d_i` removed and
renormalised (the residual of the rejection step). Because the runner draws from the request's generator once
per produced token, a seeded request also produces the same tokens with and without speculation.

May import nothing of ours but `worker.core` modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a request gains when the target sampled `sampled` (len(drafts) + 1 positions, or fewer when the
    runner stopped at the first mismatch) for `drafts`: the matching drafts, then the first differing sample."""
    out: list[int] = []
    for i, token in enumerate(sampled):
        out.append(token)
        if i >= len(drafts) or token != drafts[i]:
            break
    return out


@dataclass
class SpecDecodeStats:
    """Cumulative counters under vLLM's names (`vllm:spec_decode_*`)."""

    num_drafts: int = 0  # steps in which a request verified at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens accepted (the extra token each step gains is not counted)
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at draft position i

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
        )
