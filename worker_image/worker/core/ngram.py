"""Prompt-lookup drafting (n-gram speculation): guess a request's next tokens from its own context.

Why it exists: outputs that copy from the prompt (RAG answers, code edits, summaries, "repeat this passage")
continue a token sequence that already occurred. If the last n tokens of the context occurred earlier, the
tokens that followed that occurrence are a cheap draft; the target model verifies drafts in one forward pass
(see `worker.core.spec_decode`), so a good draft turns one step into several tokens and a bad one costs only
the compute of the rejected positions. No draft model is needed.

The rule follows vLLM's n-gram proposer: the longest suffix n-gram with `min_n <= n <= max_n` that occurs
earlier wins; among its occurrences the earliest one is used; the draft is the (at most) `k` tokens that
followed it. Pure Python (no torch), imported by the scheduler; the search runs in C through `bytes.find` on
the tokens packed as 32-bit integers, so proposing for a request with thousands of tokens costs microseconds.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = 4  # bytes per packed token (array typecode "i" is 32-bit on every platform we run on)


def pack(tokens: Sequence[int]) -> bytes:
    """Token ids packed as native 32-bit integers (what `propose` searches in)."""
    return array("i", tokens).tobytes()


def propose(tokens: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
    """At most `k` draft tokens continuing `tokens`, or [] when no suffix n-gram (min_n <= n <= max_n) recurs.

    The matched occurrence must end before the last token, so at least one token follows it; the draft is cut
    short when the context ends first.
    """
    num = len(tokens)
    if k < 1 or min_n < 1 or max_n < min_n or num < min_n + 1:
        return []
    # Occurrences must start at or before num - n - 1 (a token must follow them); search the packed tokens
    # without the last one so that the suffix itself never matches.
    haystack = pack(tokens[: num - 1])
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        needle = pack(tokens[num - n :])
        start = _find_aligned(haystack, needle)
        if start >= 0:
            follow = start + n
            return list(tokens[follow : follow + k])
    return []


def _find_aligned(haystack: bytes, needle: bytes) -> int:
    """Token index of the first occurrence of `needle` in `haystack` at a token boundary, or -1."""
    pos = haystack.find(needle)
    while pos >= 0 and pos % _ITEM:
        pos = haystack.find(needle, pos + 1)
    return -1 if pos < 0 else pos // _ITEM
