"""Quality of a model variant (fp8, int4, bf16) against a reference runner of the same checkpoint.

Two numbers, both on a fixed prompt set under teacher forcing (the candidate reads exactly the reference's
greedy continuation, so one early divergence does not decide every later position):

* greedy-token agreement: the fraction of positions where both models' top-1 next token is the same;
* mean KL(reference || candidate) of the next-token distributions, in nats.

Used by `bench/quant.py` (the report) and the quantization tests (a floor on agreement).
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


def greedy_continuation(runner, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference's greedy continuation (scratch cache via `score`, one full pass per token: offline only)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(runner.score(tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def compare(reference, candidate, prompts: Sequence[list[int]], max_tokens: int = 16) -> QualityReport:
    """Agreement and mean KL of `candidate` against `reference` on the continuation positions of each prompt."""
    agree = 0
    kl_sum = 0.0
    total = 0
    for prompt in prompts:
        seq = list(prompt) + greedy_continuation(reference, prompt, max_tokens)
        first = len(prompt) - 1  # logits at this row predict the first generated token
        ref = torch.log_softmax(reference.score(seq)[first:-1], -1)
        cand = torch.log_softmax(candidate.score(seq)[first:-1], -1)
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        kl_sum += float((ref.exp() * (ref - cand)).sum(-1).sum())
        total += ref.shape[0]
    if total == 0:
        raise ValueError("compare needs at least one prompt")
    return QualityReport(agreement=agree / total, mean_kl=kl_sum / total, positions=total)
