"""Contract with the worker: every command line the operator builds for the example deployments parses as
`llmfleet worker` flags (parsing only: the worker is not started)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import typer.main
import yaml

from controllers.pods import PodDefaults, pod_template
from crds.helpers import parse_spec
from llmfleet.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _commands(example: str) -> list[tuple[str, list[str]]]:
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    spec = parse_spec(manifest["spec"])
    commands = []
    for variant in spec.variants:
        container = pod_template(manifest["metadata"]["name"], spec, variant, PodDefaults())["spec"]["containers"][0]
        commands.append((variant.name, container["command"] + container["args"]))
    return commands


@pytest.mark.parametrize(
    "example",
    [
        "smollm2-cpu.yaml",
        "smollm2-int4-canary.yaml",
        "llama3-8b-gpu.yaml",
    ],
)
def test_worker_accepts_the_operator_command_line(example):
    group = typer.main.get_command(app)
    for _variant, argv in _commands(example):
        assert argv[:2] == ["llmfleet", "worker"]
        context = group.commands["worker"].make_context("worker", argv[2:])
        assert context.params["model"]
