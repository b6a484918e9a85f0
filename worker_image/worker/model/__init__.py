"""Torch side of the engine: model loading, the Llama-family ModelRunner with paged attention,
quantization, sampling, tokenization."""
