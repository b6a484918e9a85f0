"""Table-driven tests of `crds.validate`: schema errors and semantic rules become precise, fixable problems."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from crds.helpers import parse_spec
from crds.validate import Problem, validate, validate_resource


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets `a.b[0].c` in a spec dict, creating mappings on the way."""

    def mutate(spec: dict[str, Any]) -> None:
        node: Any = spec
        parts = path.replace("[", ".[").split(".")
        for part, following in zip(parts, parts[1:] + [None]):
            key: Any = int(part[1:-1]) if part.startswith("[") else part
            if following is None:
                node[key] = value
            else:
                if isinstance(key, str) and key not in node:
                    node[key] = {}
                node = node[key]

    return mutate


def _all(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(spec: dict[str, Any]) -> None:
        for mutation in mutations:
            mutation(spec)

    return mutate


def _autoscaling(**fields: Any) -> dict[str, Any]:
    return {"minReplicas": 1, "maxReplicas": 3, "targets": {"queueDepthPerReplica": 4}} | fields


def _steps(*weights: int) -> dict[str, Any]:
    return {"canary": {"steps": [{"weight": weight} for weight in weights]}}


LORA = _set("engine.lora", {})
ADAPTERS = _set(
    "adapters", [{"name": "sql", "source": "/adapters/sql"}, {"name": "poet", "source": "hf://org/poet@v2"}]
)

VALID = {
    "minimal": None,
    "lora without adapters": LORA,
    "lora with adapters": _all(LORA, ADAPTERS),
    "adapter with a token budget": _all(
        LORA, _set("adapters", [{"name": "a", "source": "file:///a", "tokensPerMinute": 1000}])
    ),
    "vllm with an allowed lora rank": _all(_set("engine.type", "vllm"), _set("engine.lora", {"maxLoraRank": 32})),
    "autoscaling min == max": _set("variants[0].autoscaling", _autoscaling(minReplicas=3, maxReplicas=3)),
    "scale to zero": _set("variants[0].autoscaling", _autoscaling(minReplicas=0, scaleToZeroAfterSeconds=300)),
    "fixed replicas": _set("variants[0].replicas", 0),
    "top-level replicas": _set("replicas", 5),
    "canary 10/50/100": _set("rollout", _steps(10, 50, 100)),
    "single canary step": _set("rollout", _steps(100)),
    "builtin int4": _set("variants[0].quantization", "int4"),
    "builtin int8": _set("variants[0].quantization", "int8"),
    "builtin fp8": _set("variants[0].quantization", "fp8"),
    "vllm fp8": _all(_set("engine.type", "vllm"), _set("variants[0].quantization", "fp8")),
    "vllm int4 from a pre-quantized checkpoint": _all(
        _set("engine.type", "vllm"),
        _set("variants[0].quantization", "int4"),
        _set("variants[0].source", "hf://org/model-awq"),
    ),
    "vllm int8 from a pre-quantized checkpoint": _all(
        _set("engine.type", "vllm"),
        _set("variants[0].quantization", "int8"),
        _set("variants[0].source", "hf://org/model-w8a8"),
    ),
    "drain timeout below grace": _set("drain", {"timeoutSeconds": 29, "terminationGracePeriodSeconds": 30}),
    "quantities as numbers": _set("variants[0].resources", {"cpu": 2, "memory": "1.5Gi", "nvidia.com/gpu": 1}),
    "free-form engine args": _set("engine.extraArgs", {"gpu-memory-utilization": 0.9, "enforce-eager": True}),
    "allow-listed pod fields": _set("template.podSpec", {"runtimeClassName": "nvidia", "affinity": {}}),
    "one weight-0 variant beside a weighted one": _set(
        "variants", [{"name": "a", "weight": 0, "tiers": ["batch"]}, {"name": "b"}]
    ),
    "speculative decoding, defaults": _set("engine.speculative", {}),
    "speculative decoding, every field": _set(
        "engine.speculative",
        {"method": "ngram", "numTokens": 8, "promptLookupMax": 3, "promptLookupMin": 3, "disableByBatchSize": 2},
    ),
    "budget covers max len": _all(
        _set("model.maxModelLen", 1024),
        _set("engine", {"maxNumBatchedTokens": 1024, "enableChunkedPrefill": False}),
    ),
}

# name -> (mutation, [(path, words in the message)]); each case must yield exactly these problems.
INVALID: dict[str, tuple[Callable[[dict[str, Any]], None], list[tuple[str, str]]]] = {
    "adapters without lora": (ADAPTERS, [("spec.adapters", "engine.lora is unset")]),
    "adapter named twice": (
        _all(LORA, _set("adapters", [{"name": "a", "source": "/a"}, {"name": "a", "source": "/b"}])),
        [("spec.adapters[1].name", "used twice")],
    ),
    "adapter named like the model": (
        _all(LORA, _set("adapters", [{"name": "smollm2", "source": "/a"}])),
        [("spec.adapters[0].name", "the model's name")],
    ),
    "adapter named like a variant": (
        _all(LORA, _set("adapters", [{"name": "default", "source": "/a"}])),
        [("spec.adapters[0].name", "the variant 'default'")],
    ),
    "adapter source from s3": (
        _all(LORA, _set("adapters", [{"name": "a", "source": "s3://bucket/a"}])),
        [("spec.adapters[0].source", "match pattern")],
    ),
    "vllm with a lora rank it refuses": (
        _all(_set("engine.type", "vllm"), _set("engine.lora", {"maxLoraRank": 12})),
        [("spec.engine.lora.maxLoraRank", "not 12")],
    ),
    "lora flag in extraArgs": (
        _all(LORA, _set("engine.extraArgs", {"max-loras": 8})),
        [("spec.engine.extraArgs.max-loras", "managed by llmfleet")],
    ),
    "min > max": (
        _set("variants[0].autoscaling", _autoscaling(minReplicas=4, maxReplicas=2)),
        [("spec.variants[0].autoscaling.minReplicas", "minReplicas (4) is greater than maxReplicas (2)")],
    ),
    "equal canary weights": (
        _set("rollout", _steps(10, 10)),
        [("spec.rollout.canary.steps[1].weight", "strictly increase")],
    ),
    "decreasing canary weights": (
        _set("rollout", _steps(10, 50, 30, 100)),
        [("spec.rollout.canary.steps[2].weight", "step 2 has 30 after 50")],
    ),
    "canary weight 0": (
        _set("rollout", _steps(0, 50)),
        [("spec.rollout.canary.steps[0].weight", "greater than or equal to 1")],
    ),
    "canary weight above 100": (
        _set("rollout", _steps(50, 150)),
        [("spec.rollout.canary.steps[1].weight", "less than or equal to 100")],
    ),
    "no canary steps": (
        _set("rollout", {"canary": {"steps": []}}),
        [("spec.rollout.canary.steps", "at least 1 item")],
    ),
    "duplicate variant names": (
        _set("variants", [{"name": "a"}, {"name": "b"}, {"name": "a"}]),
        [("spec.variants[2].name", "'a' is used 2 times")],
    ),
    "no variants": (_set("variants", []), [("spec.variants", "at least 1 item")]),
    "variants missing": (lambda spec: spec.pop("variants"), [("spec.variants", "required")]),
    "vllm int4 without a pre-quantized source": (
        _all(_set("engine.type", "vllm"), _set("variants[0].quantization", "int4")),
        [("spec.variants[0].quantization", "serves int4 only from a pre-quantized checkpoint")],
    ),
    "vllm int8 without a pre-quantized source": (
        _all(_set("engine.type", "vllm"), _set("variants[0].quantization", "int8")),
        [("spec.variants[0].quantization", "serves int8 only from a pre-quantized checkpoint")],
    ),
    "vllm int8 and int4 variants without sources": (
        _all(
            _set("engine.type", "vllm"),
            _set("variants", [{"name": "a", "quantization": "int8"}, {"name": "b", "quantization": "int4"}]),
        ),
        [
            ("spec.variants[0].quantization", "serves int8 only"),
            ("spec.variants[1].quantization", "serves int4 only"),
        ],
    ),
    "unknown quantization": (
        _set("variants[0].quantization", "int3"),
        [("spec.variants[0].quantization", "'none', 'int8', 'fp8' or 'int4'")],
    ),
    "unknown engine": (_set("engine.type", "tgi"), [("spec.engine.type", "'builtin' or 'vllm'")]),
    "drain timeout == grace": (
        _set("drain", {"timeoutSeconds": 30, "terminationGracePeriodSeconds": 30}),
        [("spec.drain.timeoutSeconds", "not below the termination grace period")],
    ),
    "drain timeout > grace (grace defaulted)": (
        _set("drain", {"timeoutSeconds": 200}),
        [("spec.drain.timeoutSeconds", "(200s) is not below the termination grace period (150s)")],
    ),
    "replicas and autoscaling": (
        _all(_set("variants[0].replicas", 2), _set("variants[0].autoscaling", _autoscaling())),
        [("spec.variants[0].replicas", "both")],
    ),
    "no autoscaling target": (
        _set("variants[0].autoscaling", {"maxReplicas": 3}),
        [("spec.variants[0].autoscaling.targets", "no autoscaling target")],
    ),
    "scale-to-zero with minReplicas 1": (
        _set("variants[0].autoscaling", _autoscaling(scaleToZeroAfterSeconds=60)),
        [("spec.variants[0].autoscaling.scaleToZeroAfterSeconds", "minReplicas is 1")],
    ),
    "minReplicas 0 without scale-to-zero time": (
        _set("variants[0].autoscaling", _autoscaling(minReplicas=0)),
        [("spec.variants[0].autoscaling.minReplicas", "scaleToZeroAfterSeconds is not set")],
    ),
    "every weight 0": (
        _set("variants", [{"name": "a", "weight": 0}, {"name": "b", "weight": 0}]),
        [("spec.variants", "every variant has weight 0")],
    ),
    "speculative lookup min above max": (
        _set("engine.speculative", {"promptLookupMax": 2, "promptLookupMin": 3}),
        [("spec.engine.speculative.promptLookupMin", "promptLookupMin (3) is greater than promptLookupMax (2)")],
    ),
    "speculative method unknown": (
        _set("engine.speculative", {"method": "eagle"}),
        [("spec.engine.speculative.method", "'ngram'")],
    ),
    "speculative zero draft tokens": (
        _set("engine.speculative", {"numTokens": 0}),
        [("spec.engine.speculative.numTokens", "greater than or equal to 1")],
    ),
    "speculative too many draft tokens": (
        _set("engine.speculative", {"numTokens": 17}),
        [("spec.engine.speculative.numTokens", "less than or equal to 16")],
    ),
    "speculative config as an extra arg": (
        _set("engine.extraArgs", {"speculative-config": "{}"}),
        [("spec.engine.extraArgs.speculative-config", "managed by llmfleet")],
    ),
    "step budget below max sequences": (
        _set("engine", {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}),
        [("spec.engine.maxNumBatchedTokens", "cannot hold maxNumSeqs (64)")],
    ),
    "no chunked prefill and budget below max len": (
        _all(
            _set("model.maxModelLen", 2048),
            _set("engine", {"maxNumBatchedTokens": 512, "enableChunkedPrefill": False}),
        ),
        [("spec.engine.maxNumBatchedTokens", "2048-token prompt must fit one step")],
    ),
    "reserved engine args in every spelling": (
        _all(
            _set("engine.extraArgs", {"--port": 1, "max_num_seqs": 8, "safe-flag": True}),
            _set("variants[0].extraArgs", {"quantization": "awq"}),
        ),
        [
            ("spec.engine.extraArgs.--port", "managed by llmfleet"),
            ("spec.engine.extraArgs.max_num_seqs", "managed by llmfleet"),
            ("spec.variants[0].extraArgs.quantization", "managed by llmfleet"),
        ],
    ),
    "operator-owned pod fields": (
        _set("template.podSpec", {"containers": [], "affinity": {}, "terminationGracePeriodSeconds": 5}),
        [
            ("spec.template.podSpec.containers", "not an allowed pod field"),
            ("spec.template.podSpec.terminationGracePeriodSeconds", "not an allowed pod field"),
        ],
    ),
    "duplicate env names": (
        _set("template.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
        [("spec.template.env[1].name", "'A' is set more than once")],
    ),
    "typo in a field name": (
        _set("variants[0].autoscaling", {"minReplica": 1, "maxReplicas": 3, "targets": {"queueDepthPerReplica": 1}}),
        [("spec.variants[0].autoscaling.minReplica", "not a field")],
    ),
    "bad model source": (_set("model.source", "s3://bucket/model"), [("spec.model.source", "match pattern")]),
    "colon in model name": (_set("model.name", "smollm2:int4"), [("spec.model.name", "match pattern")]),
    "string where an integer belongs": (_set("replicas", "3"), [("spec.replicas", "valid integer")]),
    "float where an integer belongs": (_set("variants[0].weight", 1.5), [("spec.variants[0].weight", "valid integer")]),
    "string where a boolean belongs": (
        _set("engine.enablePrefixCaching", "yes"),
        [("spec.engine.enablePrefixCaching", "valid boolean")],
    ),
    "required field missing": (
        _set("variants[0].autoscaling", {"minReplicas": 1}),
        [("spec.variants[0].autoscaling.maxReplicas", "required")],
    ),
    "malformed quantity": (
        _set("variants[0].resources", {"cpu": "2 cores"}),
        [("spec.variants[0].resources.cpu", "match pattern")],
    ),
    "negative gpu count": (
        _set("variants[0].resources", {"nvidia.com/gpu": -1}),
        [('spec.variants[0].resources["nvidia.com/gpu"]', "greater than or equal to 0")],
    ),
    "model missing": (lambda spec: spec.pop("model"), [("spec.model", "required")]),
    "several problems at once": (
        _all(
            _set("variants[0].autoscaling", _autoscaling(minReplicas=5, maxReplicas=2)),
            _set("rollout", _steps(60, 40)),
            _set("drain", {"timeoutSeconds": 90, "terminationGracePeriodSeconds": 60}),
        ),
        [
            ("spec.variants[0].autoscaling.minReplicas", "greater than maxReplicas"),
            ("spec.rollout.canary.steps[1].weight", "strictly increase"),
            ("spec.drain.timeoutSeconds", "not below"),
        ],
    ),
}


@pytest.mark.parametrize("mutation", VALID.values(), ids=VALID.keys())
def test_valid_specs_have_no_problems(make_spec: Callable[..., dict[str, Any]], mutation: Any) -> None:
    spec = make_spec(mutation)
    assert validate(spec) == []
    assert validate(parse_spec(spec)) == []


@pytest.mark.parametrize(("mutation", "expected"), INVALID.values(), ids=INVALID.keys())
def test_invalid_specs_yield_exactly_the_expected_problems(
    make_spec: Callable[..., dict[str, Any]], mutation: Any, expected: list[tuple[str, str]]
) -> None:
    problems = validate(make_spec(mutation))
    assert [problem.path for problem in problems] == [path for path, _ in expected], problems
    for problem, (_, words) in zip(problems, expected):
        assert words in problem.message, problem
        assert problem.fix, problem


@pytest.mark.parametrize(
    ("mutation", "path", "fix_words"),
    [
        (_set("variants", []), "spec.variants", "variants: [{name: default}]"),
        (_set("variants[0].autoscaling", _autoscaling(minReplicas=4, maxReplicas=2)), "spec.variants[0]", "<="),
        (_set("model.source", "s3://x"), "spec.model.source", "bundled://smollm2-135m-instruct"),
        (_set("variants[0].autoscaling", _autoscaling(maxReplica=2)), "spec.variants[0]", "rename it to `maxReplicas`"),
        (_set("rollout", _steps(0)), "spec.rollout", "use a value >= 1"),
        (_set("variants[0].quantization", "q4"), "spec.variants[0]", "use one of 'none', 'int8', 'fp8' or 'int4'"),
        (
            _all(_set("engine.type", "vllm"), _set("variants[0].quantization", "int4")),
            "spec.variants[0]",
            "set spec.variants[0].source to an AWQ/GPTQ int4 checkpoint",
        ),
        (
            _all(_set("engine.type", "vllm"), _set("variants[0].quantization", "int8")),
            "spec.variants[0]",
            "set spec.variants[0].source to a compressed-tensors W8A8 / GPTQ 8-bit int8 checkpoint",
        ),
        (_set("engine.extraArgs", {"max-model-len": 4096}), "spec.engine", "set spec.model.maxModelLen"),
        (_set("drain", {"timeoutSeconds": 30, "terminationGracePeriodSeconds": 30}), "spec.drain", "above 30"),
    ],
)
def test_fixes_say_what_to_do(
    make_spec: Callable[..., dict[str, Any]], mutation: Any, path: str, fix_words: str
) -> None:
    [problem] = validate(make_spec(mutation))
    assert problem.path.startswith(path)
    assert fix_words in problem.fix


def test_problem_reads_as_one_line() -> None:
    problem = Problem("spec.drain.timeoutSeconds", "too long", "lower it")
    assert str(problem) == "spec.drain.timeoutSeconds: too long. Fix: lower it"


@pytest.mark.parametrize("spec", [None, [], "spec"])
def test_a_missing_or_malformed_spec_is_a_problem_not_a_crash(spec: Any) -> None:
    [problem] = validate(spec)
    assert problem.path == "spec"


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"apiVersion": "llmfleet.io/v1"}, "apiVersion"),
        ({"kind": "Deployment"}, "kind"),
        ({"metadata": {"name": "Smol_LM"}}, "metadata.name"),
        ({"metadata": {"name": "1smollm"}}, "metadata.name"),
        ({"metadata": {"name": "a" * 64}}, "metadata.name"),
        ({"metadata": {}}, "metadata.name"),
    ],
)
def test_validate_resource_checks_the_envelope(
    make_spec: Callable[..., dict[str, Any]],
    as_resource: Callable[..., dict[str, Any]],
    change: dict[str, Any],
    path: str,
) -> None:
    obj = as_resource(make_spec())
    assert validate_resource(obj) == []
    [problem] = validate_resource(obj | change)
    assert problem.path == path
