"""The chart's CRD is the generated one: its copy cannot drift, and rendering changes nothing but metadata.

crds/inferencedeployment.yaml (generated from crds/models.py) is the source of truth; the chart carries a copy in
files/ because helm can only read files inside the chart. `crds.keep` protects every CRD from `helm uninstall`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "crds" / "inferencedeployment.yaml"
CHART_COPY = REPO / "charts" / "llmfleet" / "files" / "inferencedeployment.yaml"
KEEP = "helm.sh/resource-policy"


def test_chart_copy_is_identical_to_the_generated_crd():
    assert CHART_COPY.read_bytes() == SOURCE.read_bytes(), (
        "charts/llmfleet/files/inferencedeployment.yaml differs from crds/inferencedeployment.yaml; "
        "refresh it: cp crds/inferencedeployment.yaml charts/llmfleet/files/inferencedeployment.yaml"
    )


def _infd_crd(rendered) -> dict:
    return rendered.get("CustomResourceDefinition", "inferencedeployments.llmfleet.io")


def test_rendered_crd_keeps_the_generated_spec_exactly(rendered_sets):
    source = yaml.safe_load(SOURCE.read_text())
    rendered = _infd_crd(rendered_sets["defaults"])
    assert rendered["spec"] == source["spec"]
    assert rendered["apiVersion"] == source["apiVersion"] and rendered["kind"] == source["kind"]
    for key, value in source["metadata"]["labels"].items():
        assert rendered["metadata"]["labels"][key] == value


@pytest.mark.parametrize("keep", [True, False])
def test_keep_annotation_follows_crds_keep(render, keep):
    rendered = render({"crds": {"keep": keep}, "operator": {"replicaCount": 2, "peering": {"enabled": True}}})
    crds = rendered.of_kind("CustomResourceDefinition")
    assert {c["metadata"]["name"] for c in crds} == {
        "inferencedeployments.llmfleet.io",
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
    }
    for crd in crds:
        annotations = crd["metadata"].get("annotations") or {}
        assert (annotations.get(KEEP) == "keep") is keep, crd["metadata"]["name"]


def test_crds_disabled_renders_no_crd(rendered_sets):
    assert rendered_sets["no-crds"].of_kind("CustomResourceDefinition") == []
