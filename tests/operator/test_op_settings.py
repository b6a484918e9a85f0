"""Operator settings: environment and flags, validation messages, what they turn into."""

from __future__ import annotations

import pytest

from fleet_operator.settings import OperatorSettings, SettingsError


def test_defaults_watch_the_whole_cluster_standalone():
    settings = OperatorSettings.load({})
    assert settings.namespaces == [] and settings.peering is None
    policy = settings.policy()
    assert (policy.max_surge, policy.max_unavailable) == (1, 0)
    assert policy.defaults.command == ("llmfleet", "worker")


def test_environment_is_read_and_flags_win():
    env = {
        "LLMFLEET_OPERATOR_NAMESPACES": "b, a,,a",
        "LLMFLEET_OPERATOR_RESYNC_SECONDS": "7.5",
        "LLMFLEET_OPERATOR_WORKER_EXTRA_ARGS": "--engine fake --log-level 'debug'",
        "LLMFLEET_OPERATOR_WORKER_COMMAND": '["python3", "-c", "print(1)"]',
        "LLMFLEET_OPERATOR_WORKER_CACHE_DIR": "",
        "LLMFLEET_OPERATOR_PEERING": "llmfleet",
        "OTHER": "ignored",
    }
    settings = OperatorSettings.load(env, resync_seconds=3.0, kubeconfig=None)
    assert settings.namespaces == ["a", "b"]
    assert settings.resync_seconds == 3.0
    assert settings.worker_extra_args == ["--engine", "fake", "--log-level", "debug"]
    assert settings.worker_command == ["python3", "-c", "print(1)"]
    defaults = settings.pod_defaults()
    assert defaults.cache_dir is None and defaults.extra_args == ("--engine", "fake", "--log-level", "debug")
    assert settings.peering == "llmfleet"


@pytest.mark.parametrize(
    ("env", "flags", "needle"),
    [
        ({"LLMFLEET_OPERATOR_RESYNC": "5"}, {}, "unknown setting LLMFLEET_OPERATOR_RESYNC"),
        ({"LLMFLEET_OPERATOR_RESYNC_SECONDS": "-1"}, {}, "LLMFLEET_OPERATOR_RESYNC_SECONDS"),
        ({}, {"log_level": "loud"}, "LLMFLEET_OPERATOR_LOG_LEVEL"),
        ({"LLMFLEET_OPERATOR_MAX_SURGE": "0"}, {}, "MAX_SURGE=1"),
    ],
)
def test_bad_settings_say_what_to_fix(env, flags, needle):
    with pytest.raises(SettingsError, match=needle.replace("(", r"\(")):
        OperatorSettings.load(env, **flags)
