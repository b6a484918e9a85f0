"""One generation request from admission to the last byte: prepare (tokenize, admit), drive the engine stream
(deadline, server-side abort, fault delays, metrics), and shape the result as an OpenAI response or SSE stream.

Preparing never blocks the event loop on a prompt's size: a prompt whose byte length proves it too long for the
context is refused untokenized (`admission.check_prompt_bytes`), and chat-template rendering and tokenization
run on the service's `TokenizerPool`.

The engine request is always aborted unless it finished: the driver's `finally` closes the engine stream and
calls `abort`, whether the client disconnected (the task is cancelled), the deadline passed, or a drain timed out.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from worker.core.request import FinishReason, Logprob, SamplingParams
from worker.engine.protocol import EngineDeadError, QueueFullError, RequestOutput
from worker.metrics import CLIENT_DISCONNECT, STREAM_ABORTED, STREAM_ERROR
from worker.server import openai_models as oai
from worker.server.admission import Limits, Load, admit, check_prompt_bytes
from worker.server.errors import ApiError, internal_error
from worker.server.inflight import InflightRequest
from worker.server.service import WorkerService

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-llmfleet-timeout-seconds"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class Prepared:
    kind: Kind
    request_id: str  # the engine's and the response's id (`cmpl-...`)
    x_request_id: str  # the HTTP request's id (`x-request-id`): in error answers and the log
    model: str
    created: int
    arrival: float  # service clock
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    timeout_s: float | None
    stream: bool
    include_usage: bool
    echo_text: str | None = None  # completions with `echo`: the prompt text returned before the completion
    lora_name: str | None = None  # the LoRA adapter `model` selected; None: the base model


def parse_timeout_header(value: str | None, setting: float | None) -> float | None:
    """The effective deadline: the header's (seconds, > 0) and the setting's, whichever is shorter."""
    if value is None:
        return setting
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ApiError(
            400,
            f"header {TIMEOUT_HEADER} must be a positive number of seconds, got {value!r}",
            param=TIMEOUT_HEADER,
            code="invalid_value",
        )
    return seconds if setting is None else min(seconds, setting)


def _chat_prompt_ids(service: WorkerService, body: oai.ChatCompletionRequest) -> list[int]:
    """Render the chat template, check the text's size, tokenize it (on a tokenizer thread)."""
    engine = service.engine
    try:
        text = engine.apply_chat_template(body.template_messages(), body.add_generation_prompt)
    except Exception as err:  # a template raising on the given roles/order is the client's problem
        raise ApiError(
            400, f"the chat template rejected the messages: {err}", param="messages", code="invalid_messages"
        ) from err
    check_prompt_bytes(len(text.encode()), engine.max_model_len, service.max_bytes_per_token)
    return engine.tokenize(text)


async def prepare(
    service: WorkerService,
    body: oai.CompletionRequest | oai.ChatCompletionRequest,
    kind: Kind,
    timeout_header: str | None,
    x_request_id: str,
) -> Prepared:
    """Check that the worker can take the request and that the request is acceptable; raise ApiError if not."""
    arrival = service.clock()
    service.check_accepting()
    service.faults.maybe_fail()
    lora_name = service.resolve_model(body.model)
    name = service.model_name if lora_name is None or body.model is None else body.model
    engine = service.engine
    if isinstance(body, oai.ChatCompletionRequest):
        prompt_ids = await service.tokenizer_pool.run(_chat_prompt_ids, service, body)
        default_max = None
    elif isinstance(body.prompt, str):
        check_prompt_bytes(len(body.prompt.encode()), engine.max_model_len, service.max_bytes_per_token)
        prompt_ids = await service.tokenizer_pool.run(engine.tokenize, body.prompt)
        default_max = DEFAULT_COMPLETION_MAX_TOKENS
    else:
        prompt_ids = list(body.prompt)
        default_max = DEFAULT_COMPLETION_MAX_TOKENS
    service.check_accepting()  # a drain may have started while the prompt was tokenized
    stats = engine.stats()
    settings = service.settings
    limits = Limits(
        engine.max_model_len,
        settings.max_tokens_cap,
        settings.max_tokens_policy,
        settings.max_waiting,
        settings.retry_after_s,
    )
    load = Load(stats.num_waiting, stats.num_running, len(service.inflight))
    admitted = admit(len(prompt_ids), body.requested_max_tokens(), default_max, limits, load)
    try:
        params = body.sampling_params(admitted.max_tokens)
    except ValueError as err:
        raise ApiError(400, str(err), code="invalid_value") from err
    echo_text = None
    if isinstance(body, oai.CompletionRequest) and body.echo:
        echo_text = body.prompt if isinstance(body.prompt, str) else engine.detokenize(prompt_ids)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return Prepared(
        kind=kind,
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        x_request_id=x_request_id,
        model=name,
        created=int(time.time()),
        arrival=arrival,
        prompt_ids=prompt_ids,
        params=params,
        priority=body.priority,
        timeout_s=parse_timeout_header(timeout_header, settings.request_timeout_s),
        stream=body.stream,
        include_usage=body.include_usage,
        echo_text=echo_text,
        lora_name=lora_name,
    )


def abort_error(reason: str | None, timeout_s: float | None) -> ApiError:
    """The error of a request the server aborted: its deadline (no reason) or `reason` (a drain timeout)."""
    if reason is None:
        return ApiError(
            504, f"the request exceeded its deadline of {timeout_s:g} s and was aborted", code="deadline_exceeded"
        )
    return ApiError(503, f"the request was aborted: {reason}", code="aborted")


async def drive(service: WorkerService, prep: Prepared, entry: InflightRequest) -> AsyncGenerator[RequestOutput]:
    """The engine's outputs for one request, with the deadline, server-side aborts, fault delays and metrics.

    Raises ApiError when the server aborts the request (deadline: 504, drain timeout: 503), the engine refuses it
    before its first output with a ValueError (400) or fails (500). Cancellation (the client went away)
    propagates after the engine request is aborted.
    """
    engine, metrics, faults = service.engine, service.metrics, service.faults
    loop = asyncio.get_running_loop()
    deadline = loop.time() + prep.timeout_s if prep.timeout_s is not None else None
    lora_engine = service.lora_engine() if prep.lora_name is not None else None
    if lora_engine is not None:
        stream = lora_engine.generate(prep.prompt_ids, prep.params, prep.request_id, prep.priority, prep.lora_name)
    else:
        stream = engine.generate(prep.prompt_ids, prep.params, prep.request_id, prep.priority)
    finished = False
    received = False  # any output yet: a ValueError before the first one is the engine refusing the request
    last_token_at: float | None = None
    try:
        while True:
            if entry.abort_reason is not None:
                raise abort_error(entry.abort_reason, prep.timeout_s)
            try:
                async with asyncio.timeout_at(deadline) as scope:
                    entry.timeout = scope
                    out = await anext(stream)
                    delay = faults.ttft_delay_s if last_token_at is None else faults.itl_delay_s
                    if delay and out.new_token_ids:
                        await asyncio.sleep(delay)
            except TimeoutError:
                raise abort_error(entry.abort_reason, prep.timeout_s) from None
            except StopAsyncIteration:
                log.error(
                    "request %s (%s): the engine ended the stream without a final output",
                    prep.x_request_id,
                    prep.request_id,
                )
                raise internal_error(prep.x_request_id, "engine_error") from None
            except (ApiError, asyncio.CancelledError):
                raise
            except QueueFullError as err:
                raise ApiError(
                    429,
                    f"the worker's engine queue is full: {err}; retry later or elsewhere",
                    code="queue_full",
                    retry_after_s=1,
                ) from err
            except EngineDeadError as err:
                service.engine_died(err)
                raise ApiError(
                    503,
                    "the engine has failed and the worker is restarting; retry on another worker",
                    code="engine_dead",
                    retry_after_s=1,
                ) from err
            except ValueError as err:
                if not received:
                    raise ApiError(400, f"the engine refused the request: {err}", code="engine_rejected") from err
                log.exception("engine failure in request %s (%s)", prep.x_request_id, prep.request_id)
                raise internal_error(prep.x_request_id, "engine_error") from err
            except Exception as err:
                log.exception("engine failure in request %s (%s)", prep.x_request_id, prep.request_id)
                raise internal_error(prep.x_request_id, "engine_error") from err
            finally:
                entry.timeout = None
            received = True
            now = service.clock()
            if out.finish_reason is FinishReason.ERROR:  # the engine failed this request alone; it serves on
                finished = True
                metrics.finished(FinishReason.ERROR, now - prep.arrival)
                log.error("request %s (%s) failed in the engine: %s", prep.x_request_id, prep.request_id, out.error)
                raise internal_error(prep.x_request_id, "request_failed")
            if out.new_token_ids:
                if last_token_at is None:
                    metrics.first_token(now - prep.arrival, out.num_prompt_tokens or len(prep.prompt_ids))
                else:
                    metrics.token_gap(now - last_token_at)
                last_token_at = now
                metrics.generated(len(out.new_token_ids))
                entry.generated = out.num_output_tokens
            if out.finished:
                finished = True
                metrics.finished(out.finish_reason or FinishReason.STOP, now - prep.arrival)
            yield out
            if finished:
                return
    except (asyncio.CancelledError, GeneratorExit):
        metrics.error(CLIENT_DISCONNECT)
        raise
    finally:
        if not finished:
            metrics.finished(FinishReason.ABORT, service.clock() - prep.arrival)
            await _abort(service, stream, prep.request_id)


async def _abort(service: WorkerService, stream: AsyncIterator[RequestOutput], request_id: str) -> None:
    """Close the engine stream (which aborts it) and abort explicitly too, for engines that only honour one."""
    try:
        await stream.aclose()  # type: ignore[attr-defined]
        await service.engine.abort(request_id)
    except Exception:
        log.exception("aborting request %s failed", request_id)


# ---- response shapes -------------------------------------------------------------------------------------------


def token_logprobs(out: RequestOutput) -> list[Logprob]:
    """The logprobs of a delta's new tokens (with their alternatives when asked), one per token."""
    values = out.new_logprobs or []
    tops = out.new_top_logprobs or [()] * len(values)
    return [Logprob(value, tuple(top)) for value, top in zip(values, tops, strict=True)]


def _logprobs(prep: Prepared, ids: list[int], lps: list[Logprob]) -> dict[str, Any] | None:
    if not prep.params.logprobs:
        return None
    if prep.kind == "chat":
        return oai.chat_logprobs(ids, lps)
    return oai.completion_logprobs(ids, list(lps), with_top=prep.params.top_logprobs > 0)


def _echo_logprobs(prep: Prepared, out: RequestOutput) -> dict[str, Any] | None:
    """Logprobs of the echoed prompt (completions with `echo` and `logprobs`): None for its first token."""
    if not prep.params.logprobs:
        return None
    scored: list[Logprob | None] = [None, *(out.prompt_logprobs or [])]
    if len(scored) != len(prep.prompt_ids):
        log.error(
            "request %s (%s): the engine scored %d of the %d prompt tokens",
            prep.x_request_id,
            prep.request_id,
            len(scored) - 1,
            len(prep.prompt_ids) - 1,
        )
        raise internal_error(prep.x_request_id, "engine_error")
    return oai.completion_logprobs(prep.prompt_ids, scored, with_top=prep.params.top_logprobs > 0)


def _join_logprobs(head: dict[str, Any] | None, tail: dict[str, Any] | None) -> dict[str, Any] | None:
    """Echoed-prompt logprobs followed by the completion's (completions API shape)."""
    if head is None or tail is None:
        return head or tail
    return {key: None if head[key] is None else head[key] + tail[key] for key in head}


async def complete(service: WorkerService, prep: Prepared) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Run a non-streaming request to the end: (status, body, headers)."""
    entry = service.inflight.add(prep.request_id, prep.params.max_tokens)
    texts: list[str] = [] if prep.echo_text is None else [prep.echo_text]
    ids: list[int] = []
    lps: list[Logprob] = []
    echoed: dict[str, Any] | None = None
    last: RequestOutput | None = None
    try:
        async with aclosing(drive(service, prep, entry)) as outputs:
            async for out in outputs:
                if last is None and prep.echo_text is not None:
                    echoed = _echo_logprobs(prep, out)
                texts.append(out.new_text)
                ids.extend(out.new_token_ids)
                lps.extend(token_logprobs(out))
                last = out
    except ApiError as err:
        return err.status, err.body(), err.headers()
    finally:
        service.inflight.remove(entry)
    assert last is not None
    usage = oai.usage(len(prep.prompt_ids), last.num_output_tokens, last.num_cached_tokens)
    build = oai.chat_response if prep.kind == "chat" else oai.completion_response
    body = build(
        prep.request_id,
        prep.model,
        prep.created,
        "".join(texts),
        last.finish_reason,
        usage,
        _join_logprobs(echoed, _logprobs(prep, ids, lps)),
    )
    return 200, body, {}


async def stream(service: WorkerService, prep: Prepared) -> AsyncIterator[bytes]:
    """A streaming request as SSE bytes: chunks, an optional usage chunk, `[DONE]`.

    A server-side abort or an engine failure after the stream started ends it with a chunk whose finish_reason
    is `abort`, then an OpenAI error event (the `openai` SDK raises it as an APIError), then `[DONE]`.
    """
    entry = service.inflight.add(prep.request_id, prep.params.max_tokens)
    chat = prep.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    rid, model, created, with_usage = prep.request_id, prep.model, prep.created, prep.include_usage

    def chunk(text: str, reason: FinishReason | None, logprobs: dict[str, Any] | None, first: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if reason is not None and not text:
                delta = {}
            return oai.sse(oai.chat_chunk(rid, model, created, delta, reason, logprobs, with_usage))
        return oai.sse(oai.completion_chunk(rid, model, created, text, reason, logprobs, with_usage))

    try:
        if chat:
            yield chunk("", None, None, first=True)
        last: RequestOutput | None = None
        try:
            async with aclosing(drive(service, prep, entry)) as outputs:
                async for out in outputs:
                    if last is None and prep.echo_text is not None:
                        yield chunk(prep.echo_text, None, _echo_logprobs(prep, out))
                    last = out
                    if out.new_text or out.finished or (prep.params.logprobs and out.new_token_ids):
                        yield chunk(
                            out.new_text,
                            out.finish_reason if out.finished else None,
                            _logprobs(prep, out.new_token_ids, token_logprobs(out)),
                        )
        except ApiError as err:
            service.metrics.error(STREAM_ABORTED if err.status in (503, 504) else STREAM_ERROR)
            yield chunk("", FinishReason.ABORT, None)
            yield oai.sse(err.body())
            yield oai.SSE_DONE
            return
        if with_usage and last is not None:
            usage = oai.usage(len(prep.prompt_ids), last.num_output_tokens, last.num_cached_tokens)
            yield oai.sse(oai.usage_chunk(rid, obj, model, created, usage))
        yield oai.SSE_DONE
    finally:
        service.inflight.remove(entry)
