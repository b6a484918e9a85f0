"""`llmfleet worker` and `llmfleet model ...`: re-exported from the parts that own them."""

from __future__ import annotations

from worker.model.cli import model_app
from worker.server.cli import worker_command

__all__ = ["model_app", "worker_command"]
