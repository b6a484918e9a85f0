"""Teacher-forced greedy agreement between a canary and the stable revision, and the fixed prompts it is measured on.

Why it exists: latency and error rate cannot see a quantized canary that answers fast but wrong. When a rollout
changes a variant's quantization, the operator (`fleet_operator.quality_probe`) has one stable pod continue each
fixed prompt greedily (temperature 0), then has one canary pod score that exact token sequence (teacher forcing:
`echo` + `logprobs=1`), and compares here, position by position, stable's token with the canary's most likely
token given the same prefix. The canary analysis (`controllers.analysis`) fails the check when agreement is below
`spec.rollout.canary.analysis.qualityMinAgreement`.

Definition. For prompt i, stable's greedy continuation `s_i` and the canary's argmax `c_i` at each of its
positions (so `c_i[k]` is what the canary would emit after the prompt and `s_i[:k]`):

    matched_i  = #{ k < min(len s_i, len c_i) : s_i[k] == c_i[k] }
    compared_i = max(len s_i, len c_i)

    agreement  = sum_i matched_i / sum_i compared_i        (token-weighted over all prompts)

It is the fraction of next-token decisions on which the canary agrees with stable: one near-tie flip costs one
position, not the rest of the sequence, which is what comparing two free-running generations would charge
(SmolLM2-135M int4 vs fp32 on these prompts: 0.98-0.99 teacher-forced, 0.60-0.69 free-running). The lengths match
when both sides answered in full; the denominator is the longer one so a truncated answer loses the positions it
lacks. A prompt where stable produced nothing adds 0 / 0 and is neutral; if no prompt produced any token the
agreement is undefined (`None`), which the analysis treats as missing data. Tokens are compared by equality only.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# Fixed probe prompts: short, varied (facts, code, lists, arithmetic, prose, instructions), plain text for
# /v1/completions. Fixed so that results are comparable between checks and rollouts; changing them changes what
# a given `qualityMinAgreement` means.
PROBE_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Q: What is 12 times 12?\nA:",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
)

# Tokens generated per probe prompt: enough to see divergence, few enough to keep a probe cheap on CPU.
PROBE_MAX_TOKENS = 16


@dataclass(frozen=True)
class Scored:
    """A prompt's token ids followed by its greedy continuation, as the stable pod returned them."""

    token_ids: list[int]
    num_prompt: int

    @property
    def continuation(self) -> list[int]:
        return self.token_ids[self.num_prompt :]


TOKEN_ID_PREFIX = "token_id:"


def parse_token_id(label: str) -> int:
    """`token_id:123` -> 123 (how llmfleet's worker names tokens in logprobs); ValueError for anything else."""
    if not label.startswith(TOKEN_ID_PREFIX) or not label[len(TOKEN_ID_PREFIX) :].isdigit():
        raise ValueError(
            f"token {label[:40]!r} is not named by id (`token_id:N`): the probe needs llmfleet's worker, or vLLM "
            "started with --return-tokens-as-token-ids"
        )
    return int(label[len(TOKEN_ID_PREFIX) :])


@dataclass(frozen=True)
class Agreement:
    """Token agreement of canary vs stable over a set of prompts (see the module docstring for the definition)."""

    matched_tokens: int
    compared_tokens: int
    identical_sequences: int
    sequences: int

    @property
    def value(self) -> float | None:
        """matched / compared in [0, 1]; None when no prompt produced any token (nothing to judge)."""
        if self.compared_tokens == 0:
            return None
        return self.matched_tokens / self.compared_tokens

    def describe(self) -> str:
        value = self.value
        head = "no tokens to compare" if value is None else f"agreement {value:.3f}"
        return (
            f"{head} ({self.matched_tokens}/{self.compared_tokens} tokens, "
            f"{self.identical_sequences}/{self.sequences} prompts identical)"
        )


def token_agreement(stable: Sequence[Sequence[Hashable]], canary: Sequence[Sequence[Hashable]]) -> Agreement:
    """Per-position token agreement of `canary` against `stable`, one token sequence per prompt each.

    Raises ValueError when the two lists do not hold the same number of sequences (they must answer the same
    prompts in the same order).
    """
    if len(stable) != len(canary):
        raise ValueError(
            f"token agreement needs one canary sequence per stable sequence: got {len(stable)} stable and "
            f"{len(canary)} canary sequences"
        )
    matched = compared = identical = 0
    for reference, candidate in zip(stable, canary, strict=True):
        shared = min(len(reference), len(candidate))
        matched += sum(1 for k in range(shared) if reference[k] == candidate[k])
        compared += max(len(reference), len(candidate))
        identical += int(list(reference) == list(candidate))
    return Agreement(
        matched_tokens=matched, compared_tokens=compared, identical_sequences=identical, sequences=len(stable)
    )
