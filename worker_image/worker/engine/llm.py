"""The offline API: `LLM(model=path, ...).generate(prompts, params)`, batch in, completions out.

Drives an `EngineCore` step by step until every prompt of the call has finished; all prompts share the
continuous batch, so offline generation gets the same batching, prefix caching and preemption as serving.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.core.config import EngineConfig
from worker.core.request import FinishReason, Logprob, SamplingParams
from worker.engine.core import EngineCore, Runner

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it, if any
    logprobs: list[float] | None
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # with SamplingParams.top_logprobs
    prompt_logprobs: list[Logprob] | None = None  # for prompt tokens 1.. with SamplingParams.prompt_logprobs
    error: str | None = None  # with finish_reason ERROR: why the engine failed this request (and only it)


class LLM:
    """`LLM(model=path, dtype="float32", quantization=None, **engine_args)`; `runner=` injects a runner (tests)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        quantization: str | None = None,
        runner: Runner | None = None,
        **engine_args: Any,
    ) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, quantization=quantization or "none", **engine_args)
        self.engine = EngineCore.from_config(self.config, runner)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter folder `path` as `name` (needs enable_lora=True); ValueError if it cannot."""
        self.engine.add_lora(name, path)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[CompletionOutput]:
        """One completion per prompt, in prompt order. A prompt is a string or a list of token ids. `lora`: the
        adapter (added with `add_lora`) of every prompt, or one per prompt (None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        lora_list = [lora] * len(prompt_list) if lora is None or isinstance(lora, str) else list(lora)
        if len(lora_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(lora_list)} adapters")
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"got {len(prompt_list)} prompts but {len(param_list)} sampling params")
        requests = []
        texts: dict[str, list[str]] = {}
        try:
            for prompt, p, name in zip(prompt_list, param_list, lora_list, strict=True):
                request_id = f"llm-{next(self._ids)}"
                requests.append(self.engine.add_request(request_id, prompt, p, lora_name=name))
                texts[request_id] = []
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    texts[out.request_id].append(out.new_text)
        finally:  # an error (or Ctrl-C) must not leave this call's requests holding KV blocks
            self.engine.abort_requests([r.request_id for r in requests if not r.is_finished])
        return [
            CompletionOutput(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=list(r.output_token_ids),
                text="".join(texts[r.request_id]),
                finish_reason=r.status.finish_reason,
                stop_reason=r.stop_reason,
                logprobs=list(r.output_logprobs) if r.sampling_params.logprobs else None,
                num_cached_tokens=r.num_cached_tokens,
                top_logprobs=list(r.output_top_logprobs) if r.sampling_params.top_logprobs else None,
                prompt_logprobs=list(r.prompt_logprobs) if r.sampling_params.prompt_logprobs is not None else None,
                error=r.error,
            )
            for r in requests
        ]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single prompt given as token ids
    for p in items:
        if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(p).__name__}")
    return items
