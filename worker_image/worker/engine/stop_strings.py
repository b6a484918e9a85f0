"""Stop strings on streamed text: find them in new text, and hold back text that may still become one.

Two rules keep a stream correct: output is cut before a stop string once it appears, and text that could still
turn out to be the start of a stop string is not emitted until it cannot, so a client never sees any part of a
stop string. (Detokenisation itself, which never splits a multi-byte character, is
`worker.model.tokenizer.IncrementalDetokenizer`.)
"""

from __future__ import annotations


def find_stop(text: str, stops: tuple[str, ...], new_from: int) -> tuple[int, str] | None:
    """Earliest stop string in `text` that ends after index `new_from` (text before it was already searched)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, new_from - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string (not yet safe)."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold
