"""`llmfleet up`: the local fleet behind `make demo`."""

from __future__ import annotations

import typer


def up_command(scenario: bool = typer.Option(False, help="Also drive the scripted tour.")) -> None:
    """Start the local fleet."""
    typer.echo("the local fleet lands with issue 10", err=True)
    raise typer.Exit(2)
