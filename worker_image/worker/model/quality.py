"""Quality of a model variant (fp8, int4, bf16) against a reference runner of the same checkpoint.

Two numbers, both on a fixed prompt set under teacher forcing (the candidate reads exactly the reference's
greedy continuation, so one early divergence does not decide every later position):

* greedy-token agreement: the fraction of positions where both models' top-1 next token is the same;
* mean KL(reference || candidate) of the next-token distributions, in nats.

`reference(runner, prompts)` once, then `compare(ref, variant)` per variant. Used by `bench/quant.py` (the
report) and the quantization tests (a floor on agreement).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QualityReport:
    agreement: float
    mean_kl: float
    positions: int


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
