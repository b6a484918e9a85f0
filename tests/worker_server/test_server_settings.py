"""Worker settings: drain token sources, fault-injection variables, served model name, validation messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from worker.server.errors import ApiError
from worker.server.faults import FaultInjector
from worker.server.settings import FaultSettings, WorkerSettings, default_host, read_drain_token


def test_token_from_file_wins_over_env(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert read_drain_token(f, {"LLMFLEET_DRAIN_TOKEN": "from-env"}).get_secret_value() == "from-file"
    assert read_drain_token(None, {"LLMFLEET_DRAIN_TOKEN": " from-env "}).get_secret_value() == "from-env"
    assert read_drain_token(None, {}) is None


@pytest.mark.parametrize(
    ("file_text", "env", "message"),
    [
        ("  \n", {}, "is empty"),
        (None, {"LLMFLEET_DRAIN_TOKEN": ""}, "set but empty"),
    ],
)
def test_blank_tokens_are_errors(tmp_path: Path, file_text: str | None, env: dict[str, str], message: str) -> None:
    path = None
    if file_text is not None:
        path = tmp_path / "token"
        path.write_text(file_text)
    with pytest.raises(ValueError, match=message):
        read_drain_token(path, env)


def test_missing_token_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read --drain-token-file"):
        read_drain_token(tmp_path / "absent", {})


def test_fault_settings_from_env() -> None:
    assert not FaultSettings.from_env({"PATH": "/bin"}).enabled
    faults = FaultSettings.from_env(
        {"LLMFLEET_FAULT_TTFT_DELAY_MS": "250", "LLMFLEET_FAULT_ERROR_RATE": "0.5", "LLMFLEET_FAULT_SEED": "7"}
    )
    assert (faults.ttft_delay_ms, faults.itl_delay_ms, faults.error_rate, faults.seed) == (250, 0, 0.5, 7)
    assert faults.enabled


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LLMFLEET_FAULT_ERROR_RATE": "1.5"}, "less than or equal to 1"),
        ({"LLMFLEET_FAULT_TTFT_DELAY_MS": "soon"}, "valid number"),
        ({"LLMFLEET_FAULT_TTFT_DELAY": "5"}, "unknown fault-injection variable LLMFLEET_FAULT_TTFT_DELAY"),
    ],
)
def test_bad_fault_variables(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultSettings.from_env(env)


def test_error_injection_is_seeded_and_proportional() -> None:
    def failures(seed: int) -> list[bool]:
        injector = FaultInjector(FaultSettings(error_rate=0.3, seed=seed))
        out = []
        for _ in range(400):
            try:
                injector.maybe_fail()
                out.append(False)
            except ApiError as err:
                assert err.status == 500 and err.code == "injected_fault"
                out.append(True)
        return out

    assert failures(1) == failures(1)
    assert failures(1) != failures(2)
    assert 80 < sum(failures(1)) < 160  # 30% of 400, loosely
    assert not any(FaultInjector(FaultSettings()).maybe_fail() for _ in range(50))


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"model": "bundled://smollm2-135m-instruct"}, "smollm2-135m-instruct"),
        ({"model": "/models/llama-3-8b/"}, "llama-3-8b"),
        ({"model": "hf://org/repo", "served_model_name": "chat"}, "chat"),
    ],
)
def test_model_name(fields: dict[str, str], name: str) -> None:
    assert WorkerSettings(**fields).model_name == name


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"quantization": "int3"}, "quantization"),
        ({"max_tokens_policy": "truncate"}, "max_tokens_policy"),
        ({"port": 70000}, "port"),
        ({"drain_timeout_s": -1}, "drain_timeout_s"),
        ({"max_waiting": 0}, "max_waiting"),
        ({"drain_token": " "}, "drain_token"),
    ],
)
def test_invalid_settings_name_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        WorkerSettings(model="m", **fields)
    assert info.value.errors()[0]["loc"] == (field,)


def test_default_host() -> None:
    assert default_host({"POD_IP": "10.1.2.3"}) == "10.1.2.3"
    assert default_host({}) == "127.0.0.1"


def test_the_workers_default_port_is_the_port_the_fleet_expects() -> None:
    """The worker image imports nothing of the fleet, so the one fact they share is checked here."""
    from worker.server.settings import DEFAULT_PORT, WorkerSettings

    from crds.pods import WORKER_PORT

    assert DEFAULT_PORT == WORKER_PORT == WorkerSettings(model="fake://m").port
