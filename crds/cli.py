"""`llmfleet crd ...`: render the CRD generated from the pydantic models, validate manifests."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
import yaml

from crds.models import KIND
from crds.render import render
from crds.validate import validate_resource

app = typer.Typer(no_args_is_help=True)


@app.command("render")
def render_command() -> None:
    """Print the InferenceDeployment CRD YAML (what `crds/inferencedeployment.yaml` holds; `make crd` writes it)."""
    typer.echo(render(), nl=False)


@app.command("validate")
def validate_command(
    files: list[Path] = typer.Argument(..., help="Manifest files (multi-document YAML); '-' reads stdin."),
) -> None:
    """Check InferenceDeployment manifests: schema, then semantic rules. Exit 1 when any problem is found."""
    failed = False
    for file in files:
        try:
            text = sys.stdin.read() if str(file) == "-" else file.read_text()
            documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
        except (OSError, yaml.YAMLError) as error:
            typer.echo(f"{file}: cannot read: {error}", err=True)
            failed = True
            continue
        for index, doc in enumerate(documents):
            if not isinstance(doc, dict) or doc.get("kind") != KIND:
                kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
                typer.echo(f"{file}#{index}: skipped (kind {kind}, not {KIND})")
                continue
            metadata = doc.get("metadata")
            name = metadata.get("name") if isinstance(metadata, dict) else None
            problems = validate_resource(doc)
            if not problems:
                typer.echo(f"{file}: {name}: valid")
                continue
            failed = True
            typer.echo(f"{file}: {name}: {len(problems)} problem(s)")
            for problem in problems:
                typer.echo(f"  {problem}")
    if failed:
        raise typer.Exit(1)
