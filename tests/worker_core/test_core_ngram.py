"""The prompt-lookup proposer and the verification rule, as tables (pure Python)."""

from __future__ import annotations

import pytest
from worker.core.ngram import propose
from worker.core.spec_decode import SpecDecodeStats, accepted_prefix


@pytest.mark.parametrize(
    ("tokens", "k", "max_n", "min_n", "expected"),
    [
        # the suffix [1, 2] occurred at the start: the two tokens after it
        ([1, 2, 3, 4, 1, 2], 2, 2, 2, [3, 4]),
        # k larger than what follows: cut at the end of the context
        ([1, 2, 3, 1, 2], 5, 2, 2, [3, 1, 2]),
        # no recurrence of any suffix n-gram in range: nothing
        ([1, 2, 3, 4, 5], 3, 3, 1, []),
        # the longest n wins: [7, 8, 9] recurs once (-> 10), [8, 9] earlier (-> 11)
        ([8, 9, 11, 7, 8, 9, 10, 5, 7, 8, 9], 1, 3, 2, [10]),
        # ... unless max_n forbids it: then [8, 9] at its earliest occurrence
        ([8, 9, 11, 7, 8, 9, 10, 5, 7, 8, 9], 1, 2, 2, [11]),
        # min_n 1: a single recurring token is enough; earliest occurrence
        ([5, 6, 7, 5, 8, 5], 2, 3, 1, [6, 7]),
        # ... min_n 2 refuses it
        ([5, 6, 7, 5, 8, 5], 2, 3, 2, []),
        # overlapping occurrences in a run: the suffix itself never matches, the shifted one does
        ([4, 4, 4, 4], 3, 2, 2, [4, 4]),
        # too short for any n-gram plus a following token
        ([1], 3, 2, 1, []),
        ([1, 1], 3, 2, 2, []),
        ([1, 1], 3, 2, 1, [1]),
        # k = 0 proposes nothing
        ([1, 2, 1, 2], 0, 2, 1, []),
        # large token ids (packed as 32-bit): a byte-level match at an unaligned offset must not count
        ([256, 1, 0, 0, 0, 256, 1], 1, 1, 1, [0]),
        ([0x01000000, 0x00000001, 0x02, 0x00010000], 1, 1, 1, []),
        ([2**31 - 1, 3, 2**31 - 1], 2, 1, 1, [3, 2**31 - 1]),
    ],
)
def test_propose(tokens: list[int], k: int, max_n: int, min_n: int, expected: list[int]) -> None:
    assert propose(tokens, k, max_n, min_n) == expected


@pytest.mark.parametrize(
    ("drafts", "sampled", "expected"),
    [
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted + the bonus token
        ([1, 2, 3], [1, 9], [1, 9]),  # first mismatch at 1: the target's token replaces the draft
        ([1, 2, 3], [9], [9]),  # nothing accepted: still one token, as plain decoding
        ([1, 2, 3], [1, 9, 3, 4], [1, 9]),  # samples after the mismatch are ignored
        ([], [5], [5]),
    ],
)
def test_accepted_prefix(drafts: list[int], sampled: list[int], expected: list[int]) -> None:
    assert accepted_prefix(drafts, sampled) == expected


def test_stats_count_drafts_tokens_and_positions() -> None:
    stats = SpecDecodeStats()
    stats.observe(3, 2)
    stats.observe(2, 0)
    stats.observe(0, 0)  # a step without drafts is not a draft
    stats.observe(4, 4)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 6)
    assert stats.accepted_per_pos == [2, 2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(6 / 9)
    copy = stats.copy()
    stats.observe(1, 1)
    assert copy.num_drafts == 3 and copy.accepted_per_pos == [2, 2, 1, 1]
