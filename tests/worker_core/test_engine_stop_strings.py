"""StopMatcher: stop strings found in streamed text, text that may start one held back, and bounded work and
memory per request however long the output (issue #18, finding 9)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from worker.core.request import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    Request,
    SamplingParams,
)
from worker.engine.output_processor import OutputProcessor
from worker.engine.stop_strings import StopMatcher
from worker.engine.toy import EOS, ByteTokenizer


def feed_all(deltas: list[str], stops: tuple[str, ...]) -> tuple[str, str | None, int]:
    """(text emitted, stop string found, characters still held) after feeding `deltas` in order."""
    matcher = StopMatcher(stops)
    out = []
    for delta in deltas:
        safe, stop = matcher.feed(delta)
        out.append(safe)
        if stop is not None:
            return "".join(out), stop, matcher.num_held_chars
    return "".join(out), None, matcher.num_held_chars


def reference(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Brute force: the stop string that ends first in `text` (the longest of those ending at the same place)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def proper_prefix_hold(text: str, stops: tuple[str, ...]) -> int:
    """Brute force: the longest suffix of `text` that is a proper prefix of some stop string."""
    return max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)


@pytest.mark.parametrize(
    ("deltas", "stops", "emitted", "stop", "held"),
    [
        (["hello world"], ("wor",), "hello ", "wor", 0),
        (["hello world"], ("xyz",), "hello world", None, 0),
        (["abcabc"], ("c", "bc"), "a", "bc", 0),  # both end at the same character: the longer wins
        (["hel", "lo w", "orld"], ("lo w",), "hel", "lo w", 0),  # a stop string spanning deltas
        (["hello wo"], ("world",), "hello ", None, 2),
        (["hello w"], ("world", "wx"), "hello ", None, 1),
        (["ab"], ("abc",), "", None, 2),
        (["x"], ("x",), "", "x", 0),
        (["ab", "cd"], ("abcd", "bc"), "a", "bc", 0),  # the one that ends first wins
        (["abcd"], ("abcd", "bc"), "a", "bc", 0),  # ... however the text was split
        (["café", "! more"], ("é!",), "caf", "é!", 0),
        (["aaaa"], ("aab",), "aa", None, 2),
    ],
)
def test_matcher(deltas, stops, emitted, stop, held) -> None:
    assert feed_all(deltas, stops) == (emitted, stop, held)


def test_release_returns_the_held_text() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("xST") == ("x", None)
    assert matcher.release() == "ST"
    assert matcher.num_held_chars == 0


def test_disabled_matching_advances_the_state_without_stopping() -> None:
    """Before min_tokens a stop string does not end the request, but one ending after it does (even if it began
    before)."""
    matcher = StopMatcher(("abc",))
    assert matcher.feed("xab", enabled=False) == ("x", None)
    assert matcher.feed("c") == ("", "abc")
    matcher = StopMatcher(("a",))
    assert matcher.feed("a", enabled=False) == ("", None)
    assert matcher.feed("a", enabled=False) == ("a", None)
    assert matcher.feed("a") == ("a", "a")


# (text's characters, stop strings' characters): few characters, so stop strings overlap and recur; or characters
# that start no stop string (x, y, z: skipped by a search, not walked one by one) among ones a regular expression's
# class treats apart
ALPHABETS = [("abc", "abc"), ("ab]^-\\\nxyz.", "ab]^-\\\n.")]


@settings(max_examples=500, deadline=None)
@given(alphabets=st.sampled_from(ALPHABETS), data=st.data())
def test_any_split_gives_the_reference_result_and_holds_only_possible_starts(alphabets, data) -> None:
    text_chars, stop_chars = alphabets
    text = data.draw(st.text(alphabet=text_chars, max_size=40))
    stops = data.draw(st.lists(st.text(alphabet=stop_chars, min_size=1, max_size=5), min_size=1, max_size=4))
    cuts = data.draw(st.lists(st.integers(0, 40), max_size=8))
    stops = tuple(stops)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    matcher = StopMatcher(stops)
    emitted: list[str] = []
    stop = None
    fed = 0
    for a, b in itertools.pairwise(bounds):
        safe, stop = matcher.feed(text[a:b])
        emitted.append(safe)
        fed = b
        if stop is not None:
            break
        # never emitted: exactly the longest suffix that may still become a stop string
        assert "".join(emitted) + text[fed - matcher.num_held_chars : fed] == text[:fed]
        assert matcher.num_held_chars == proper_prefix_hold(text[:fed], stops)
    if stop is None:
        emitted.append(matcher.release())
    assert ("".join(emitted), stop) == reference(text, stops)


@pytest.mark.parametrize(
    ("deltas", "stops", "emitted", "stop", "held"),
    [
        (["xyz", "zy"], ("ab",), "xyzzy", None, 0),  # no character starts a stop string: all of it, at once
        (["xa", "yab"], ("ab",), "xay", "ab", 0),  # back at the root after a false start
        (["x]y", "z^"], ("^-", "]]"), "x]yz", None, 1),
        (["a.b"], ("b", "."), "a", ".", 0),  # "." is a character, not any character
        (["a\\b"], ("\\",), "a", "\\", 0),
    ],
)
def test_matcher_skips_to_the_characters_that_start_a_stop_string(deltas, stops, emitted, stop, held) -> None:
    assert feed_all(deltas, stops) == (emitted, stop, held)


def test_history_kept_per_request_is_bounded_by_the_longest_stop_string() -> None:
    """A long output with the longest allowed stop strings keeps at most (longest - 1) characters of history
    in the stop matcher, and the processor no longer keeps the whole text."""
    stops = tuple("ab" * (MAX_STOP_STRING_CHARS // 2 - 1) + chr(ord("c") + i) * 2 for i in range(MAX_STOP_STRINGS))
    assert all(len(s) == MAX_STOP_STRING_CHARS for s in stops)
    tok = ByteTokenizer()
    proc = OutputProcessor(tok)
    req = Request("r", tok.encode("prompt"), SamplingParams(max_tokens=10_000, stop=stops), eos_token_id=EOS)
    proc.add_request(req)
    most_held = 0
    for token in tok.encode("ab" * 3_000):
        req.output_token_ids.append(token)
        (out,) = proc.process([req]).outputs
        assert not out.finished
        most_held = max(most_held, proc.num_held_chars(req))
    assert most_held == MAX_STOP_STRING_CHARS - 2  # "abab...ab" is as far as any of them gets


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stop": ("x",) * (MAX_STOP_STRINGS + 1)}, "at most 16 stop strings"),
        ({"stop": ("x" * (MAX_STOP_STRING_CHARS + 1),)}, "at most 256 characters"),
        ({"stop": ("",)}, "non-empty"),
    ],
)
def test_stop_strings_are_bounded(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
