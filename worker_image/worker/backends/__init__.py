"""Alternative engine backends behind the same engine interface (vLLM)."""
