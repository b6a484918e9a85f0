"""The worker: a paged-attention continuous-batching LLM engine (torch), its OpenAI-compatible server, metrics and lame-duck drain."""

from worker.engine.llm import LLM, CompletionOutput
from worker.request import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
