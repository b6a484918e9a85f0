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


SPECULATIVE_SPEC = {
    "model": {"name": "m", "source": "bundled://smollm2-135m-instruct"},
    "engine": {"speculative": {"numTokens": 6, "promptLookupMax": 5, "promptLookupMin": 2, "disableByBatchSize": 3}},
    "variants": [{"name": "a"}],
}


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_engine_speculative_reaches_either_engine(engine):
    """`engine.speculative` -> the worker's `--speculative-config` (vLLM's JSON) -> our EngineConfig, or vLLM's
    n-gram speculator (method, num_speculative_tokens, prompt_lookup_max/min; our batch-size knob left out)."""
    from worker.backends.vllm import vllm_engine_args
    from worker.core.config import EngineConfig, SpeculativeConfig
    from worker.server.cli import parse_speculative_config
    from worker.server.engines import builtin_engine_kwargs
    from worker.server.settings import WorkerSettings

    raw = {**SPECULATIVE_SPEC, "engine": {**SPECULATIVE_SPEC["engine"], "type": engine}}
    spec = parse_spec(raw)
    container = pod_template("d", spec, spec.variants[0], PodDefaults())["spec"]["containers"][0]
    argv = container["command"] + container["args"]
    context = typer.main.get_command(app).commands["worker"].make_context("worker", argv[2:])
    parsed = parse_speculative_config(context.params["speculative_config"])
    settings = WorkerSettings(model="m", engine=engine, speculative=parsed)
    expected = SpeculativeConfig(
        num_speculative_tokens=6, prompt_lookup_max=5, prompt_lookup_min=2, disable_by_batch_size=3
    )
    assert settings.speculative == expected
    if engine == "builtin":
        assert EngineConfig(**builtin_engine_kwargs(settings, "/m", "cpu")).speculative == expected
    else:
        assert vllm_engine_args(settings, "/m", device_is_cpu=True)["speculative_config"] == {
            "method": "ngram",
            "num_speculative_tokens": 6,
            "prompt_lookup_max": 5,
            "prompt_lookup_min": 2,
        }


def test_without_speculative_no_flag_is_rendered():
    spec = parse_spec({**SPECULATIVE_SPEC, "engine": {}})
    container = pod_template("d", spec, spec.variants[0], PodDefaults())["spec"]["containers"][0]
    assert "--speculative-config" not in container["args"]


def test_the_lora_ranks_the_crd_allows_for_vllm_are_the_workers():
    from worker.server.settings import VLLM_MAX_LORA_RANKS

    from crds.models import VLLM_LORA_RANKS

    assert VLLM_LORA_RANKS == VLLM_MAX_LORA_RANKS
