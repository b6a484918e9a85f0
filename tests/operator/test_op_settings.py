"""Operator settings: environment and flags, validation messages, what they turn into."""

from __future__ import annotations

import json
import os
from dataclasses import replace

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


# ------------------------------------------------------------------------------------------------- drain key


def test_the_drain_key_is_read_from_its_file_and_the_same_on_every_start(tmp_path):
    key_file = tmp_path / "drain.key"
    key_file.write_text("x" * 40 + "\n")
    env = {"LLMFLEET_OPERATOR_DRAIN_KEY_FILE": str(key_file)}
    assert OperatorSettings.load(env).load_drain_key() == b"x" * 40
    assert OperatorSettings.load(env).load_drain_key() == OperatorSettings.load(env).load_drain_key()
    assert OperatorSettings.load({"LLMFLEET_OPERATOR_DRAIN_KEY": "y" * 32}).load_drain_key() == b"y" * 32


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({}, "no drain key: put at least 32 random bytes"),
        (
            {"LLMFLEET_OPERATOR_DRAIN_KEY_FILE": "/nonexistent/drain.key"},
            "cannot read LLMFLEET_OPERATOR_DRAIN_KEY_FILE",
        ),
        ({"LLMFLEET_OPERATOR_DRAIN_KEY": "short"}, "fewer than 32"),
        ({"LLMFLEET_OPERATOR_DRAIN_KEY": "k" * 32, "LLMFLEET_OPERATOR_DRAIN_KEY_FILE": "/x"}, "keep one"),
    ],
)
def test_the_operator_refuses_to_start_without_a_usable_drain_key(env, needle):
    with pytest.raises(SettingsError, match=needle):
        OperatorSettings.load(env).load_drain_key()


def test_the_development_flag_gives_a_random_key_per_process():
    settings = OperatorSettings.load({"LLMFLEET_OPERATOR_INSECURE_EPHEMERAL_DRAIN_KEY": "true"})
    first, second = settings.load_drain_key(), settings.load_drain_key()
    assert len(first) >= 32 and first != second


def test_an_empty_key_file_is_refused(tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SettingsError, match="holds 0 bytes"):
        OperatorSettings.load({"LLMFLEET_OPERATOR_DRAIN_KEY_FILE": str(tmp_path / "empty")}).load_drain_key()


def test_the_drain_key_never_shows_in_the_settings_or_the_policy(tmp_path):
    settings = OperatorSettings.load({"LLMFLEET_OPERATOR_DRAIN_KEY": "supersecret" * 4})
    assert "supersecret" not in repr(settings) and "supersecret" not in str(settings.model_dump())
    policy = replace(settings.policy(), drain_key=settings.load_drain_key())
    assert "supersecret" not in repr(policy)


# ---------------------------------------------------------------------------------------------- network policy


def test_network_policy_defaults_admit_the_charts_gateway_and_operator_and_any_prometheus():
    network = OperatorSettings.load({}).policy().network
    assert network.enabled
    assert [(dict(p.pod_labels), p.namespace_labels) for p in network.peers] == [
        ({"app.kubernetes.io/name": "llmfleet", "app.kubernetes.io/component": "gateway"}, None),
        ({"app.kubernetes.io/name": "llmfleet", "app.kubernetes.io/component": "operator"}, None),
        ({"app.kubernetes.io/name": "prometheus"}, {}),
    ]


def test_network_policy_peers_and_switch_come_from_the_environment():
    env = {
        "LLMFLEET_OPERATOR_NETWORK_POLICY": "false",
        "LLMFLEET_OPERATOR_NETWORK_POLICY_GATEWAY": json.dumps(
            {"namespaceSelector": {"kubernetes.io/metadata.name": "llm"}, "podSelector": {"app": "gw"}}
        ),
        "LLMFLEET_OPERATOR_NETWORK_POLICY_SCRAPER": json.dumps(
            {"namespaceSelector": {"team": "monitoring"}, "podSelector": {"app": "vmagent"}}
        ),
    }
    network = OperatorSettings.load(env).policy().network
    assert not network.enabled
    gateway, _operator, scraper = network.peers
    assert (dict(gateway.pod_labels), gateway.namespace_labels) == (
        {"app": "gw"},
        {"kubernetes.io/metadata.name": "llm"},
    )
    assert (dict(scraper.pod_labels), scraper.namespace_labels) == ({"app": "vmagent"}, {"team": "monitoring"})


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("{not json", "LLMFLEET_OPERATOR_NETWORK_POLICY_GATEWAY is not JSON"),
        ('{"namespaceSelector": {}}', "LLMFLEET_OPERATOR_NETWORK_POLICY_GATEWAY.PODSELECTOR"),
        ('{"podSelector": {"bad key!": "x"}}', "not valid label selectors"),
        ('{"podSelector": {}, "namespace": "x"}', "LLMFLEET_OPERATOR_NETWORK_POLICY_GATEWAY.NAMESPACE"),
    ],
)
def test_bad_network_policy_peers_say_what_to_fix(raw, needle):
    with pytest.raises(SettingsError, match=needle):
        OperatorSettings.load({"LLMFLEET_OPERATOR_NETWORK_POLICY_GATEWAY": raw})


def test_the_operator_command_refuses_to_start_without_a_drain_key(monkeypatch):
    import typer
    from fleet_operator.cli import operator_command
    from typer.testing import CliRunner

    for name in [n for n in os.environ if n.startswith("LLMFLEET_OPERATOR_")]:
        monkeypatch.delenv(name)
    app = typer.Typer()
    app.command()(operator_command)
    result = CliRunner().invoke(app, ["--namespace", "x"])
    assert result.exit_code == 2
    assert "no drain key" in result.output and "LLMFLEET_OPERATOR_DRAIN_KEY_FILE" in result.output
