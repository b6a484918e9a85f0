"""Turn one row of logits per sampled request into a token: greedy, temperature, top-k, top-p, seeded.

Greedy rows (the common case in tests and benchmarks) are one `argmax` for the whole batch. Random rows are
sampled one by one because each may own a seeded `torch.Generator` (reproducible per request, whatever else
shares the batch). Sampling uses the exponential race (`argmax(p / e)`, `e ~ Exp(1)`), which draws exactly
from `p` and needs one random tensor per row. Logprobs, when asked, are of the chosen token (and its top-k
alternatives) under the raw model distribution (before temperature/top-k/top-p), as vLLM reports them by default;
`logit_bias` and the `min_tokens` ban change the logits themselves, so the logprobs reflect them.

A row whose own parameters make a torch op fail (a token id out of range, a generator that cannot draw) is reported
in `SamplerOutput.errors` with its exception; the other rows are sampled as if it were not there.

`verify` checks a request's draft tokens (speculative decoding, `worker.core.spec_decode`): it samples each
position exactly as `__call__` would sample a request that had already produced the tokens before it (its own
`min_tokens` state, the same random stream), in order, until a sample differs from the draft. For a point-mass
draft this is rejection sampling: the draft is kept with probability p(draft), and a rejected position yields a
token from p with the draft removed, renormalised; and a request's generator is drawn once per produced token,
with or without drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from worker.core.request import Logprob, SamplingParams
from worker.core.spec_decode import accepted_prefix


@dataclass(frozen=True)
class SampleRequest:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    generator: torch.Generator | None  # None: the sampler's shared generator
    num_output_tokens: int = 0
    eos_token_id: int | None = None


def min_tokens_banned(req: SampleRequest) -> list[int]:
    """Token ids that may not be sampled yet because `min_tokens` is not reached."""
    p = req.params
    if req.num_output_tokens >= p.min_tokens:
        return []
    banned = list(p.stop_token_ids)
    if req.eos_token_id is not None and not p.ignore_eos:
        banned.append(req.eos_token_id)
    return banned


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and outside the smallest top-p nucleus of one 1-D row."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token if the mass strictly before it is below top_p (the first token is always kept).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def top_tokens(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely (token id, logprob) of one row of log-probabilities, most likely first."""
    if k <= 0:
        return ()
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return tuple(zip(ids.tolist(), values.tolist()))


def adjust_row(logits: torch.Tensor, row: int, req: SampleRequest) -> None:
    """Apply a row's own logit changes in place: `logit_bias`, then the `min_tokens` ban (which must win)."""
    bias = req.params.logit_bias
    if bias:
        ids = torch.tensor([t for t, _ in bias], device=logits.device)
        logits[row, ids] += torch.tensor([v for _, v in bias], dtype=logits.dtype, device=logits.device)
    banned = min_tokens_banned(req)
    if banned:
        logits[row, banned] = float("-inf")


class SamplerOutput(NamedTuple):
    tokens: list[int]  # one per row; meaningless for rows in `errors`
    logprobs: list[Logprob | None]
    errors: dict[int, Exception]  # row -> why that row could not be sampled


class Sampler:
    def __init__(
        self, generator: torch.Generator, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """`argmax`: a row-wise argmax equal to `logits.argmax(-1)` (the extension's `argmax_rows`, 10x faster on
        64 rows of a 49k vocabulary), or None for torch's."""
        self.generator = generator  # for unseeded random requests
        self._argmax = argmax

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        if self._argmax is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
            return self._argmax(logits).tolist()
        return logits.argmax(dim=-1).tolist()

    def __call__(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> SamplerOutput:
        """Sample one token per row of `logits` [N, vocab] (fp32); rows that fail are reported, not raised."""
        errors: dict[int, Exception] = {}
        for i, req in enumerate(requests):
            if req.params.logit_bias or req.num_output_tokens < req.params.min_tokens:
                try:
                    adjust_row(logits, i, req)
                except Exception as exc:  # noqa: BLE001 - whatever it is, it is this row's alone
                    errors[i] = exc
        tokens = self._greedy(logits)
        for i, req in enumerate(requests):
            if not req.params.greedy and i not in errors:
                try:
                    tokens[i] = self._sample_row(logits[i], req)
                except Exception as exc:  # noqa: BLE001
                    errors[i] = exc
        logprobs: list[Logprob | None] = [None] * len(requests)
        want = [i for i, r in enumerate(requests) if r.params.logprobs and i not in errors]
        if want:
            rows = torch.tensor(want)
            lp = torch.log_softmax(logits[rows], dim=-1)
            chosen = torch.tensor([tokens[i] for i in want])
            values = lp.gather(1, chosen[:, None]).squeeze(1).tolist()
            for row, (i, value) in enumerate(zip(want, values, strict=True)):
                try:
                    logprobs[i] = Logprob(value, top_tokens(lp[row], requests[i].params.top_logprobs))
                except Exception as exc:  # noqa: BLE001
                    errors[i] = exc
        return SamplerOutput(tokens, logprobs, errors)

    def verify(self, logits: torch.Tensor, drafts: Sequence[int], req: SampleRequest) -> list[int]:
        """The tokens a request gains from its drafts: `logits` [len(drafts) + 1, vocab] (fp32) are the target's at
        the last known position and after each draft. Raises when the row's parameters make a torch op fail."""
        params = req.params
        if logits.shape[0] != len(drafts) + 1:
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(drafts)} drafts")
        rows = [replace(req, num_output_tokens=req.num_output_tokens + i) for i in range(len(drafts) + 1)]
        for i, row in enumerate(rows):
            if params.logit_bias or row.num_output_tokens < params.min_tokens:
                adjust_row(logits, i, row)
        if params.greedy:
            return accepted_prefix(drafts, self._greedy(logits))
        out: list[int] = []
        for i, row in enumerate(rows):  # one draw per produced token, stopping at the first mismatch
            token = self._sample_row(logits[i], row)
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                break
        return out

    def _sample_row(self, row: torch.Tensor, req: SampleRequest) -> int:
        p = req.params
        scaled = apply_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
        probs = scaled.softmax(-1)
        gen = req.generator if req.generator is not None else self.generator
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return int((probs / noise).argmax())
