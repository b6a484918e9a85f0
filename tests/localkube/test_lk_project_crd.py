"""The project's own CRD and examples, applied with the real kubectl (skipped until they exist)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "inferencedeployment.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

pytestmark = pytest.mark.skipif(
    not CRD.exists() or not EXAMPLES, reason="crds/inferencedeployment.yaml or examples/ not written yet"
)


def test_inferencedeployment_crd_and_examples(kubectl, namespace):
    assert "created" in kubectl("apply", "-f", str(CRD)) or "configured" in kubectl("apply", "-f", str(CRD))
    kubectl("wait", "--for=condition=established", "crd/inferencedeployments.llmfleet.io", "--timeout=20s")
    names = []
    for example in EXAMPLES:
        out = kubectl("apply", "-n", namespace, "-f", str(example))
        assert "inferencedeployment.llmfleet.io/" in out, out
        names += [
            line.split()[0].split("/", 1)[1] for line in out.splitlines() if line.startswith("inferencedeployment")
        ]
    table = kubectl("get", "infd", "-n", namespace)
    header = table.splitlines()[0].split()
    assert header[0] == "NAME" and header[-1] == "AGE" and len(header) > 2  # the CRD's printer columns
    assert sorted(line.split()[0] for line in table.splitlines()[1:]) == sorted(set(names))
    first = sorted(set(names))[0]
    obj = kubectl.json("get", "infd", first, "-n", namespace)
    assert obj["metadata"]["generation"] == 1 and obj["apiVersion"] == "llmfleet.io/v1alpha1"
    assert "Spec:" in kubectl("describe", "infd", first, "-n", namespace)
    assert "scaled" in kubectl("scale", "infd", first, "-n", namespace, "--replicas=2")  # the scale subresource
    scaled = kubectl.json("get", "infd", first, "-n", namespace)
    assert scaled["spec"]["replicas"] == 2 and scaled["metadata"]["generation"] == 2
    explain = kubectl("explain", "infd.spec")
    assert "KIND:       InferenceDeployment" in explain
