"""`llmfleet worker`: run the engine behind the OpenAI-compatible server (light module: heavy imports inside)."""

from __future__ import annotations

import typer


def worker_command() -> None:
    """Run a worker."""
    typer.echo("the worker server lands with issue 5", err=True)
    raise typer.Exit(2)
