"""Extra engine flags (`spec.engine.extraArgs`): parsed into vLLM engine arguments; refused by other engines."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner
from worker.server.cli import parse_extra_flags

from llmfleet.cli import app


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], {}),
        (["--gpu-memory-utilization", "0.9"], {"gpu_memory_utilization": 0.9}),
        (["--enforce-eager"], {"enforce_eager": True}),
        (["--enforce-eager", "--swap-space", "4"], {"enforce_eager": True, "swap_space": 4}),
        (["--tokenizer-mode=slow"], {"tokenizer_mode": "slow"}),
        (["--trust-remote-code", "false"], {"trust_remote_code": False}),
    ],
)
def test_parse_extra_flags(argv, expected) -> None:
    assert parse_extra_flags(argv) == expected


def test_a_stray_positional_argument_is_an_error() -> None:
    with pytest.raises(ValueError, match="unexpected argument 'oops'"):
        parse_extra_flags(["oops"])


def test_builtin_engine_refuses_extra_flags_with_a_fix() -> None:
    result = CliRunner().invoke(
        app,
        [
            "worker",
            "--model",
            "fake://m",
            "--engine",
            "fake",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--gpu-memory-utilization",
            "0.9",
        ],
    )
    assert result.exit_code == 2
    assert "--gpu-memory-utilization" in result.output and "--engine vllm" in result.output
