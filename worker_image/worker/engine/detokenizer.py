"""Incremental detokenisation and stop strings: from a growing list of token ids to safe text deltas.

Only `Tokenizer.decode` is needed, so it works for any tokenizer (byte-level BPE, SentencePiece, the toy byte
tokenizer). Two rules keep streamed text correct:
- a delta never ends inside a multi-byte character: while the decoded tail ends in U+FFFD (an incomplete UTF-8
  sequence) the tokens are held until the character completes;
- text that could still turn out to be the start of a stop string is held back, and output is cut before the
  stop string once it appears, so a client never sees any part of a stop string.
"""

from __future__ import annotations

from typing import Protocol

# Decoding a few tokens before the new ones keeps tokenizers that merge across token boundaries (leading
# spaces in SentencePiece, byte fallback) producing the same text as decoding the whole sequence.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for tokens added one at a time (vLLM's prefix/read-offset scheme)."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the context window that is decoded
        self._read_offset = len(self._ids)  # tokens before this are already in the text

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text of tokens still held (an incomplete character at the very end shows as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_INCOMPLETE) and not final):
            return ""
        # Drop tokens that no longer matter for the context window, keeping the list short.
        del self._ids[: self._prefix_offset]
        self._prefix_offset = self._read_offset - self._prefix_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


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
