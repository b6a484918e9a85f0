"""Helpers between API dicts and models: parse leniently, dump camelCase without None, quantities exactly."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from crds.helpers import dump_spec, dump_status, parse_quantity, parse_resource, parse_spec, parse_status
from crds.models import (
    AlertIntent,
    AnalysisResult,
    Condition,
    DrainStatus,
    Endpoint,
    InferenceDeploymentStatus,
    MetricInputs,
    Recommendation,
    RevisionReplicas,
    RolloutPhase,
    RolloutStatus,
    ScaleDecision,
    VariantAutoscalingStatus,
    VariantStatus,
    Verdict,
)

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


def _full_status() -> InferenceDeploymentStatus:
    """A status with every part filled in, as the operator will write it mid-rollout."""
    return InferenceDeploymentStatus(
        observed_generation=3,
        phase="Progressing",
        replicas=3,
        ready_replicas=2,
        desired_replicas=4,
        label_selector="llmfleet.io/deployment=smollm2",
        conditions=[
            Condition(
                type="Progressing", status="True", reason="CanaryStep", message="step 1", last_transition_time=NOW
            ),
        ],
        variants=[
            VariantStatus(
                name="default",
                replicas=3,
                ready_replicas=2,
                desired_replicas=4,
                draining_replicas=1,
                revisions=[RevisionReplicas(revision="abc123", replicas=2, ready_replicas=2, desired_replicas=2)],
            )
        ],
        rollout=RolloutStatus(
            phase=RolloutPhase.PROGRESSING,
            stable_revision="abc123",
            canary_revision="def456",
            step=1,
            canary_weight=50,
            started_at=NOW,
            step_started_at=NOW,
            consecutive_failures=1,
            analysis=[AnalysisResult(time=NOW, step=0, verdict=Verdict.PASS, ttft_p95_ratio=1.1, canary_requests=40)],
            stable_spec={"model": {"name": "smollm2"}, "anything": [1, 2]},
        ),
        autoscaling={
            "variants": [
                VariantAutoscalingStatus(
                    name="default",
                    desired_replicas=4,
                    last_scale_time=NOW,
                    last_decisions=[
                        ScaleDecision(
                            time=NOW,
                            current_replicas=3,
                            desired_replicas=4,
                            inputs=MetricInputs(queue_depth_per_replica=6.5, kv_cache_utilization=0.4),
                            reason="queue depth 6.5 > 4",
                        )
                    ],
                    recommendations=[Recommendation(time=NOW, replicas=4)],
                    alert_intents=[
                        AlertIntent(
                            alert="QueueHigh", replicas=4, received_at=NOW, expires_at=NOW + timedelta(minutes=5)
                        )
                    ],
                )
            ]
        },
        drains=[DrainStatus(pod="smollm2-default-abc123-x1", started_at=NOW, deadline=NOW + timedelta(seconds=30))],
        endpoints=[Endpoint(variant="default", revision="def456", weight=50, canary=True, quantization="int4")],
    )


def test_dumped_status_is_camel_case_without_none_and_fits_the_crd(openapi_schema: dict[str, Any]) -> None:
    dumped = dump_status(_full_status())
    assert dumped["rollout"]["canaryWeight"] == 50
    assert dumped["rollout"]["stepStartedAt"] == "2025-01-02T03:04:05Z"
    assert dumped["autoscaling"]["variants"][0]["lastDecisions"][0]["inputs"] == {
        "queueDepthPerReplica": 6.5,
        "kvCacheUtilization": 0.4,
    }
    assert "rejectedRevision" not in dumped["rollout"]
    assert "null" not in yaml.safe_dump(dumped)
    jsonschema.Draft4Validator(openapi_schema["properties"]["status"]).validate(dumped)


def test_status_round_trips() -> None:
    status = _full_status()
    assert parse_status(dump_status(status)) == status


def test_parse_status_ignores_unknown_fields_and_accepts_none() -> None:
    dumped = dump_status(_full_status())
    dumped["futureField"] = {"x": 1}
    dumped["rollout"]["futureRolloutField"] = 7
    dumped["variants"][0]["futureVariantField"] = "y"
    assert parse_status(dumped) == _full_status()
    assert parse_status(None) == InferenceDeploymentStatus()


def test_parse_resource_reads_an_api_object_with_status() -> None:
    obj = yaml.safe_load((EXAMPLES_DIR / "smollm2-cpu.yaml").read_text())
    obj["metadata"] |= {"uid": "u-1", "resourceVersion": "7", "generation": 2}
    obj["status"] = dump_status(_full_status()) | {"unknown": True}
    parsed = parse_resource(obj)
    assert parsed.metadata["uid"] == "u-1"
    assert parsed.spec.model.name == "smollm2"
    assert parsed.status.rollout.canary_revision == "def456"


def test_parse_resource_without_status_gets_an_empty_one() -> None:
    parsed = parse_resource(yaml.safe_load((EXAMPLES_DIR / "smollm2-cpu.yaml").read_text()))
    assert parsed.status == InferenceDeploymentStatus()
    assert dump_status(parsed.status)["phase"] == "Pending"


def test_parse_resource_raises_on_a_bad_spec() -> None:
    with pytest.raises(ValidationError):
        parse_resource({"spec": {"model": {"name": "x"}}})


def test_conditions_need_an_aware_time() -> None:
    with pytest.raises(ValidationError):
        Condition(type="Available", status="True", last_transition_time=datetime(2025, 1, 1))


def test_dumped_spec_keeps_defaults_and_fits_the_crd(
    make_spec: Callable[..., dict[str, Any]], openapi_schema: dict[str, Any]
) -> None:
    dumped = dump_spec(parse_spec(make_spec()))
    assert dumped["engine"]["type"] == "builtin"
    assert dumped["variants"][0]["quantization"] == "none"
    assert dumped["drain"] == {"timeoutSeconds": 120, "terminationGracePeriodSeconds": 150}
    assert "replicas" not in dumped
    jsonschema.Draft4Validator(openapi_schema["properties"]["spec"]).validate(dumped)
    assert parse_spec(dumped) == parse_spec(make_spec())


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        (2, Decimal(2)),
        ("64Mi", Decimal(64 * 2**20)),
        ("1.5Gi", Decimal(3 * 2**29)),
        ("1k", Decimal(1000)),
        ("1e9", Decimal(10**9)),
        ("1E", Decimal(10**18)),
        ("100u", Decimal("0.0001")),
        ("+.5", Decimal("0.5")),
    ],
)
def test_parse_quantity(text: str | int, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Mi", "2 Gi", "1e3Mi", "1.5.Gi", "1KB", True])
def test_parse_quantity_refuses_malformed_values(text: Any) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)
