"""The operator's drain key and the workers' NetworkPolicy settings, as the chart renders them: the key is a
Secret mounted into the operator pod as a file (no API rights needed to read it), and the NetworkPolicy peers the
operator is given are this release's gateway and operator pods plus the configured scraper."""

from __future__ import annotations

import base64
import json

from fleet_operator.settings import OperatorSettings

OPERATOR = "fleet-llmfleet-operator"
KEY_DIR = "/etc/llmfleet/drain-key"


def _operator(rendered):
    deployment = rendered.get("Deployment", OPERATOR)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment["spec"]["template"]["spec"], container


def _env(container):
    return {e["name"]: e.get("value") for e in container["env"]}


def test_the_drain_key_is_a_generated_secret_mounted_as_a_file(rendered_sets):
    rendered = rendered_sets["defaults"]
    pod, container = _operator(rendered)
    secret = rendered.get("Secret", "fleet-llmfleet-drain-key")
    assert len(base64.b64decode(secret["data"]["key"])) >= 32
    (volume,) = [v for v in pod["volumes"] if v["name"] == "drain-key"]
    assert volume["secret"]["secretName"] == "fleet-llmfleet-drain-key"
    assert volume["secret"]["items"] == [{"key": "key", "path": "key"}]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "drain-key"]
    assert mount == {"name": "drain-key", "mountPath": KEY_DIR, "readOnly": True}
    assert _env(container)["LLMFLEET_OPERATOR_DRAIN_KEY_FILE"] == f"{KEY_DIR}/key"
    assert not any(
        "secretKeyRef" in (e.get("valueFrom") or {}) and "drain" in e["name"].lower() for e in container["env"]
    )


def test_an_existing_drain_key_secret_is_mounted_not_rendered(render):
    rendered = render({"operator": {"drainKey": {"existingSecret": "my-drain-key", "secretKey": "k"}}})
    pod, container = _operator(rendered)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "drain-key"]
    assert volume["secret"]["secretName"] == "my-drain-key"
    assert _env(container)["LLMFLEET_OPERATOR_DRAIN_KEY_FILE"] == f"{KEY_DIR}/k"
    assert not [s for s in rendered.of_kind("Secret") if s["metadata"]["name"].endswith("drain-key")]


def test_network_policy_peers_are_this_releases_pods_and_the_scraper(rendered_sets):
    _pod, container = _operator(rendered_sets["defaults"])
    env = _env(container)
    settings = OperatorSettings.load(
        {k: v for k, v in env.items() if k.startswith("LLMFLEET_OPERATOR_") and v is not None}
    )
    network = settings.policy().network
    assert network.enabled
    gateway, operator, scraper = network.peers
    release_pods = {"app.kubernetes.io/name": "llmfleet", "app.kubernetes.io/instance": "fleet"}
    assert dict(gateway.pod_labels) == {**release_pods, "app.kubernetes.io/component": "gateway"}
    assert dict(operator.pod_labels) == {**release_pods, "app.kubernetes.io/component": "operator"}
    assert gateway.namespace_labels == operator.namespace_labels == {"kubernetes.io/metadata.name": "llm"}
    assert (dict(scraper.pod_labels), scraper.namespace_labels) == ({"app.kubernetes.io/name": "prometheus"}, {})
    # the chart's own gateway and operator pods carry the labels the peers select
    for name, peer in (("fleet-llmfleet-gateway", gateway), (OPERATOR, operator)):
        labels = rendered_sets["defaults"].get("Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert dict(peer.pod_labels).items() <= labels.items(), name


def test_network_policy_can_be_turned_off_and_the_scraper_chosen(render):
    off = _env(_operator(render({"networkPolicy": {"enabled": False}}))[1])
    assert off["LLMFLEET_OPERATOR_NETWORK_POLICY"] == "false"
    assert "LLMFLEET_OPERATOR_NETWORK_POLICY_GATEWAY" not in off
    assert OperatorSettings.load({"LLMFLEET_OPERATOR_NETWORK_POLICY": "false"}).policy().network.enabled is False
    # values merge into the default selector: null removes the default label
    scraper = {
        "namespaceSelector": {"kubernetes.io/metadata.name": "monitoring"},
        "podSelector": {"app": "vmagent", "app.kubernetes.io/name": None},
    }
    env = _env(_operator(render({"networkPolicy": {"enabled": True, "scraper": scraper}}))[1])
    assert json.loads(env["LLMFLEET_OPERATOR_NETWORK_POLICY_SCRAPER"]) == {
        "namespaceSelector": {"kubernetes.io/metadata.name": "monitoring"},
        "podSelector": {"app": "vmagent"},
    }
