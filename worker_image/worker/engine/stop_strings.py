"""Stop strings on streamed text: find them in new text, and hold back text that may still become one.

Two rules keep a stream correct: output is cut before a stop string once it appears, and text that could still
turn out to be the start of a stop string is not emitted until it cannot, so a client never sees any part of a
stop string. (Detokenisation itself, which never splits a multi-byte character, is
`worker.model.tokenizer.IncrementalDetokenizer`.)

`StopMatcher` is an Aho-Corasick automaton over a request's stop strings, built once at admission. Its state
after any text is the longest suffix of that text which is a prefix of some stop string, which is exactly the
text to hold back. So each step costs one transition per new character, whatever the number and length of the
stop strings, and a request keeps at most (longest stop string - 1) characters of history: no search over the
text generated so far, no slicing that grows with it. When stop strings overlap, the one that ends first in the
text wins (the longest of those ending at the same character), so the result does not depend on how the text
was split into deltas. While nothing is held (the automaton at its root), characters that start no stop string
leave it there: `feed` skips to the next one that does with one `re` search (C) instead of a transition per
character, so most deltas of most requests cost one call (at 64 running requests each with a stop string, the
per-character loop took about a third of the engine's step outside the model). Imports nothing of ours.
"""

from __future__ import annotations

import re


class StopMatcher:
    """Feed text as it is generated; get back what is safe to emit, and the stop string once one appears."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        # Node 0 is the root (the empty prefix). Per node: children, failure link, depth (length of its prefix),
        # and the longest stop string that is a suffix of its prefix ("" when none).
        self._children: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._match = [""]
        for stop in stops:
            self._insert(stop)
        self._link()
        # The characters that start a stop string: from the root, every other character leads back to the root.
        self._next_start = re.compile("[" + "".join(re.escape(c) for c in sorted(self._children[0])) + "]").search
        self._state = 0
        self._held = ""  # text fed but not yet emitted: the last _depth[_state] characters

    def _insert(self, stop: str) -> None:
        node = 0
        for ch in stop:
            nxt = self._children[node].get(ch)
            if nxt is None:
                nxt = len(self._children)
                self._children[node][ch] = nxt
                self._children.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._match.append("")
            node = nxt
        self._match[node] = stop

    def _link(self) -> None:
        """Failure links breadth first: a node's link is the longest proper suffix of its prefix in the trie."""
        queue = list(self._children[0].values())
        for node in queue:  # the list grows while it is walked: a breadth-first pass over every node once
            for ch, child in self._children[node].items():
                self._fail[child] = 0 if node == 0 else self._next(self._fail[node], ch)
                if not self._match[child]:
                    self._match[child] = self._match[self._fail[child]]
                queue.append(child)

    def _next(self, node: int, ch: str) -> int:
        while True:
            nxt = self._children[node].get(ch)
            if nxt is not None:
                return nxt
            if node == 0:
                return 0
            node = self._fail[node]

    @property
    def num_held_chars(self) -> int:
        """Characters of history kept: at most the longest stop string's length minus one."""
        return len(self._held)

    def feed(self, text: str, enabled: bool = True) -> tuple[str, str | None]:
        """Take new text; return (text now safe to emit, the stop string found or None).

        With a stop string found, the returned text ends right before it and the matcher must not be fed again.
        `enabled=False` (min_tokens not reached yet) advances the state without ending on a match, so a stop
        string that starts before the request may stop and ends after it is still found.
        """
        state = self._state
        i, n = 0, len(text)
        if state == 0:
            found = self._next_start(text)
            if found is None:  # nothing held (the root's depth is 0), nothing to hold
                return text, None
            i = found.start()
        while i < n:
            state = self._next(state, text[i])
            stop = self._match[state]
            if stop and enabled:
                pending = self._held + text[: i + 1]
                self._state, self._held = 0, ""
                return pending[: len(pending) - len(stop)], stop
            i += 1
            if state == 0:  # back at the root: skip to the next character that starts a stop string
                found = self._next_start(text, i)
                if found is None:
                    break
                i = found.start()
        self._state = state
        pending = self._held + text
        keep = min(self._depth[state], len(pending))
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], None

    def release(self) -> str:
        """The request ended for another reason: the held-back text, which can no longer become a stop string."""
        held, self._held, self._state = self._held, "", 0
        return held
