"""`llmfleet gateway` option checking and the typed settings: bad input fails fast with a message that says how
to fix it. (The soak test runs the command for real.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gateway.settings import GatewaySettings, TierSettings
from llmfleet.cli import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "smollm2"], "expected MODEL[:VARIANT]=URL"),
        (["--backend", "m=http://a:1", "--namespace", "prod"], "cannot be combined"),
        (["--backend", "m=http://a:1", "--api-keys-file", "/nonexistent/keys"], "cannot read API keys file"),
        (["--backend", "m=http://a:1", "--config", "/nonexistent/gw.yaml"], "cannot read gateway config"),
        (["--kubeconfig", "/nonexistent/kubeconfig"], "cannot load kubeconfig"),
        (["--backend", "m=http://a:1", "--loop", "trio"], "--loop must be auto, asyncio or uvloop"),
        (["--backend", "m=http://a:1", "--http", "h2"], "--http must be auto, h11 or httptools"),
        (["--backend", "m=http://a:1"], "no API keys: pass --api-keys-file FILE or --api-keys-secret"),
        (["--backend", "m=http://a:1", "--port", "9000", "--metrics-port", "9000"], "metrics_port equals port"),
    ],
)
def test_bad_options_exit_2_with_a_clear_message(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["gateway", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_bad_key_file_and_config_are_reported(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-secret-key-1 gold\n")
    result = CliRunner().invoke(app, ["gateway", "--backend", "m=http://a:1", "--api-keys-file", str(keys)])
    assert result.exit_code == 2 and "line 1: unknown tier 'gold'" in result.output
    assert "sk-secret-key-1" not in result.output
    keys.write_text("# no keys yet\n")
    result = CliRunner().invoke(app, ["gateway", "--backend", "m=http://a:1", "--api-keys-file", str(keys)])
    assert result.exit_code == 2 and "holds no key" in result.output
    keys.write_text("sk-secret-key-1\n")
    result = CliRunner().invoke(
        app, ["gateway", "--backend", "m=http://a:1", "--api-keys-file", str(keys), "--insecure-open-mode"]
    )
    assert result.exit_code == 2 and "--insecure-open-mode (allow_open_mode) accepts everyone" in result.output
    open_config = tmp_path / "open.yaml"
    open_config.write_text("allow_open_mode: true\n")
    result = CliRunner().invoke(
        app, ["gateway", "--backend", "m=http://a:1", "--api-keys-file", str(keys), "--config", str(open_config)]
    )
    assert result.exit_code == 2 and "accepts everyone" in result.output
    config = tmp_path / "gw.yaml"
    config.write_text("load_factor: 0.5\n")
    result = CliRunner().invoke(app, ["gateway", "--backend", "m=http://a:1", "--config", str(config)])
    assert result.exit_code == 2 and "load_factor" in result.output


def test_settings_file_with_cli_overrides(tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    config.write_text(
        "port: 9999\nmax_attempts: 5\ntimeouts: {read: 10}\n"
        "tiers: [{name: gold, priority: 2, requests_per_minute: 60}, {name: free, priority: 1}]\ndefault_tier: free\n"
    )
    s = GatewaySettings.from_file(config, port=8081, host=None)
    assert (s.port, s.host, s.max_attempts, s.timeouts.read, s.timeouts.connect) == (8081, "127.0.0.1", 5, 10.0, 5.0)
    assert s.tier("gold").requests_per_minute == 60 and s.default_tier == "free"
    config.write_text("- a list\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        GatewaySettings.from_file(config)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tiers": (TierSettings(name="a", priority=1), TierSettings(name="a", priority=2)), "default_tier": "a"},
            "repeated: a",
        ),
        ({"default_tier": "gold"}, "default_tier 'gold' is not a configured tier"),
        ({"pool": {"max_connections": 10, "max_keepalive_connections": 20}}, "max_keepalive_connections must be <="),
        ({"load_factor": 0.9}, "greater than or equal to 1"),
        ({"unknown": 1}, "Extra inputs are not permitted"),
    ],
)
def test_settings_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GatewaySettings(**kwargs)


def test_tier_names_are_checked() -> None:
    with pytest.raises(ValidationError, match="should match pattern"):
        TierSettings(name="Gold Tier", priority=1)
