"""The worker: a paged-attention continuous-batching LLM engine (torch), its OpenAI-compatible server, metrics and lame-duck drain."""
