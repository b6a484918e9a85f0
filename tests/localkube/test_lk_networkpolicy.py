"""Conformance: NetworkPolicies are served like a real API server serves them (defaults, validation, columns,
owner garbage collection), for the kubernetes client and kubectl. localkube stores them but enforces nothing."""

from __future__ import annotations

import json

import kubernetes
import pytest
from kubernetes.client import ApiException

from localkube.testing import wait_for

POLICY = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "workers", "labels": {"app": "w"}},
    "spec": {
        "podSelector": {"matchLabels": {"app": "w"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "gw"}}}], "ports": [{"port": 8000}]}],
    },
}


def test_create_defaults_read_list_patch_delete(api, namespace):
    net = kubernetes.client.NetworkingV1Api(api)
    created = net.create_namespaced_network_policy(namespace, POLICY)
    assert created.spec.policy_types == ["Ingress"]  # defaulted from the rules
    assert created.spec.ingress[0].ports[0].protocol == "TCP"  # defaulted
    assert created.metadata.generation == 1
    listed = net.list_namespaced_network_policy(namespace, label_selector="app=w")
    assert [p.metadata.name for p in listed.items] == ["workers"]
    patched = net.patch_namespaced_network_policy("workers", namespace, {"spec": {"ingress": []}})
    assert patched.spec.ingress in (None, []) and patched.metadata.generation == 2
    net.delete_namespaced_network_policy("workers", namespace)
    with pytest.raises(ApiException) as gone:
        net.read_namespaced_network_policy("workers", namespace)
    assert gone.value.status == 404


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"ingress": []}, "spec.podSelector"),
        ({"podSelector": {}, "policyTypes": ["Sideways"]}, "spec.policyTypes[0]"),
        (
            {"podSelector": {}, "ingress": [{"ports": [{"port": 80, "protocol": "ICMP"}]}]},
            "spec.ingress[0].ports[0].protocol",
        ),
        ({"podSelector": {}, "ingress": [{"ports": [{"port": 70000}]}]}, "spec.ingress[0].ports[0].port"),
    ],
)
def test_invalid_policies_are_refused_naming_the_field(api, namespace, spec, field):
    net = kubernetes.client.NetworkingV1Api(api)
    body = {**POLICY, "metadata": {"name": "bad"}, "spec": spec}
    with pytest.raises(ApiException) as refused:
        net.create_namespaced_network_policy(namespace, body)
    assert refused.value.status == 422
    causes = json.loads(refused.value.body)["details"]["causes"]
    assert field in [c["field"] for c in causes]


def test_owner_garbage_collection_removes_the_policy(api, namespace):
    core = kubernetes.client.CoreV1Api(api)
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    net = kubernetes.client.NetworkingV1Api(api)
    owned = {
        **POLICY,
        "metadata": {
            "name": "owned",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}],
        },
    }
    net.create_namespaced_network_policy(namespace, owned)
    core.delete_namespaced_config_map("owner", namespace)
    wait_for(lambda: not net.list_namespaced_network_policy(namespace).items, what="policy collected")


def test_kubectl_lists_policies_with_their_pod_selector(kubectl, namespace):
    assert "networkpolicies" in kubectl("api-resources")
    kubectl.apply({**POLICY, "metadata": {**POLICY["metadata"], "namespace": namespace}})
    header, row = kubectl("get", "netpol", "-n", namespace).splitlines()[:2]
    assert header.split() == ["NAME", "POD-SELECTOR", "AGE"]
    assert row.split()[:2] == ["workers", "app=w"]
