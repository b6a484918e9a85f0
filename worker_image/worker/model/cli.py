"""`llmfleet model ...`: pull/convert the bundled model (light module: heavy imports inside commands)."""

from __future__ import annotations

import typer

model_app = typer.Typer(no_args_is_help=True)
