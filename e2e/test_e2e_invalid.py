"""An invalid InferenceDeployment is reported and harmless.

- One the schema rejects (an unknown quantization) never reaches the cluster: the API server answers 422 naming
  the field.
- One the schema accepts but the operator's semantic rules refuse (examples/invalid-smollm2.yaml: min above max,
  decreasing canary weights, a drain timeout beyond the grace period, an operator-owned flag) gets the
  `InvalidSpec` condition and a Warning Event, and no pod.
- Meanwhile a healthy deployment beside it keeps its pods and keeps serving through the gateway.
"""

from __future__ import annotations

import time

import pytest

from llmfleet.kube import KubeError, load_manifests
from llmfleet.traffic import stream_chat


def _condition(resource: dict | None, kind: str) -> dict:
    for entry in ((resource or {}).get("status") or {}).get("conditions") or []:
        if entry["type"] == kind:
            return entry
    return {}


def test_invalid_cr_is_reported_and_harmless(scene, fleet, figures) -> None:
    scene.apply(scene.deployment("healthy", replicas=1))
    scene.wait_until(lambda: scene.settled("healthy", 1), "the healthy deployment to settle", timeout_s=90)
    (healthy_pod,) = scene.pods("healthy")

    schema_bad = scene.deployment("schema-bad", replicas=1)
    schema_bad["spec"]["variants"][0]["quantization"] = "int3"
    with pytest.raises(KubeError) as rejected:
        scene.apply(schema_bad)
    assert rejected.value.status == 422 and "quantization" in rejected.value.message
    assert scene.infd("schema-bad") is None

    (invalid,) = load_manifests(scene.repo / "examples" / "invalid-smollm2.yaml")
    started = time.monotonic()
    scene.apply(invalid)
    name = invalid["metadata"]["name"]
    resource = scene.wait_until(
        lambda: (r := scene.infd(name)) and _condition(r, "InvalidSpec").get("status") == "True" and r,
        "InvalidSpec=True",
        timeout_s=60,
    )
    reported_s = time.monotonic() - started
    message = _condition(resource, "InvalidSpec")["message"]
    for problem in ("minReplicas", "timeoutSeconds", "port"):
        assert problem in message, message
    warnings = scene.wait_until(
        lambda: [e for e in scene.events(name) if e["type"] == "Warning" and e["reason"] == "InvalidSpec"],
        "a Warning Event",
        timeout_s=30,
    )
    assert scene.pods(name) == []

    # harmless: the healthy deployment keeps the same pod and serves
    answer = "".join(stream_chat(fleet.gateway_url, fleet.api_key, "healthy", "Hello?", max_tokens=8))
    assert answer
    (same,) = scene.ready_pods("healthy")
    assert same["metadata"]["uid"] == healthy_pod["metadata"]["uid"]
    assert scene.pods(name) == []
    figures(
        f"schema-invalid CR refused with 422; semantically invalid CR reported as InvalidSpec after "
        f"{reported_s:.1f} s with {len(warnings)} Warning event(s) and 0 pods; the healthy deployment kept its "
        f"pod and served"
    )
