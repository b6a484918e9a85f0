"""The worker: a paged-attention continuous-batching LLM engine (torch), its OpenAI-compatible server, metrics and lame-duck drain."""

from worker.core.request import SamplingParams
from worker.engine.llm import LLM, CompletionOutput

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
