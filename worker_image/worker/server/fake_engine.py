"""A deterministic stand-in engine (`--engine fake`), for tests of the server only: never for serving.

It implements `EngineClient` without a model: a byte-level tokenizer (token id = UTF-8 byte), a one-line-per-message
chat template, and a generation that replays a fixed script one byte per token (from an offset picked by the seed
when sampling), honouring `max_tokens`, stop strings, EOS, logprobs and abort. `max_num_seqs` requests run at once,
the rest wait, so queue metrics and 429s can be exercised. Optional delays, a gate (a request pauses after its
first token until the gate opens) and an injected failure make the server's timing-dependent paths testable
without timing assertions. It records every abort so tests can check that a disconnect reached the engine.
"""

from __future__ import annotations

import asyncio
import codecs
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.core.request import FinishReason, Logprob, SamplingParams
from worker.engine.protocol import EngineStats, RequestOutput

DEFAULT_SCRIPT = "The quick brown fox jumps over the lazy dog. Café, naïve, 北京. "
EOS_TOKEN_ID = 256  # outside the byte range: never part of the script
MAX_BYTES_PER_TOKEN = 1  # its tokenizer: one token per UTF-8 byte
Gate = Callable[[], Awaitable[None]]


def _polling_gate(is_open: Callable[[], bool], poll_s: float, max_wait_s: float) -> Gate:
    async def wait() -> None:
        for _ in range(int(max_wait_s / poll_s)):
            if is_open():
                return
            await asyncio.sleep(poll_s)

    return wait


def thread_event_gate(event: threading.Event, poll_s: float = 0.005, max_wait_s: float = 60.0) -> Gate:
    """A gate opened from another thread (a test driving a server in its own thread); opens by itself after
    `max_wait_s`."""
    return _polling_gate(event.is_set, poll_s, max_wait_s)


def file_gate(path: Path, poll_s: float = 0.01, max_wait_s: float = 60.0) -> Gate:
    """A gate opened by creating `path` (a test driving a worker subprocess); opens by itself after `max_wait_s`."""
    return _polling_gate(path.exists, poll_s, max_wait_s)


@dataclass(eq=False)
class _FakeRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    running: bool = False
    generated: int = 0
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


def fake_logprob(position: int, token: int, k: int) -> Logprob:
    """A made-up but deterministic logprob for `token` at `position`, with k alternatives (`token` first)."""
    return Logprob(
        -0.1 * (position % 5 + 1), tuple(((token + j) % 256, -0.1 * (position % 5 + 1) - j) for j in range(k))
    )


class FakeEngine:
    """See the module docstring. All knobs are constructor arguments; counters are public for tests."""

    def __init__(
        self,
        model_name: str = "fake-model",
        max_model_len: int = 2048,
        *,
        script: str = DEFAULT_SCRIPT,
        eos_after_script: bool = False,
        ttft_s: float = 0.0,
        itl_s: float = 0.0,
        max_num_seqs: int = 8,
        kv_capacity_tokens: int = 8192,
        load_s: float = 0.0,
        gate: Gate | None = None,
        fail_after: int | None = None,
    ) -> None:
        if not script:
            raise ValueError("the fake engine's script must not be empty")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._script = script.encode()
        self._eos_after_script = eos_after_script
        self._ttft_s = ttft_s
        self._itl_s = itl_s
        self._max_num_seqs = max_num_seqs
        self._kv_capacity = kv_capacity_tokens
        self._load_s = load_s
        self._gate = gate
        self._fail_after = fail_after
        self._slots: asyncio.Semaphore | None = None
        self._requests: dict[str, _FakeRequest] = {}
        self._seen_prompts: set[tuple[int, ...]] = set()
        self.started = False
        self.shut_down = False
        self.aborted: list[str] = []  # every abort: explicit calls and cancelled iterations
        self.submitted: list[tuple[str, list[int], SamplingParams, int]] = []  # (id, prompt ids, params, priority)
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- tokenizer ----
    def tokenize(self, text: str) -> list[int]:
        return list(text.encode())

    def detokenize(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    # ---- lifecycle ----
    async def start(self) -> None:
        if self.started:
            return
        if self._load_s:
            await asyncio.sleep(self._load_s)
        self._slots = asyncio.Semaphore(self._max_num_seqs)
        self.started = True

    async def shutdown(self) -> None:
        for req in self._requests.values():
            req.aborted.set()
        self.shut_down = True

    # ---- requests ----
    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        req = self._requests.get(request_id)
        if req is not None:
            req.aborted.set()

    def stats(self) -> EngineStats:
        running = [r for r in self._requests.values() if r.running]
        used = sum(r.num_prompt_tokens + r.generated for r in running)
        return EngineStats(
            num_running=len(running),
            num_waiting=len(self._requests) - len(running),
            kv_cache_usage=min(1.0, used / self._kv_capacity),
            remaining_tokens_estimate=sum(max(0, r.max_tokens - r.generated) for r in self._requests.values()),
            num_preemptions_total=self.preemptions,
            prefix_cache_queries_total=self.prefix_queries,
            prefix_cache_hits_total=self.prefix_hits,
        )

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        if not self.started or self._slots is None:
            raise RuntimeError("the fake engine is not started")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} already exists")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.submitted.append((request_id, ids, params, priority))
        req = _FakeRequest(request_id, len(ids), params.max_tokens)
        self._requests[request_id] = req
        finished = False
        try:
            async with self._slots:
                req.running = True
                self._count_prefix(ids)
                async for out in self._run(req, ids, params):
                    finished = out.finished
                    yield out
        finally:
            del self._requests[request_id]
            if not finished:
                self.aborted.append(request_id)

    def _count_prefix(self, ids: list[int]) -> None:
        key = tuple(ids)
        self.prefix_queries += len(ids)
        if key in self._seen_prompts:
            self.prefix_hits += len(ids) // 16 * 16
        self._seen_prompts.add(key)

    async def _pause(self, req: _FakeRequest, seconds: float) -> bool:
        """Sleep, waking early on abort; True when aborted."""
        if req.aborted.is_set():
            return True
        if seconds > 0:
            try:
                await asyncio.wait_for(req.aborted.wait(), seconds)
            except TimeoutError:
                pass
        return req.aborted.is_set()

    async def _run(self, req: _FakeRequest, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        script = self._script
        pos = 0 if params.greedy else random.Random(params.seed).randrange(len(script))
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = ""  # decoded output so far
        sent = 0  # characters of `text` already emitted
        holdback = max((len(s) for s in params.stop), default=1) - 1
        pending_ids: list[int] = []
        pending_lps: list[float] = []
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = [fake_logprob(i, ids[i], params.prompt_logprobs) for i in range(1, len(ids))]

        def output(new_text: str, finished: bool, reason: FinishReason | None) -> RequestOutput:
            nonlocal prompt_lps
            tops = [fake_logprob(0, t, params.top_logprobs).top for t in pending_ids]
            out = RequestOutput(
                request_id=req.request_id,
                new_token_ids=list(pending_ids),
                new_text=new_text,
                finished=finished,
                finish_reason=reason,
                num_prompt_tokens=len(ids),
                num_output_tokens=req.generated,
                new_logprobs=list(pending_lps) if params.logprobs else None,
                new_top_logprobs=tops if params.top_logprobs else None,
                prompt_logprobs=prompt_lps,
            )
            prompt_lps = None  # on the first delta only
            pending_ids.clear()
            pending_lps.clear()
            return out

        if await self._pause(req, self._ttft_s):
            yield output("", True, FinishReason.ABORT)
            return
        while True:
            if req.generated > 0 and await self._pause(req, self._itl_s):
                yield output("", True, FinishReason.ABORT)
                return
            if self._fail_after is not None and req.generated >= self._fail_after:
                raise RuntimeError(f"fake engine failure after {req.generated} tokens")
            at_end = pos > 0 and pos % len(script) == 0
            if at_end and self._eos_after_script and not params.ignore_eos and req.generated >= params.min_tokens:
                req.generated += 1
                pending_ids.append(EOS_TOKEN_ID)
                pending_lps.append(-0.5)
                yield output(text[sent:], True, FinishReason.STOP)
                return
            token = script[pos % len(script)]
            pos += 1
            req.generated += 1
            pending_ids.append(token)
            pending_lps.append(-0.25 * (req.generated % 4 + 1))
            text += decoder.decode(bytes([token]))
            if token in params.stop_token_ids and req.generated >= params.min_tokens:
                yield output(text[sent:], True, FinishReason.STOP)
                return
            hits = [text.find(s, max(0, sent - holdback)) for s in params.stop]
            hits = [h for h in hits if h >= 0]
            if hits and req.generated >= params.min_tokens:
                yield output(text[sent : min(hits)], True, FinishReason.STOP)
                return
            if req.generated >= params.max_tokens or len(ids) + req.generated >= self.max_model_len:
                yield output(text[sent:], True, FinishReason.LENGTH)
                return
            upto = max(sent, len(text) - holdback)
            new_text, sent = text[sent:upto], upto
            yield output(new_text, False, None)
            if req.generated == 1 and self._gate is not None:
                await self._gate()
