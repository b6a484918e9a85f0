"""Greedy token agreement: the documented per-position definition, normalised by the longer sequence."""

from __future__ import annotations

import pytest

from controllers.quality import PROBE_MAX_TOKENS, PROBE_PROMPTS, Scored, parse_token_id, token_agreement

CASES = [
    ("identical", [[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], 1.0, 2),
    ("one token differs", [[1, 2, 3, 4]], [[1, 9, 3, 4]], 0.75, 0),
    ("diverged then re-converged counts matching positions", [[1, 2, 3, 4]], [[1, 9, 9, 4]], 0.5, 0),
    ("canary stops early: missing positions disagree", [[1, 2, 3, 4]], [[1, 2]], 0.5, 0),
    ("canary runs on: extra positions disagree", [[1, 2]], [[1, 2, 3, 4]], 0.5, 0),
    ("canary produced nothing", [[1, 2, 3, 4]], [[]], 0.0, 0),
    ("token-weighted over prompts", [[1, 2, 3, 4, 5, 6], [1, 2]], [[1, 2, 3, 4, 5, 6], [7, 8]], 6 / 8, 1),
    ("both empty is neutral", [[1, 2], []], [[1, 2], []], 1.0, 2),
    ("nothing at all", [[], []], [[], []], None, 2),
    ("no prompts", [], [], None, 0),
    ("token strings work too", [["The", " cap"]], [["The", " Cap"]], 0.5, 0),
]


@pytest.mark.parametrize(("stable", "canary", "expected", "identical"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_agreement(
    stable: list[list[object]], canary: list[list[object]], expected: float | None, identical: int
) -> None:
    result = token_agreement(stable, canary)
    assert result.value == (pytest.approx(expected) if expected is not None else None)
    assert result.identical_sequences == identical
    assert result.sequences == len(stable)


def test_describe_names_the_counts() -> None:
    text = token_agreement([[1, 2, 3, 4]], [[1, 9, 3, 4]]).describe()
    assert text == "agreement 0.750 (3/4 tokens, 0/1 prompts identical)"
    assert token_agreement([[]], [[]]).describe().startswith("no tokens to compare")


def test_mismatched_prompt_counts_are_an_error() -> None:
    with pytest.raises(ValueError, match="got 2 stable and 1 canary sequences"):
        token_agreement([[1], [2]], [[1]])


def test_probe_prompts_are_fixed_distinct_and_non_empty() -> None:
    assert len(PROBE_PROMPTS) >= 4
    assert len(set(PROBE_PROMPTS)) == len(PROBE_PROMPTS)
    assert all(prompt.strip() for prompt in PROBE_PROMPTS)
    assert 1 <= PROBE_MAX_TOKENS <= 64


@pytest.mark.parametrize("label,expected", [("token_id:0", 0), ("token_id:49151", 49151)])
def test_token_ids_are_read_from_labels(label: str, expected: int) -> None:
    assert parse_token_id(label) == expected


@pytest.mark.parametrize("label", [" Paris", "token_id:", "token_id:-1", "token_id:1.5", "TOKEN_ID:3", "id:3"])
def test_labels_that_are_not_ids_are_refused_with_the_fix(label: str) -> None:
    with pytest.raises(ValueError, match="return-tokens-as-token-ids"):
        parse_token_id(label)


def test_scored_splits_prompt_and_continuation() -> None:
    assert Scored([5, 6, 7, 8], 3).continuation == [8]
    assert Scored([5], 1).continuation == []
