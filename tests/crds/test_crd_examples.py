"""Examples validate against the generated CRD schema, the models and the semantic rules; the invalid one fails
clearly; and the CRD schema and the pydantic models agree on what is valid."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from crds.cli import app as crd_app
from crds.helpers import parse_resource, parse_spec
from crds.validate import validate_resource

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
VALID = [path for path in EXAMPLES if not path.name.startswith("invalid")]
INVALID = [path for path in EXAMPLES if path.name.startswith("invalid")]


def _load(path: Path) -> dict[str, Any]:
    [doc] = list(yaml.safe_load_all(path.read_text()))
    return doc


def _schema_errors(validator: jsonschema.Draft4Validator, obj: Any) -> list[str]:
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(obj)]


def test_the_promised_examples_exist() -> None:
    names = {path.name for path in EXAMPLES}
    assert {"smollm2-cpu.yaml", "llama3-8b-gpu.yaml", "smollm2-int4-canary.yaml", "invalid-smollm2.yaml"} <= names


@pytest.mark.parametrize("path", VALID, ids=lambda path: path.name)
def test_valid_example_passes_schema_models_and_rules(path: Path, schema_validator: jsonschema.Draft4Validator) -> None:
    obj = _load(path)
    assert _schema_errors(schema_validator, obj) == []
    parsed = parse_resource(obj)
    assert parsed.metadata["name"] == obj["metadata"]["name"]
    assert validate_resource(obj) == []


def test_examples_say_what_they_promise() -> None:
    cpu = parse_resource(_load(EXAMPLES_DIR / "smollm2-cpu.yaml")).spec
    assert cpu.model.source == "bundled://smollm2-135m-instruct"
    assert cpu.engine.type == "builtin"
    [variant] = cpu.variants
    assert variant.autoscaling is not None
    assert (variant.autoscaling.min_replicas, variant.autoscaling.max_replicas) == (1, 3)

    gpu = parse_resource(_load(EXAMPLES_DIR / "llama3-8b-gpu.yaml")).spec
    assert gpu.engine.type == "vllm"
    assert {variant.quantization for variant in gpu.variants} == {"fp8", "int4"}
    assert all(variant.resources.gpu == 1 for variant in gpu.variants)
    assert gpu.rollout is not None and len(gpu.rollout.canary.steps) >= 2

    canary = parse_resource(_load(EXAMPLES_DIR / "smollm2-int4-canary.yaml"))
    assert canary.metadata["name"] == "smollm2"  # applied over smollm2-cpu.yaml, it becomes a canary
    assert [variant.quantization for variant in canary.spec.variants] == ["int4"]
    assert canary.spec.rollout is not None


@pytest.mark.parametrize("path", INVALID, ids=lambda path: path.name)
def test_invalid_example_is_applyable_but_has_clear_problems(
    path: Path, schema_validator: jsonschema.Draft4Validator
) -> None:
    obj = _load(path)
    assert _schema_errors(schema_validator, obj) == []  # kubectl apply accepts it; the operator reports InvalidSpec
    problems = validate_resource(obj)
    assert {problem.path: problem.message for problem in problems} == {
        "spec.variants[0].autoscaling.minReplicas": "minReplicas (4) is greater than maxReplicas (2)",
        "spec.rollout.canary.steps[1].weight": "canary weights must strictly increase, but step 1 has 20 after 50",
        "spec.engine.extraArgs.port": "engine flag 'port' is managed by llmfleet",
        "spec.drain.timeoutSeconds": "drain timeout (60s) is not below the termination grace period (30s), so the "
        "kubelet would kill pods mid-drain",
    }
    assert all(problem.fix for problem in problems)


def test_cli_validate_reports_and_exits_nonzero_on_problems() -> None:
    runner = CliRunner()
    good = runner.invoke(crd_app, ["validate", *map(str, VALID)])
    assert good.exit_code == 0, good.output
    assert good.output.count(": valid") == len(VALID)

    bad = runner.invoke(crd_app, ["validate", str(VALID[0]), *map(str, INVALID)])
    assert bad.exit_code == 1
    assert "smollm2-invalid: 4 problem(s)" in bad.output
    assert "  spec.drain.timeoutSeconds: drain timeout (60s)" in bad.output
    assert "Fix: " in bad.output


def test_cli_validate_handles_multi_document_files_and_bad_yaml(tmp_path: Path) -> None:
    multi = tmp_path / "multi.yaml"
    multi.write_text((EXAMPLES_DIR / "smollm2-cpu.yaml").read_text() + "\n---\napiVersion: v1\nkind: ConfigMap\n")
    result = CliRunner().invoke(crd_app, ["validate", str(multi)])
    assert result.exit_code == 0, result.output
    assert "skipped (kind ConfigMap" in result.output

    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    result = CliRunner().invoke(crd_app, ["validate", str(broken), str(tmp_path / "absent.yaml")])
    assert result.exit_code == 1
    assert result.output.count("cannot read") == 2


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = spec
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        node[last] = value

    return mutate


def _kv_target(value: float) -> dict[str, Any]:
    return {"maxReplicas": 2, "targets": {"kvCacheUtilization": value}}


# The CRD schema (what the API server enforces) and the pydantic models (what the operator parses) must agree.
AGREEMENT = {
    "minimal": (None, True),
    "weight is an integer": (_set("variants.0.weight", 2.5), False),
    "replicas as a string": (_set("replicas", "3"), False),
    "boolean as an integer": (_set("variants.0.replicas", True), False),
    "negative replicas": (_set("replicas", -1), False),
    "kv cache as a number": (_set("engine.kvCacheBytes", 67108864), True),
    "kv cache as a quantity": (_set("engine.kvCacheBytes", "64Mi"), True),
    "kv cache malformed": (_set("engine.kvCacheBytes", "64 MB"), False),
    "cpu as a float": (_set("variants.0.resources", {"cpu": 0.5}), False),
    "cpu as millicores": (_set("variants.0.resources", {"cpu": "500m"}), True),
    "kv target exactly 0": (_set("variants.0.autoscaling", _kv_target(0)), False),
    "kv target 1": (_set("variants.0.autoscaling", _kv_target(1)), True),
    "kv target above 1": (_set("variants.0.autoscaling", _kv_target(1.5)), False),
    "quantization enum": (_set("variants.0.quantization", "int3"), False),
    "quantization int8": (_set("variants.0.quantization", "int8"), True),
    "variant name uppercase": (_set("variants.0.name", "Fp8"), False),
    "variant name too long": (_set("variants.0.name", "v" * 33), False),
    "tier pattern": (_set("variants.0.tiers", ["Gold"]), False),
    "no variants": (_set("variants", []), False),
    "model source path": (_set("model.source", "/models/llama"), True),
    "model source pvc": (_set("model.source", "pvc://models/llama-3"), True),
    "model source s3": (_set("model.source", "s3://models/llama"), False),
    "canary weight 101": (_set("rollout", {"canary": {"steps": [{"weight": 101}]}}), False),
    "canary without steps": (_set("rollout", {"canary": {}}), False),
    "error rate above 1": (
        _set("rollout", {"canary": {"steps": [{"weight": 5}], "analysis": {"errorRateMax": 2}}}),
        False,
    ),
    "label value not a string": (_set("template.labels", {"team": 7}), False),
    "toleration effect": (_set("template.tolerations", [{"effect": "Sometimes"}]), False),
    "env without name": (_set("template.env", [{"value": "x"}]), False),
    "gpu count": (_set("variants.0.resources", {"nvidia.com/gpu": 17}), False),
}


@pytest.mark.parametrize(("mutation", "valid"), AGREEMENT.values(), ids=AGREEMENT.keys())
def test_crd_schema_and_models_agree(
    make_spec: Callable[..., dict[str, Any]],
    as_resource: Callable[..., dict[str, Any]],
    schema_validator: jsonschema.Draft4Validator,
    mutation: Any,
    valid: bool,
) -> None:
    spec = make_spec(mutation)
    assert (_schema_errors(schema_validator, as_resource(spec)) == []) is valid
    try:
        parse_spec(spec)
        parsed = True
    except ValidationError:
        parsed = False
    assert parsed is valid
