"""Quality of a model variant (fp8, int4, bf16) against a reference runner of the same checkpoint.

Two numbers, both on a fixed prompt set under teacher forcing (the candidate reads exactly the reference's
greedy continuation, so one early divergence does not decide every later position):

* greedy-token agreement: the fraction of positions where both models' top-1 next token is the same;
* mean KL(reference || candidate) of the next-token distributions, in nats.

Agreement is a count over few positions (`bench/quant.py`: 192), so it carries sampling noise that KL does not:
`QualityReport.agreement_interval` gives its Wilson interval, and `near_ties` counts the positions whose reference
top two tokens are nearly tied, which any perturbation may flip. On SmolLM2 (24 positions of 8 prompts), fp8's 182
of 192 (0.948) has the interval 0.907-0.971; 13 of the 192 positions have their top two within 0.1 nats and 48
within 0.5, and bf16 alone flips 3 to 5 (by CPU). Two fp8 roundings that lowered the KL by 11% and 20% moved the
agreement to 0.927 and 0.938 (quant.py has the figures).

`reference(runner, prompts)` once, then `compare(ref, variant)` per variant. Used by `bench/quant.py` (the
report) and the quantization tests (a floor on agreement).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QualityReport:
    agreement: float
    mean_kl: float
    positions: int

    @property
    def matches(self) -> int:
        """Positions where both top-1 tokens are the same."""
        return round(self.agreement * self.positions)

    def agreement_interval(self, z: float = 1.96) -> tuple[float, float]:
        """The agreement's Wilson score interval (95% for the default z): the true agreement rates that this many
        positions cannot tell apart from the one measured. Unlike the normal approximation it stays inside [0, 1]
        and is not empty at 0 or all matches."""
        n = self.positions
        if n == 0:
            return 0.0, 1.0
        p, z2 = self.matches / n, z * z
        centre = (p + z2 / (2 * n)) / (1 + z2 / n)
        half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
        # (at none or all matched the bound is exactly 0 or 1; computed, it can land an ulp inside)
        lo = 0.0 if self.matches == 0 else max(0.0, centre - half)
        hi = 1.0 if self.matches == n else min(1.0, centre + half)
        return lo, hi


@dataclass(frozen=True)
class Reference:
    """The reference side of a comparison, computed once and compared against any number of variants."""

    sequences: list[list[int]]  # prompt + greedy continuation
    starts: list[int]  # row whose logits predict the first generated token
    logprobs: list[torch.Tensor]  # reference log-probabilities at the continuation positions


def reference(runner, prompts: Sequence[list[int]], max_tokens: int = 16) -> Reference:
    if not prompts:
        raise ValueError("a quality reference needs at least one prompt")
    seqs, starts, lps = [], [], []
    for prompt in prompts:
        seq = list(prompt) + runner.greedy(prompt, max_tokens)
        first = len(prompt) - 1
        seqs.append(seq)
        starts.append(first)
        lps.append(torch.log_softmax(runner.score(seq)[first:-1], -1))
    return Reference(seqs, starts, lps)


def near_ties(ref: Reference, nats: float) -> int:
    """Positions where the reference's two most likely tokens are less than `nats` apart in log-probability: where
    a variant's agreement is decided by its rounding rather than its quality."""
    count = 0
    for lp in ref.logprobs:
        top2 = lp.topk(2, dim=-1).values
        count += int((top2[:, 0] - top2[:, 1] < nats).sum())
    return count


def compare(ref: Reference, candidate) -> QualityReport:
    """Agreement and mean KL of `candidate` against the reference on its continuation positions."""
    agree = 0
    kl_sum = 0.0
    total = 0
    for seq, first, ref_lp in zip(ref.sequences, ref.starts, ref.logprobs):
        cand = torch.log_softmax(candidate.score(seq)[first:-1].to(ref_lp.device), -1)  # may run elsewhere
        agree += int((ref_lp.argmax(-1) == cand.argmax(-1)).sum())
        kl_sum += float((ref_lp.exp() * (ref_lp - cand)).sum(-1).sum())
        total += ref_lp.shape[0]
    return QualityReport(agreement=agree / total, mean_kl=kl_sum / total, positions=total)
