"""Engine errors every backend raises and the server maps to HTTP answers (torch-free, import-light)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its cap (`max_waiting`): the server answers 429 with Retry-After."""


class EngineDeadError(RuntimeError):
    """The engine failed and takes no more requests: the server answers 503 and exits non-zero to be restarted."""
