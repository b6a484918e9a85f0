"""`llmfleet operator`: run the kopf operator process."""

from __future__ import annotations

import typer


def operator_command() -> None:
    """Run the operator against the cluster found the standard way (in-cluster, KUBECONFIG, ~/.kube/config)."""
    typer.echo("the operator lands with issue 6", err=True)
    raise typer.Exit(2)
