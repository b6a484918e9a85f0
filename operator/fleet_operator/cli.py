"""`llmfleet operator`: run the kopf operator process (light module: kopf is imported when the command runs)."""

from __future__ import annotations

import os
import shlex
from typing import Annotated

import typer


def operator_command(
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", help="namespace to watch (repeat for more); default: the whole cluster"),
    ] = None,
    kubeconfig: Annotated[
        str | None, typer.Option(help="kubeconfig file (default: in-cluster, else $KUBECONFIG or ~/.kube/config)")
    ] = None,
    context: Annotated[str | None, typer.Option(help="kubeconfig context")] = None,
    prometheus_url: Annotated[str | None, typer.Option(help="Prometheus base URL (autoscaling, canary)")] = None,
    resync_seconds: Annotated[float | None, typer.Option(help="re-check every deployment this often")] = None,
    peering: Annotated[str | None, typer.Option(help="kopf peering name for HA (default: standalone)")] = None,
    priority: Annotated[int | None, typer.Option(help="peering priority of this replica")] = None,
    liveness_endpoint: Annotated[
        str | None, typer.Option(help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="internal port of the operator's /metrics (not the public /alerts port)")
    ] = None,
    drain_key_file: Annotated[
        str | None, typer.Option(help="file with the key drain tokens are derived from (at least 32 bytes)")
    ] = None,
    insecure_ephemeral_drain_key: Annotated[
        bool | None,
        typer.Option(
            "--insecure-ephemeral-drain-key",
            help="development only: without a key file, use a random drain key for this process",
        ),
    ] = None,
    worker_image: Annotated[str | None, typer.Option(help="default worker image")] = None,
    worker_extra_args: Annotated[
        str | None, typer.Option(help="arguments appended to every worker command, shell-quoted")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="debug | info | warning | error")] = None,
) -> None:
    """Run the operator against the cluster found the standard way (in-cluster, KUBECONFIG, ~/.kube/config).

    Every flag can also be given as an LLMFLEET_OPERATOR_* environment variable (flags win).
    """
    from kubernetes.config import ConfigException

    from fleet_operator.main import run
    from fleet_operator.settings import OperatorSettings, SettingsError

    try:
        settings = OperatorSettings.load(
            os.environ,
            namespaces=namespace or None,
            kubeconfig=kubeconfig,
            context=context,
            prometheus_url=prometheus_url,
            resync_seconds=resync_seconds,
            peering=peering,
            priority=priority,
            liveness_endpoint=liveness_endpoint,
            metrics_port=metrics_port,
            drain_key_file=drain_key_file,
            insecure_ephemeral_drain_key=insecure_ephemeral_drain_key,
            worker_image=worker_image,
            worker_extra_args=shlex.split(worker_extra_args) if worker_extra_args is not None else None,
            log_level=log_level,
        )
    except SettingsError as error:
        typer.echo(f"llmfleet operator: {error}", err=True)
        raise typer.Exit(2) from None
    try:
        run(settings)
    except SettingsError as error:
        typer.echo(f"llmfleet operator: {error}", err=True)
        raise typer.Exit(2) from None
    except ConfigException as error:
        typer.echo(f"llmfleet operator: cannot find the cluster: {error}", err=True)
        raise typer.Exit(2) from None
