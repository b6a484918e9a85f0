"""Greedy token agreement between a canary and the stable revision, and the fixed prompts it is measured on.

Why it exists: latency and error rate cannot see a quantized canary that answers fast but wrong. When a rollout
changes a variant's quantization, the operator sends the same prompts greedily (temperature 0) to one stable and
one canary pod (`fleet_operator.quality_probe`) and compares the generated tokens here; the canary analysis
(`controllers.analysis`) fails the check when agreement is below `spec.rollout.canary.analysis.qualityMinAgreement`.

Definition (per-position agreement, normalised by the longer sequence). For prompt i with stable tokens `s_i`
and canary tokens `c_i`:

    matched_i  = #{ k < min(len s_i, len c_i) : s_i[k] == c_i[k] }
    compared_i = max(len s_i, len c_i)

    agreement  = sum_i matched_i / sum_i compared_i        (token-weighted over all prompts)

Positions are compared only up to the shorter sequence, but the denominator is the longer one, so a canary that
stops early (or runs on where stable stopped) loses the positions it did not share: ending after one matching
token does not score 1.0. A prompt where both sides produced nothing adds 0 / 0 and is neutral; if no prompt
produced any token the agreement is undefined (`None`), which the analysis treats as missing data.

Once two greedy generations diverge, later tokens continue different prefixes and mostly disagree, so this
measure is close to "how far do they go together" while still crediting re-converging text. Tokens are compared
by equality only, so they may be token ids or token strings, as long as both sides use the same scheme (same
tokenizer; the probe asks both pods for the same representation).
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


def token_agreement(
    stable: Sequence[Sequence[Hashable]], canary: Sequence[Sequence[Hashable]]
) -> Agreement:
    """Per-position greedy token agreement of `canary` against `stable`, one token sequence per prompt each.

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
