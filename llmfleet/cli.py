"""`llmfleet`: one command for every part of the fleet.

Each part owns its sub-command in its own light `cli.py` (heavy imports such as torch happen inside the
command functions), so `llmfleet --help` stays fast and the parts stay independent.
"""

from __future__ import annotations

import typer
from fleet_operator.cli import operator_command
from worker.cli import model_app, worker_command

from crds.cli import app as crd_app
from gateway.cli import gateway_command
from llmfleet.up import up_command

app = typer.Typer(
    name="llmfleet",
    help="Run LLM inference fleets on Kubernetes: operator, gateway, worker, local cluster.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(crd_app, name="crd", help="The InferenceDeployment CRD: render, validate.")
app.add_typer(model_app, name="model", help="Models: pull/convert the bundled model.")
app.command(
    "worker",
    help="Run a worker: engine + OpenAI-compatible server. Unknown --flags go to the vLLM engine.",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)(worker_command)
app.command("gateway", help="Run the OpenAI-compatible gateway.")(gateway_command)
app.command("operator", help="Run the operator (kopf).")(operator_command)
app.command("up", help="Start a local fleet (localkube, Prometheus, operator, gateway, a model).")(up_command)

if __name__ == "__main__":  # pragma: no cover
    app()
