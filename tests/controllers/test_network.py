"""The workers' NetworkPolicy: which pods it selects, whom it admits, on which port (pure manifests)."""

from __future__ import annotations

import pytest

from controllers.network import (
    GATEWAY_POD_LABELS,
    OPERATOR_POD_LABELS,
    SCRAPER_POD_LABELS,
    NetworkPolicySettings,
    Peer,
    network_policy_manifest,
    network_policy_matches,
)

META = {"name": "smollm2", "namespace": "team-a", "uid": "uid-1"}


def test_default_policy_admits_gateway_operator_and_prometheus_on_the_worker_port_only():
    manifest = network_policy_manifest(META, NetworkPolicySettings(), 8000)
    assert (manifest["apiVersion"], manifest["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert manifest["metadata"]["name"] == "smollm2-workers"
    assert manifest["metadata"]["namespace"] == "team-a"
    (owner,) = manifest["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "InferenceDeployment",
        "smollm2",
        "uid-1",
        True,
    )
    spec = manifest["spec"]
    assert spec["podSelector"] == {"matchLabels": {"llmfleet.io/deployment": "smollm2"}}
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": dict(GATEWAY_POD_LABELS)}},  # no namespaceSelector: the workers' namespace
        {"podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}},
        {"podSelector": {"matchLabels": dict(SCRAPER_POD_LABELS)}, "namespaceSelector": {"matchLabels": {}}},  # any
    ]


@pytest.mark.parametrize(
    ("peer", "rule"),
    [
        (Peer({"app": "gw"}), {"podSelector": {"matchLabels": {"app": "gw"}}}),
        (
            Peer({"app": "gw"}, {}),
            {"podSelector": {"matchLabels": {"app": "gw"}}, "namespaceSelector": {"matchLabels": {}}},
        ),
        (
            Peer({"app": "gw"}, {"kubernetes.io/metadata.name": "llm"}),
            {
                "podSelector": {"matchLabels": {"app": "gw"}},
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm"}},
            },
        ),
        (
            Peer({}, {"team": "x"}),
            {"podSelector": {"matchLabels": {}}, "namespaceSelector": {"matchLabels": {"team": "x"}}},
        ),
    ],
)
def test_peers_become_from_entries(peer, rule):
    manifest = network_policy_manifest(META, NetworkPolicySettings(peers=(peer,)), 9000)
    assert manifest["spec"]["ingress"] == [{"from": [rule], "ports": [{"protocol": "TCP", "port": 9000}]}]


@pytest.mark.parametrize(
    ("change", "matches"),
    [
        (lambda m: m, True),
        (lambda m: {**m, "status": {}, "metadata": {**m["metadata"], "resourceVersion": "7"}}, True),
        (lambda m: {**m, "spec": {**m["spec"], "egress": [{}]}}, True),  # fields we do not set are not ours
        (lambda m: {**m, "spec": {**m["spec"], "ingress": []}}, False),  # someone opened or closed it
        (lambda m: {**m, "spec": {**m["spec"], "ingress": [{}]}}, False),
        (lambda m: {**m, "spec": {**m["spec"], "podSelector": {}}}, False),
        (lambda m: {k: v for k, v in m.items() if k != "spec"}, False),
    ],
)
def test_an_existing_policy_matches_only_with_the_wanted_spec(change, matches):
    wanted = network_policy_manifest(META, NetworkPolicySettings(), 8000)
    assert network_policy_matches(change(wanted), wanted) is matches
