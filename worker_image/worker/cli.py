"""`llmfleet worker` and `llmfleet model ...`: run a worker; pull/convert the bundled model."""

from __future__ import annotations

import typer

model_app = typer.Typer(no_args_is_help=True)


def worker_command() -> None:
    """Run a worker."""
    typer.echo("the worker server lands with issue 5", err=True)
    raise typer.Exit(2)
