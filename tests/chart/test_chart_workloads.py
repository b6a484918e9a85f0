"""The operator and gateway workloads: hardened, probed, sized, and wired the way the real programs expect.

The wiring checks use the project's own code, so the chart cannot drift from it unnoticed: the operator's
environment goes through `fleet_operator.settings.OperatorSettings.load` (the exact start-up path), the gateway's
flags must be options of the real `llmfleet gateway` command, and the gateway ConfigMap must load as
`gateway.settings.GatewaySettings`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from fleet_operator.settings import ENV_PREFIX, OperatorSettings

from gateway.settings import GatewaySettings
from llmfleet.cli import app as llmfleet_app

OPERATOR = "fleet-llmfleet-operator"
GATEWAY = "fleet-llmfleet-gateway"
# Settings the chart passes that the operator does not accept yet (OperatorSettings rejects unknown
# LLMFLEET_OPERATOR_* names, so the chart's operator would stop at start-up). Remove a name once the operator has it.
PENDING_OPERATOR_SETTINGS: set[str] = set()
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(container: dict[str, Any], downward: dict[str, str]) -> dict[str, str]:
    """The environment the kubelet would give the container: fieldRefs/secretKeyRefs from `downward`, then
    `$(VAR)` references to earlier variables expanded (an unknown reference stays as written, like the kubelet)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), item["value"])
        else:
            source = item["valueFrom"]
            key = source.get("fieldRef", {}).get("fieldPath") or "secret:{name}/{key}".format(**source["secretKeyRef"])
            env[item["name"]] = downward[key]
    return env


def _containers(rendered, deployment: str) -> list[dict[str, Any]]:
    return rendered.get("Deployment", deployment)["spec"]["template"]["spec"]["containers"]


DOWNWARD = {
    "metadata.name": "fleet-llmfleet-operator-7d9f-abcde",
    "metadata.namespace": "llm",
    "status.podIP": "10.1.2.3",
    "secret:fleet-llmfleet-alerts-token/token": "s3cret-token",
    "secret:my-alerts-token/bearer": "s3cret-token",
}


def test_every_container_is_hardened_probed_and_sized(value_set, rendered_sets):
    rendered = rendered_sets[value_set]
    for deployment in rendered.of_kind("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        name = deployment["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod.get("hostNetwork") is not True and pod.get("hostPID") is not True, name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["privileged"] is False, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], name
            assert c["resources"]["limits"]["memory"], name
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                port = c[probe]["httpGet"]["port"]
                assert port in {p["name"] for p in c["ports"]}, f"{name} {probe} probes unknown port {port}"
            writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
            assert "/tmp" in writable, f"{name}: a read-only root filesystem needs a writable /tmp"


def test_operator_environment_is_accepted_by_the_operator(value_set, rendered_sets):
    (container,) = _containers(rendered_sets[value_set], OPERATOR)
    env = container_env(container, DOWNWARD)
    names = {k.removeprefix(ENV_PREFIX) for k in env if k.startswith(ENV_PREFIX)}
    known = {field.upper() for field in OperatorSettings.model_fields}
    unknown = names - known - PENDING_OPERATOR_SETTINGS
    assert not unknown, f"the chart sets operator settings the operator does not know: {sorted(unknown)}"
    accepted = {k: v for k, v in env.items() if k.removeprefix(ENV_PREFIX) in known or not k.startswith(ENV_PREFIX)}
    settings = OperatorSettings.load(accepted)  # raises SettingsError with the variable's name on a bad value
    assert settings.worker_image == "ghcr.io/llmfleet/llmfleet-worker:0.1.0"
    assert settings.liveness_endpoint == "http://10.1.2.3:8080/healthz"
    assert env["POD_ID"] == DOWNWARD["metadata.name"], "kopf's peer identity is the pod name"
    assert container["command"] == ["llmfleet", "operator"]


@pytest.mark.parametrize(
    ("set_name", "namespaces", "peering", "prometheus"),
    [
        ("defaults", ["llm"], None, None),
        ("cluster-wide", [], None, None),
        ("watch-namespaces", ["team-a", "team-b"], None, None),
        ("two-operators", ["llm"], "llmfleet", None),
        ("two-operators-cluster-wide", [], "llmfleet", None),
        ("monitoring", ["llm"], None, "http://prometheus-operated.monitoring.svc:9090"),
    ],
)
def test_operator_settings_follow_the_values(rendered_sets, set_name, namespaces, peering, prometheus):
    (container,) = _containers(rendered_sets[set_name], OPERATOR)
    env = container_env(container, DOWNWARD)
    known = {field.upper() for field in OperatorSettings.model_fields}
    settings = OperatorSettings.load({k: v for k, v in env.items() if k.removeprefix(ENV_PREFIX) in known})
    assert settings.namespaces == namespaces
    assert settings.peering == peering
    assert settings.prometheus_url == prometheus


def test_operator_alerts_token_comes_from_the_secret(rendered_sets):
    defaults = rendered_sets["defaults"]
    (container,) = _containers(defaults, OPERATOR)
    ref = next(e for e in container["env"] if e["name"] == "LLMFLEET_OPERATOR_ALERTS_TOKEN")["valueFrom"]
    assert ref["secretKeyRef"] == {"name": "fleet-llmfleet-alerts-token", "key": "token"}
    secret = defaults.get("Secret", "fleet-llmfleet-alerts-token")
    assert len(secret["data"]["token"]) >= 48
    existing = rendered_sets["custom-gateway"]
    (container,) = _containers(existing, OPERATOR)
    ref = next(e for e in container["env"] if e["name"] == "LLMFLEET_OPERATOR_ALERTS_TOKEN")["valueFrom"]
    assert ref["secretKeyRef"] == {"name": "my-alerts-token", "key": "bearer"}
    secrets = [s["metadata"]["name"] for s in existing.of_kind("Secret")]
    assert secrets == ["fleet-llmfleet-drain-key"], "an existing alerts Secret is referenced, never rendered"


def test_one_operator_is_recreated_two_roll_with_a_budget_and_spread(rendered_sets):
    single = rendered_sets["defaults"].get("Deployment", OPERATOR)["spec"]
    assert single["replicas"] == 1 and single["strategy"]["type"] == "Recreate"
    budgets = rendered_sets["defaults"].of_kind("PodDisruptionBudget")
    assert not [p for p in budgets if "operator" in p["metadata"]["name"]], "a budget for one replica blocks drains"
    two = rendered_sets["two-operators"]
    spec = two.get("Deployment", OPERATOR)["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pdb = two.get("PodDisruptionBudget", OPERATOR)["spec"]
    assert pdb["minAvailable"] == 1 and pdb["selector"] == spec["selector"]


@pytest.mark.parametrize(
    ("set_name", "kind"), [("two-operators", "KopfPeering"), ("two-operators-cluster-wide", "ClusterKopfPeering")]
)
def test_peering_object_is_a_post_install_hook_named_like_the_setting(rendered_sets, set_name, kind):
    (peering,) = rendered_sets[set_name].of_kind(kind)
    assert peering["metadata"]["name"] == "llmfleet"
    assert peering["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    assert ("namespace" in peering["metadata"]) is (kind == "KopfPeering")


def _gateway_options() -> set[str]:
    command = typer.main.get_command(llmfleet_app).commands["gateway"]  # type: ignore[attr-defined]
    return {opt for param in command.params for opt in param.opts}


@pytest.mark.parametrize(
    ("set_name", "namespace", "secret"),
    [
        ("defaults", "llm", "llm/llmfleet-api-keys"),
        ("cluster-wide", None, "llm/llmfleet-api-keys"),
        ("custom-gateway", "llm", "llm/team-keys"),
    ],
)
def test_gateway_flags_are_real_options_and_follow_the_values(rendered_sets, set_name, namespace, secret):
    (container,) = _containers(rendered_sets[set_name], GATEWAY)
    assert container["command"] == ["llmfleet", "gateway"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    unknown = {f"--{flag}" for flag in flags} - _gateway_options()
    assert not unknown, f"llmfleet gateway has no option {unknown}"
    assert flags.get("namespace") == namespace
    assert flags.get("api-keys-secret") == secret
    assert flags["host"] == "$(POD_IP)", "the gateway binds to its pod IP"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert flags["port"] == str(next(p["containerPort"] for p in container["ports"] if p["name"] == "http"))
    assert "insecure-open-mode" not in flags, "the chart never runs the gateway without API keys"
    replicas = rendered_sets[set_name].get("Deployment", GATEWAY)["spec"]["replicas"]
    assert flags["limit-replicas"] == str(replicas), "each replica enforces its share of every key's limits"


def test_gateway_is_ready_only_with_keys_and_live_without(rendered_sets):
    """A missing key Secret makes /ready 503 (not Ready: no traffic) while /health stays 200 (no restart loop)."""
    (container,) = _containers(rendered_sets["defaults"], GATEWAY)
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("set_name", ["defaults", "custom-gateway"])
def test_gateway_configmap_loads_as_gateway_settings(rendered_sets, set_name, tmp_path):
    rendered = rendered_sets[set_name]
    config = rendered.get("ConfigMap", GATEWAY)["data"]["gateway.yaml"]
    path: Path = tmp_path / "gateway.yaml"
    path.write_text(config)
    settings = GatewaySettings.from_file(path, host="10.1.2.3", port=8080)
    expected = yaml.safe_load(config) or {}
    for key, value in expected.items():
        assert getattr(settings, key) == value
    (container,) = _containers(rendered, GATEWAY)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    assert flags["config"] == f"{mount['mountPath']}/gateway.yaml"


def test_gateway_rolls_when_its_config_changes(render):
    def checksum(values: dict[str, Any]) -> str:
        deployment = render(values).get("Deployment", GATEWAY)
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum({}) != checksum({"gateway": {"config": {"max_attempts": 5}}})


def test_services_select_their_pods_and_target_named_ports(value_set, rendered_sets):
    rendered = rendered_sets[value_set]
    deployments = rendered.of_kind("Deployment")
    for service in rendered.of_kind("Service"):
        selector = service["spec"]["selector"]
        matching = [d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matching) == 1, f"Service {service['metadata']['name']} selects {len(matching)} Deployments"
        ports = {p["name"] for c in matching[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            name = service["metadata"]["name"]
            assert port["targetPort"] in ports, f"{name} targets missing port {port['targetPort']}"
