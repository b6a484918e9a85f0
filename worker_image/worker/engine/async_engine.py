"""AsyncEngine: the builtin engine behind the server (`EngineClient`), stepping EngineCore in its own thread.

Why a thread: a step is tens of milliseconds of model compute; run on the event loop it would stall every
HTTP connection. The thread owns the EngineCore outright (no locks on scheduler state): the event loop sends
it commands (add, abort, pause, resume, stop) through a queue, and it hands back each step's deltas with one
`call_soon_threadsafe`, which the loop fans out to per-request asyncio queues. A consumer that falls behind
gets its pending deltas merged into one. Leaving the `generate` iteration early for any reason (client gone,
cancellation, error) aborts the request, which frees its KV blocks at the next step boundary.

LoRA adapters (vLLM's dynamic API): `load_lora` validates the adapter's files on a worker thread (never on the
loop, never on the engine thread), then registers it through the command queue, so every request sent after it
finds it; `unload_lora` unregisters it the same way (requests already added with it finish). The loop keeps its
own copy of the registered names, which `generate` and the server check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from worker.core.config import EngineConfig
from worker.core.errors import EngineDeadError, QueueFullError
from worker.core.lora import check_new_adapter_name
from worker.core.request import SamplingParams
from worker.engine.core import EngineCore, Runner
from worker.engine.protocol import EngineStats, RequestOutput

log = logging.getLogger(__name__)


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one."""
    logprobs = None if a.new_logprobs is None else a.new_logprobs + (b.new_logprobs or [])
    top = None if a.new_top_logprobs is None else a.new_top_logprobs + (b.new_top_logprobs or [])
    return RequestOutput(
        request_id=a.request_id,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        new_text=a.new_text + b.new_text,
        finished=b.finished,
        finish_reason=b.finish_reason,
        num_prompt_tokens=b.num_prompt_tokens,
        num_output_tokens=b.num_output_tokens,
        num_cached_tokens=b.num_cached_tokens,
        new_logprobs=logprobs,
        new_top_logprobs=top,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        error=b.error,
    )


class AsyncEngine:
    """`EngineClient` over our own EngineCore. Pass `runner=` to serve a runner built elsewhere (tests)."""

    def __init__(self, config: EngineConfig, runner: Runner | None = None) -> None:
        self.config = config
        self.model_name = config.served_model_name or (
            os.path.basename(os.path.normpath(config.model)) if config.model else "model"
        )
        self.max_model_len = config.max_model_len or 0  # the effective value is known after start()
        self._runner = runner
        self._core: EngineCore | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock = asyncio.Lock()
        self._commands: deque[tuple[str, Any]] = deque()  # appended by the loop, popped by the engine thread
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # event-loop side only
        self._stats = EngineStats()
        self._error: BaseException | None = None
        self._loras: dict[str, str] = {}  # registered adapters, name -> path (event-loop side)
        self._lora_lock = asyncio.Lock()

    # --------------------------------------------------------------------------------------- EngineClient API
    async def start(self) -> None:
        async with self._start_lock:
            if self._thread is not None:
                return
            self._loop = asyncio.get_running_loop()
            self._core = await asyncio.to_thread(EngineCore.from_config, self.config, self._runner)
            self.max_model_len = self._core.scheduler.max_request_len
            self._stats = self._core.stats()
            self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Abort what is in flight (streams end with finish_reason `abort`) and stop the engine thread."""
        if self._thread is None:
            return
        self._send("stop", None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        await asyncio.sleep(0)  # let the final deltas reach their queues

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        core = self._started()
        if core.tokenizer is None:
            raise ValueError("this engine has no tokenizer: give prompts as token ids")
        return core.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        core = self._started()
        if core.tokenizer is None:
            raise ValueError("this engine has no tokenizer: it cannot turn token ids into text")
        return core.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        core = self._started()
        if core.tokenizer is None:
            raise ValueError("this engine has no tokenizer, hence no chat template")
        return core.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------------------------------- LoRA adapters
    @property
    def lora_enabled(self) -> bool:
        return self.config.enable_lora

    def lora_adapters(self) -> dict[str, str]:
        """Registered adapters: name -> path."""
        return dict(self._loras)

    async def load_lora(self, name: str, path: str) -> None:
        """Validate the PEFT adapter folder `path` and serve it as `name` (ValueError saying why it cannot be)."""
        core = self._started()
        async with self._lora_lock:
            check_new_adapter_name(name, self._loras, self.model_name)
            await asyncio.to_thread(core.check_lora, name, path)
            self._loras[name] = path
            self._send("add_lora", (name, path))

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (KeyError when unknown); requests already added with it finish."""
        async with self._lora_lock:
            del self._loras[name]
            self._send("remove_lora", name)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs until one with `finished=True`.

        Raises ValueError (empty or too long prompt, token ids outside the vocabulary, duplicate id),
        QueueFullError (`max_waiting` reached) or EngineDeadError before the first output when the request cannot
        be taken. A request the engine fails alone ends with finish_reason `error` and `error` set.
        """
        core = self._started()
        if self._error is not None:
            raise EngineDeadError(f"the engine has failed: {self._error!r}")
        if self._thread is None:
            raise EngineDeadError("the engine is shut down")
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        core.check_request(prompt_ids, params)
        if lora_name is not None and lora_name not in self._loras:
            raise ValueError(f"no LoRA adapter named {lora_name!r} is loaded")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self._queues) - self._stats.num_running >= self.config.max_waiting:
            raise QueueFullError(f"{self.config.max_waiting} requests are already waiting (max_waiting)")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._send("add", (request_id, prompt_ids, params, priority, time.monotonic(), lora_name))
            while not finished:
                item = await queue.get()
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    item = nxt if isinstance(nxt, BaseException) else merge_outputs(item, nxt)
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it (rejected) or is dead
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._queues[request_id]
            if not finished:
                self._send("abort", request_id)

    async def abort(self, request_id: str) -> None:
        """End a request; its stream gets a final delta with finish_reason `abort`. Unknown ids are ignored."""
        self._send("abort", request_id)

    async def pause(self) -> None:
        """Admit nothing new; what runs (or was preempted) still finishes. For draining."""
        self._send("pause", None)

    async def resume(self) -> None:
        self._send("resume", None)

    def stats(self) -> EngineStats:
        """The snapshot published after the engine's last step (never blocks on the engine thread)."""
        return self._stats

    # ------------------------------------------------------------------------------------------ engine thread
    def _started(self) -> EngineCore:
        if self._core is None:
            raise RuntimeError("the engine is not started: await engine.start() first")
        return self._core

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.append((kind, payload))
        self._wake.set()

    def _run(self) -> None:
        core = self._started()
        while True:
            self._wake.clear()  # before reading commands: a command sent after this wakes the wait below
            outputs: list[RequestOutput] = []
            errors: list[tuple[str, BaseException]] = []
            stop = self._apply_commands(core, outputs, errors)
            if stop:
                outputs += core.abort_requests(list(core.scheduler.requests))
            elif core.scheduler.has_schedulable_requests():
                try:
                    outputs += core.step()
                except Exception as exc:  # noqa: BLE001 - the step itself failed (one request's failure ends only it, in step())
                    self._error = exc
                    self._stats = core.stats()
                    self._post(outputs, errors, dead=exc)
                    return
            self._stats = core.stats()
            self._post(outputs, errors)
            if stop:
                return
            if not core.scheduler.has_schedulable_requests():
                self._wake.wait()

    def _apply_commands(
        self, core: EngineCore, outputs: list[RequestOutput], errors: list[tuple[str, BaseException]]
    ) -> bool:
        """Apply queued commands in order; True when asked to stop."""
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                request_id, prompt_ids, params, priority, arrival, lora_name = payload
                try:
                    core.add_request(request_id, prompt_ids, params, priority, arrival, lora_name)
                except (ValueError, QueueFullError) as exc:
                    errors.append((request_id, exc))
            elif kind == "abort":
                outputs += core.abort_requests([payload])
            elif kind in ("add_lora", "remove_lora"):
                try:
                    core.register_lora(*payload) if kind == "add_lora" else core.remove_lora(payload)
                except (ValueError, KeyError) as exc:  # the loop's registry already said no; never kill the loop
                    log.warning("%s %r: %s", kind, payload, exc)
            elif kind == "pause":
                core.pause()
            elif kind == "resume":
                core.resume()
            elif kind == "stop":
                return True
        return False

    def _post(
        self, outputs: list[RequestOutput], errors: list[tuple[str, BaseException]], dead: BaseException | None = None
    ) -> None:
        if not (outputs or errors or dead) or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # RuntimeError: the event loop is closed, nobody listens
            self._loop.call_soon_threadsafe(self._dispatch, outputs, errors, dead)

    def _dispatch(
        self, outputs: list[RequestOutput], errors: list[tuple[str, BaseException]], dead: BaseException | None
    ) -> None:
        """On the event loop: hand each delta to its request's queue (requests whose stream ended are dropped)."""
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for request_id, exc in errors:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(exc)
        if dead is not None:
            for queue in self._queues.values():
                queue.put_nowait(EngineDeadError(f"the engine failed: {dead!r}"))
