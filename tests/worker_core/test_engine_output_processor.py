"""Detokenised deltas through the output processor: never a split character, never part of a stop string."""

from __future__ import annotations

import pytest
from worker.core.request import FinishReason, Request, RequestStatus, SamplingParams
from worker.engine.output_processor import OutputProcessor
from worker.engine.toy import EOS, ByteTokenizer
from worker.model.tokenizer import IncrementalDetokenizer

TOK = ByteTokenizer()


def _deltas(text: str, prompt: str = "hi ") -> list[str]:
    detok = IncrementalDetokenizer(TOK, TOK.encode(prompt))
    return [detok.add_tokens([t]) for t in TOK.encode(text)] + [detok.flush()]


@pytest.mark.parametrize("text", ["hello", "héllo wörld", "東京", "a😀b", "😀😀", ""])
def test_deltas_join_to_the_text_and_never_split_a_character(text: str) -> None:
    deltas = _deltas(text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_multibyte_character_arrives_whole_with_its_last_byte() -> None:
    # 😀 is 4 bytes: nothing for the first three, the whole character with the fourth.
    assert _deltas("😀") == ["", "", "", "😀", ""]


def test_an_unfinished_character_at_the_end_is_flushed_as_replacement() -> None:
    detok = IncrementalDetokenizer(TOK, [])
    assert detok.add_tokens([0xE6]) == ""
    assert detok.flush() == "\ufffd"


def _run(tokens: list[int], params: SamplingParams, final_status: RequestStatus | None = None):
    """Feed tokens one per step through an OutputProcessor, as the engine does; returns the deltas."""
    proc = OutputProcessor(TOK)
    req = Request("r", TOK.encode("prompt: "), params, eos_token_id=EOS)
    proc.add_request(req)
    outs = []
    stop_requests = []
    for i, tok in enumerate(tokens):
        req.output_token_ids.append(tok)
        if i == len(tokens) - 1 and final_status is not None:
            req.status = final_status
        processed = proc.process([req])
        outs += processed.outputs
        stop_requests += processed.stop_requests
        if processed.outputs[-1].finished:
            break
    return outs, stop_requests


def test_stop_string_across_tokens_cuts_the_output_before_it() -> None:
    params = SamplingParams(max_tokens=50, stop=("STOP",))
    outs, stops = _run(TOK.encode("ab STOP cd"), params)
    text = "".join(o.new_text for o in outs)
    assert text == "ab "
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.STOP
    assert stops == [("r", "STOP")]
    assert sum(len(o.new_token_ids) for o in outs) == len("ab STOP")  # tokens up to the stop string's end


def test_text_that_may_start_a_stop_string_is_held_until_it_cannot() -> None:
    params = SamplingParams(max_tokens=50, stop=("STOP",))
    outs, _ = _run(TOK.encode("xSTx"), params, final_status=RequestStatus.FINISHED_LENGTH)
    assert [o.new_text for o in outs] == ["x", "", "", "STx"]
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_held_text_is_released_when_the_request_ends() -> None:
    params = SamplingParams(max_tokens=50, stop=("STOP",))
    outs, _ = _run(TOK.encode("xST"), params, final_status=RequestStatus.FINISHED_LENGTH)
    assert "".join(o.new_text for o in outs) == "xST"


def test_stop_string_inside_a_multibyte_sequence_run() -> None:
    params = SamplingParams(max_tokens=50, stop=("é!",))
    outs, stops = _run(TOK.encode("café! more"), params)
    assert "".join(o.new_text for o in outs) == "caf"
    assert stops == [("r", "é!")]


def test_stop_token_and_eos_text_is_not_shown_but_the_token_is_returned() -> None:
    tokens = TOK.encode("ok") + [ord("\n")]
    outs, _ = _run(tokens, SamplingParams(stop_token_ids=(ord("\n"),)), final_status=RequestStatus.FINISHED_STOPPED)
    assert "".join(o.new_text for o in outs) == "ok"
    assert [t for o in outs for t in o.new_token_ids] == tokens
    outs, _ = _run(TOK.encode("ok") + [EOS], SamplingParams(), final_status=RequestStatus.FINISHED_STOPPED)
    assert "".join(o.new_text for o in outs) == "ok"


def test_stop_strings_wait_for_min_tokens() -> None:
    params = SamplingParams(max_tokens=50, stop=("a",), min_tokens=3)
    outs, stops = _run(TOK.encode("aaaa"), params)
    assert "".join(o.new_text for o in outs) == "aa"  # the third token may stop: cut before it
    assert stops == [("r", "a")]


def test_deltas_carry_counts_and_logprobs() -> None:
    proc = OutputProcessor(TOK)
    req = Request("r", [1, 2, 3], SamplingParams(logprobs=True), eos_token_id=EOS)
    req.num_cached_tokens = 2
    proc.add_request(req)
    req.output_token_ids += [104, 105]
    req.output_logprobs += [-0.5, -0.25]
    (out,) = proc.process([req]).outputs
    assert (out.new_token_ids, out.new_text, out.new_logprobs) == ([104, 105], "hi", [-0.5, -0.25])
    assert (out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens) == (3, 2, 2)
    assert not out.finished and out.finish_reason is None


def test_without_a_tokenizer_only_token_ids_flow() -> None:
    proc = OutputProcessor(None)
    req = Request("r", [1], SamplingParams(), eos_token_id=EOS)
    proc.add_request(req)
    req.output_token_ids.append(104)
    (out,) = proc.process([req]).outputs
    assert (out.new_token_ids, out.new_text) == ([104], "")


class _CountingDecoder:
    """The byte tokenizer, counting how many ids it decodes."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return TOK.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("n", [100, 1000, 4000])
def test_bytes_that_never_form_a_character_cost_linear_time_and_come_out_as_flush_would(n: int) -> None:
    # 0x80 is a lone UTF-8 continuation byte: no number of them ever completes a character
    counting = _CountingDecoder()
    detok = IncrementalDetokenizer(counting, [])
    deltas = [detok.add_tokens([0x80]) for _ in range(n)] + [detok.flush()]
    assert "".join(deltas) == TOK.decode([0x80] * n)  # the same text as holding everything back until the end
    held = IncrementalDetokenizer.MAX_HELD_TOKENS + IncrementalDetokenizer.CONTEXT_TOKENS
    assert counting.decoded <= 2 * held * (n + 1), "decoding grew faster than the output"  # n^2/2 without the bound


@pytest.mark.parametrize("end", ["length", "abort", "error"])
def test_a_request_ends_without_its_output_state(end: str) -> None:
    # The state rides on the request for the step's loop (Request.output_state): an ended request keeps none, so
    # a caller that holds the request holds no detokenizer, and a request whose state is gone fails alone, never
    # reads another's.
    proc = OutputProcessor(TOK)
    req = Request("r", TOK.encode("hi "), SamplingParams(max_tokens=1, stop=["zz"]), eos_token_id=EOS)
    proc.add_request(req)
    other = Request("o", TOK.encode("hi "), SamplingParams(max_tokens=9), eos_token_id=EOS)
    proc.add_request(other)
    assert req.output_state is not None and proc.num_held_chars(req) == 0
    req.output_token_ids.append(TOK.encode("z")[0])
    if end == "length":
        req.status = RequestStatus.FINISHED_LENGTH
        (out,) = proc.process([req]).outputs
        assert out.finished and out.new_text == "z"  # the held "z" released at the end
    elif end == "abort":
        req.status = RequestStatus.FINISHED_ABORTED
        assert proc.abort_output(req).finished
    else:
        req.output_state.detokenizer = _Raises()  # a broken state: its processing raises
        assert proc.process([req]).failed_requests[0][0] == "r"
    assert req.output_state is None and proc.num_held_chars(req) == 0
    (failed,) = proc.process([req]).failed_requests  # ended: processing it again fails it alone
    assert failed[0] == "r" and "never added" in failed[1]
    other.output_token_ids.append(TOK.encode("k")[0])
    assert proc.process([other]).outputs[0].new_text == "k"


class _Raises:
    def add_token(self, token: int) -> str:
        raise ValueError("no such token")
