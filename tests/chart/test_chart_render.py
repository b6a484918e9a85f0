"""The chart renders with real helm for every value set, and every manifest is a valid Kubernetes object.

Core kinds are validated with kubernetes-validate in strict mode (unknown fields rejected) against the oldest
Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest the validator knows. Kinds backed by CRDs
(Prometheus Operator, kopf peering, our own) have no schema there: they must be exactly the expected set, and
their content is checked by the structure tests in the other test files.
"""

from __future__ import annotations

from collections import Counter

import kubernetes_validate
import pytest
import yaml

CRD_BACKED_API_GROUPS = {"monitoring.coreos.com", "kopf.dev", "llmfleet.io"}
KUBERNETES_VERSIONS = ("1.25.0", f"{kubernetes_validate.latest_version()}.0")
NAMESPACED_KINDS = {
    "Deployment", "Service", "ServiceAccount", "Secret", "ConfigMap", "Role", "RoleBinding",
    "PodDisruptionBudget", "PodMonitor", "ServiceMonitor", "PrometheusRule", "AlertmanagerConfig", "KopfPeering",
}  # fmt: skip


def _group(manifest: dict) -> str:
    api_version = manifest["apiVersion"]
    return api_version.split("/")[0] if "/" in api_version else ""


def test_every_core_manifest_is_valid_in_strict_mode(value_set, rendered_sets):
    manifests = rendered_sets[value_set].manifests
    core = [m for m in manifests if _group(m) not in CRD_BACKED_API_GROUPS]
    assert core, "nothing rendered"
    for manifest in core:
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                name = f"{manifest['kind']}/{manifest['metadata']['name']}"
                pytest.fail(f"{value_set}: {name} is invalid for Kubernetes {version}: {e}\n{yaml.safe_dump(manifest)}")


def test_names_are_unique_short_and_namespaced(value_set, rendered_sets):
    manifests = rendered_sets[value_set].manifests
    keys = [(m["kind"], m["metadata"].get("namespace"), m["metadata"]["name"]) for m in manifests]
    dupes = [k for k, n in Counter(keys).items() if n > 1]
    assert not dupes, f"{value_set}: rendered twice: {dupes}"
    for kind, namespace, name in keys:
        assert len(name) <= 63, f"{kind} name {name!r} is longer than 63 characters"
        if kind in NAMESPACED_KINDS:
            assert namespace, f"{kind}/{name} has no namespace: it would land wherever kubectl points"
        else:
            assert namespace is None, f"cluster-scoped {kind}/{name} has a namespace"


def test_every_object_carries_the_release_labels(value_set, rendered_sets):
    for m in rendered_sets[value_set].manifests:
        labels = m["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/instance") == "fleet", f"{m['kind']}/{m['metadata']['name']}"
        assert labels.get("app.kubernetes.io/part-of") == "llmfleet", f"{m['kind']}/{m['metadata']['name']}"


@pytest.mark.parametrize(
    ("set_name", "expected"),
    [
        ("defaults", {"InferenceDeployment CRD"}),
        ("no-crds", set()),
        ("monitoring", {"InferenceDeployment CRD", "PodMonitor", "PrometheusRule", "AlertmanagerConfig"}),
        ("two-operators", {"InferenceDeployment CRD", "kopf peering CRDs", "KopfPeering"}),
        ("two-operators-cluster-wide", {"InferenceDeployment CRD", "kopf peering CRDs", "ClusterKopfPeering",
                                        "PodMonitor", "PrometheusRule"}),
    ],
)  # fmt: skip
def test_crd_backed_kinds_are_exactly_the_expected_ones(set_name, expected, rendered_sets):
    manifests = rendered_sets[set_name].manifests
    found: set[str] = set()
    for m in manifests:
        if m["kind"] == "CustomResourceDefinition":
            found.add("InferenceDeployment CRD" if m["spec"]["group"] == "llmfleet.io" else "kopf peering CRDs")
        elif _group(m) in CRD_BACKED_API_GROUPS:
            found.add(m["kind"])
    assert found == expected


def test_defaults_render_the_whole_product(rendered_sets):
    kinds = Counter(m["kind"] for m in rendered_sets["defaults"].manifests)
    assert kinds["Deployment"] == 2  # operator + gateway
    assert kinds["ServiceAccount"] == 2
    assert kinds["Service"] == 2  # gateway + operator webhook
    assert kinds["ClusterRole"] == 0 and kinds["ClusterRoleBinding"] == 0, "namespaced RBAC is the default"
    assert kinds["ConfigMap"] == 1  # gateway settings; no dashboard without monitoring
    assert kinds["Secret"] == 2  # the generated alerts token and the operator's drain key


def test_the_validator_rejects_an_unknown_field(rendered_sets):
    """Guards the test above: strict validation really rejects a misspelled field in our Deployment."""
    deployment = next(iter(rendered_sets["defaults"].of_kind("Deployment")))
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)
