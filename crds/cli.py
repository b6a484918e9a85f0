"""`llmfleet crd ...`: render the CRD generated from the pydantic models, validate manifests."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)
