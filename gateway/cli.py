"""`llmfleet gateway`: run the OpenAI-compatible gateway."""

from __future__ import annotations

import typer


def gateway_command() -> None:
    """Run the gateway."""
    typer.echo("the gateway lands with issue 9", err=True)
    raise typer.Exit(2)
