"""From requests that advanced in a step to `RequestOutput` deltas: new token ids, safe text, finish reasons.

The scheduler ends requests on token-level conditions (EOS, stop token ids, max_tokens, context length); this
module adds what needs text: incremental detokenisation (never splitting a multi-byte character) and stop
strings (never emitting any part of one). A stop string found here ends the request with reason `stop`; the
caller tells the scheduler (`stop_requests` in the result). A request whose processing raises ends with reason
`error` (`failed_requests`), and the others in the step are processed as usual.

A step can add several tokens to a request (speculative decoding). When a stop string ends inside them, the
tokens after the one that completed it are dropped from the request, so it ends with the same tokens as
decoding one token per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.core.request import FINISHED_STATUSES, FinishReason, Request, RequestStatus
from worker.engine.protocol import RequestOutput
from worker.engine.stop_strings import StopMatcher
from worker.model.tokenizer import Decoder, Detokenizer, incremental_detokenizer


@dataclass(slots=True)
class _State:
    detokenizer: Detokenizer | None
    stops: StopMatcher | None  # None: no stop strings (all decoded text is sent at once)
    num_sent_tokens: int = 0
    prompt_logprobs_sent: bool = False


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    stop_requests: list[tuple[str, str]] = field(default_factory=list)  # (request id, stop string) to finish
    failed_requests: list[tuple[str, str]] = field(default_factory=list)  # (request id, error) to finish


class OutputProcessor:
    def __init__(self, tokenizer: Decoder | None) -> None:
        self._tokenizer = tokenizer

    def add_request(self, request: Request) -> None:
        stops = request.sampling_params.stop if self._tokenizer is not None else ()
        detok = None if self._tokenizer is None else incremental_detokenizer(self._tokenizer, request.prompt_token_ids)
        # on the request (Request.output_state): the step's loop reaches it without a lookup by id
        request.output_state = _State(detok, StopMatcher(stops) if stops else None)

    @staticmethod
    def num_held_chars(request: Request) -> int:
        """Characters of a request's text the processor holds back (a possible start of a stop string)."""
        st = request.output_state
        return 0 if st is None or st.stops is None else st.stops.num_held_chars

    def process(self, requests: list[Request]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        process_one, add_output = self._process_one, result.outputs.append  # once, not per request
        for req in requests:
            try:
                output, stop = process_one(req)
            except Exception as exc:  # noqa: BLE001 - e.g. its tokens do not decode: this request's alone
                error = f"{type(exc).__name__}: {exc}"
                req.output_state = None
                add_output(self._final_output(req, [], "", FinishReason.ERROR, None, error))
                result.failed_requests.append((req.request_id, error))
                continue
            add_output(output)
            if stop is not None:
                result.stop_requests.append((req.request_id, stop))
        return result

    def abort_output(self, request: Request) -> RequestOutput:
        """The final (empty) delta of a request ended from outside the step, e.g. aborted."""
        request.output_state = None
        return self._final_output(request, [], "", request.status.finish_reason, None, request.error)

    def _process_one(self, req: Request) -> tuple[RequestOutput, str | None]:
        # Runs for every running request in every step: locals, no properties, one call per token.
        st = req.output_state
        if st is None:
            raise KeyError(f"request {req.request_id} was never added to the output processor, or has ended")
        out_ids = req.output_token_ids
        first_index = st.num_sent_tokens
        new_ids = out_ids[first_index:]
        st.num_sent_tokens = len(out_ids)
        status = req.status
        finished = status in FINISHED_STATUSES
        params = req.sampling_params
        stop_str = None
        new_text = ""
        detok = st.detokenizer
        if detok is not None:
            # A request ended by EOS or a stop token id shows no text for that token.
            to_decode = new_ids[:-1] if status is RequestStatus.FINISHED_STOPPED else new_ids
            stops = st.stops
            if stops is None:
                if len(to_decode) == 1:
                    new_text = detok.add_token(to_decode[0])
                elif to_decode:
                    new_text = "".join([detok.add_token(token) for token in to_decode])
                if finished:
                    new_text += detok.flush()
            else:
                pieces: list[str] = []
                min_tokens = params.min_tokens
                for offset, token in enumerate(to_decode):
                    delta = detok.add_token(token)
                    if not delta:
                        continue
                    safe, stop_str = stops.feed(delta, first_index + offset + 1 >= min_tokens)  # enabled
                    pieces.append(safe)
                    if stop_str is not None:
                        finished = True
                        new_ids = _truncate(req, first_index + offset + 1, new_ids)
                        break
                if finished and stop_str is None:
                    pieces.append(stops.release())
                    pieces.append(detok.flush())
                new_text = "".join(pieces)
        logprobs = req.output_logprobs[first_index:] if params.logprobs else None
        if finished:
            req.output_state = None
            reason = FinishReason.STOP if stop_str is not None else status.finish_reason
            output = self._final_output(req, new_ids, new_text, reason, logprobs, req.error)
        else:  # a request that goes on: built here, without a call (64 a step)
            output = RequestOutput(
                req.request_id,
                new_ids,
                new_text,
                False,
                None,
                len(req.prompt_token_ids),
                len(out_ids),
                req.num_cached_tokens,
                logprobs,
            )
        if params.top_logprobs:
            output.new_top_logprobs = req.output_top_logprobs[first_index:]
        if params.prompt_logprobs is not None and not st.prompt_logprobs_sent:
            output.prompt_logprobs = list(req.prompt_logprobs)
            st.prompt_logprobs_sent = True
        return output, stop_str

    @staticmethod
    def _final_output(
        req: Request,
        new_ids: list[int],
        new_text: str,
        reason: FinishReason | None,
        logprobs: list[float] | None,
        error: str | None = None,
    ) -> RequestOutput:
        """A request's last delta (ended by the scheduler, a stop string, an abort or an error)."""
        # Positional: keyword arguments cost a dataclass __init__ 0.8 us where these take 0.3.
        return RequestOutput(
            req.request_id,
            new_ids,
            new_text,
            True,  # finished
            reason,
            len(req.prompt_token_ids),
            len(req.output_token_ids),
            req.num_cached_tokens,
            logprobs,
            None,  # new_top_logprobs
            None,  # prompt_logprobs
            error,
        )


def _truncate(req: Request, keep: int, new_ids: list[int]) -> list[int]:
    """Drop the request's output tokens after the first `keep` (a stop string ended at token `keep`)."""
    extra = req.num_output_tokens - keep
    if extra <= 0:
        return new_ids
    del req.output_token_ids[keep:]
    del req.output_logprobs[keep:]
    del req.output_top_logprobs[keep:]
    return new_ids[: len(new_ids) - extra]
