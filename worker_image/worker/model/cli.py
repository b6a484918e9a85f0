"""`llmfleet model ...`: pull/convert the bundled model (light module: heavy imports inside commands)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

model_app = typer.Typer(no_args_is_help=True)


@model_app.command("pull")
def pull(
    name: Annotated[str, typer.Argument(help="Model to fetch: a bundled name (smollm2-135m-instruct) or any source.")],
    cache_dir: Annotated[
        Optional[Path],  # noqa: UP045 - typer needs Optional here
        typer.Option(
            "--cache-dir", help="Where converted models go (default $LLMFLEET_CACHE_DIR or ~/.cache/llmfleet/models)."
        ),
    ] = None,
) -> None:
    """Convert/fetch a model once and print its local folder (a second pull is instant)."""
    from worker.model.bundled import BUNDLED_MODELS
    from worker.model.source import ModelSourceError, resolve_model_source

    source = f"bundled://{name}" if name in BUNDLED_MODELS else name
    try:
        path = resolve_model_source(source, cache_dir=cache_dir)
    except ModelSourceError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(str(path))


@model_app.command("list")
def list_models() -> None:
    """List the bundled models."""
    from worker.model.bundled import BUNDLED_MODELS

    for name in sorted(BUNDLED_MODELS):
        typer.echo(f"{name}\tbundled://{name}")
