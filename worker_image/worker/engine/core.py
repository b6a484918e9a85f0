"""EngineCore: one synchronous engine step = schedule -> runner.execute_model -> update -> output deltas.

It owns the scheduler, the runner and the output processor, and nothing about threads or asyncio: the offline
`LLM` calls `step()` in a loop, the async engine calls it from its background thread.

One request must never take the engine down: `check_request` refuses at admission whatever the model cannot
take, and a failure that the runner or the output processor can pin on one request ends that request with
finish reason `error` while the rest of the batch goes on. Only a failure of the step itself escapes `step()`.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Protocol

from worker.core.config import EngineConfig
from worker.core.lora import LoraSpec
from worker.core.outputs import ModelRunnerOutput, SchedulerOutput
from worker.core.request import Request, RequestStatus, SamplingParams
from worker.core.scheduler import Scheduler
from worker.engine.output_processor import OutputProcessor
from worker.engine.protocol import EngineStats, RequestOutput

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What the core needs from a model runner (`worker.model.runner.ModelRunner`, or the toy one in tests)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_id: int | None
    tokenizer: Any

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner) -> None:
        if runner.block_size != scheduler.kv.block_size:
            raise ValueError(f"runner block_size {runner.block_size} != scheduler block_size {scheduler.kv.block_size}")
        if runner.num_blocks < scheduler.kv.num_blocks:
            raise ValueError(
                f"the scheduler manages {scheduler.kv.num_blocks} blocks; the runner has {runner.num_blocks}"
            )
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.loras: dict[str, LoraSpec] = {}  # registered adapters by name
        self._lora_ids = itertools.count(1)

    @classmethod
    def from_config(cls, config: EngineConfig, runner: Runner | None = None) -> EngineCore:
        """Build the core; loads `config.model` into a `ModelRunner` unless a runner is given."""
        if runner is None:
            runner = load_runner(config)
        max_model_len = runner.max_model_len
        if config.max_model_len is not None:
            max_model_len = min(max_model_len, config.max_model_len)
        num_blocks = runner.num_blocks if config.num_blocks is None else min(runner.num_blocks, config.num_blocks)
        return cls(Scheduler(config, num_blocks, max_model_len), runner)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """Queue a request (with the registered LoRA adapter `lora_name`, or the base model). Raises ValueError
        (bad prompt or parameters, duplicate id, unknown adapter) or QueueFullError (cap)."""
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(prompt_ids, params)
        lora = None
        if lora_name is not None:
            lora = self.loras.get(lora_name)
            if lora is None:
                raise ValueError(f"no LoRA adapter named {lora_name!r} is loaded")
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_id=self.runner.eos_token_id,
            priority=priority,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            lora=lora,
        )
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)
        return request

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request this model cannot take: token ids outside its vocabulary (in the prompt,
        stop_token_ids or logit_bias), stop strings without a tokenizer, a prompt that can never fit. Called once
        per request at admission, so nothing a request names can fail a batch later."""
        vocab_size: int | None = getattr(self.runner, "vocab_size", None)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt_ids):
            raise ValueError("prompt token ids must be integers")
        if prompt_ids and (min(prompt_ids) < 0 or (vocab_size is not None and max(prompt_ids) >= vocab_size)):
            limit = f"0..{vocab_size - 1}" if vocab_size is not None else "non-negative integers"
            bad = [t for t in prompt_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
            raise ValueError(f"prompt token ids must be in {limit}; got {bad[:5]}")
        params.check_vocab(vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none")
        self.scheduler.check_prompt(len(prompt_ids))

    # ------------------------------------------------------------------------------------------- LoRA adapters
    def check_lora(self, name: str, path: str) -> None:
        """Raise ValueError when the adapter cannot be served: LoRA is off, the name is malformed, or the runner
        refuses its files (`worker.model.lora.LoraError`). Reads only files and the model's config (never the
        registry), so it may run off the engine thread."""
        if self.scheduler.lora_slots is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)")
        if not name or name != name.strip() or ":" in name:
            raise ValueError(f"an adapter name must be non-empty, without ':' or surrounding blanks, got {name!r}")
        load = getattr(self.runner, "load_lora", None)
        if load is not None:
            load(path, name)

    def register_lora(self, name: str, path: str) -> LoraSpec:
        """Register an adapter checked by `check_lora` (no file is read here)."""
        if name in self.loras:
            raise ValueError(f"an adapter named {name!r} is already loaded: unload it first")
        spec = LoraSpec(name=name, lora_id=next(self._lora_ids), path=path)
        self.loras[name] = spec
        return spec

    def add_lora(self, name: str, path: str) -> LoraSpec:
        """Check and register an adapter (raises ValueError saying why it cannot be served)."""
        if name in self.loras:
            raise ValueError(f"an adapter named {name!r} is already loaded: unload it first")
        self.check_lora(name, path)
        return self.register_lora(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter (KeyError when unknown); running requests with it finish, waiting ones too."""
        spec = self.loras.pop(name)
        self.scheduler.remove_lora(spec.lora_id)

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: give prompts as token ids")
        return self.tokenizer.encode(text, add_special_tokens=True)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """End requests now (client gone, deadline); returns their final deltas (finish_reason `abort`)."""
        ended = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [self.output_processor.abort_output(req) for req in ended]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return a delta for every request that got a token (or ended by a stop string)."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_req_ids:
            return []
        # An empty step still reaches the runner when requests ended: it drops their sampling state.
        runner_output = self.runner.execute_model(scheduler_output)
        advanced = self.scheduler.update_from_output(scheduler_output, runner_output)
        for request_id, error in runner_output.failed.items():
            log.warning("request %s failed in the model runner and was ended alone: %s", request_id, error)
        processed = self.output_processor.process(advanced)
        for request_id, stop in processed.stop_requests:
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED, stop_reason=stop)
        failed = dict(processed.failed_requests)
        for req in advanced if failed else ():
            failure = failed.get(req.request_id)
            if failure is None:
                continue
            log.warning("request %s failed in the output processor and was ended alone: %s", req.request_id, failure)
            if req.is_finished:  # the scheduler had just ended it (length, EOS): it ends with the error instead
                req.status, req.error = RequestStatus.FINISHED_ERROR, failure
            else:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR, error=failure)
        return processed.outputs

    def pause(self) -> None:
        self.scheduler.pause()

    def resume(self) -> None:
        self.scheduler.resume()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            remaining_tokens_estimate=s.remaining_tokens_estimate(),
            num_preemptions_total=s.num_preemptions_total,
            prefix_cache_queries_total=s.kv.prefix_cache_queries,
            prefix_cache_hits_total=s.kv.prefix_cache_hits,
            spec_decode=s.spec_decode_stats.copy() if s.config.speculative is not None else None,
            lora=s.lora_stats(),
            extra={"paused": s.paused},
        )


def load_runner(config: EngineConfig) -> Runner:
    """The torch model runner for `config.model` (torch is imported only here, when a real model is served)."""
    if config.model is None:
        raise ValueError("no model given: set EngineConfig.model to a model folder (or pass a runner)")
    from worker.model.runner import ModelRunner

    return ModelRunner(
        config.model,
        dtype=config.dtype,
        quantization=config.runner_quantization,
        device=config.device,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        kv_cache_bytes=config.kv_cache_bytes,
        max_model_len=config.max_model_len,
        enforce_eager=config.enforce_eager,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank,
    )
