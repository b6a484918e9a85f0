"""Canary analysis verdicts: tables of stable/canary samples against the CR's thresholds."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from controllers.analysis import RevisionSample, analyse
from crds.models import AnalysisResult, AnalysisSpec, Verdict

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
SPEC = AnalysisSpec(
    ttft_p95_max_ratio=1.5, itl_p95_max_ratio=1.5, error_rate_max=0.01, quality_min_agreement=0.9, min_requests=10
)


def sample(**overrides: Any) -> RevisionSample:
    values: dict[str, Any] = {
        "ttft_p95_seconds": 0.2,
        "itl_p95_seconds": 0.05,
        "requests": 100.0,
        "errors": 0.0,
        "observed_at": 1000.0,
    }
    values.update(overrides)
    return RevisionSample(**values)


STABLE = sample()

# (id, stable, canary, keyword arguments, verdict, fragments the message must contain)
CASES: list[tuple[str, RevisionSample | None, RevisionSample | None, dict[str, Any], Verdict, list[str]]] = [
    (
        "all good",
        STABLE,
        sample(ttft_p95_seconds=0.22, itl_p95_seconds=0.06),
        {},
        Verdict.PASS,
        ["TTFT p95 ratio 1.10 <= 1.5", "ITL p95 ratio 1.20 <= 1.5", "error rate 0.000"],
    ),
    ("canary faster", STABLE, sample(ttft_p95_seconds=0.1, itl_p95_seconds=0.01), {}, Verdict.PASS, []),
    (
        "ratio exactly at the limit passes",
        STABLE,
        sample(ttft_p95_seconds=0.3),
        {},
        Verdict.PASS,
        ["TTFT p95 ratio 1.50 <= 1.5"],
    ),
    ("TTFT regression", STABLE, sample(ttft_p95_seconds=0.5), {}, Verdict.FAIL, ["TTFT p95 ratio 2.50 > 1.5"]),
    ("ITL regression", STABLE, sample(itl_p95_seconds=0.1), {}, Verdict.FAIL, ["ITL p95 ratio 2.00 > 1.5"]),
    (
        "error rate over max",
        STABLE,
        sample(errors=5.0),
        {},
        Verdict.FAIL,
        ["error rate 0.050 > 0.01", "5 errors / 100 requests"],
    ),
    ("error rate at max passes", STABLE, sample(errors=1.0), {}, Verdict.PASS, ["error rate 0.010 <= 0.01"]),
    (
        "quality below min",
        STABLE,
        sample(),
        {"quality_agreement": 0.5},
        Verdict.FAIL,
        ["quality agreement 0.500 < 0.9"],
    ),
    (
        "quality good",
        STABLE,
        sample(),
        {"quality_agreement": 0.95, "quality_required": True},
        Verdict.PASS,
        ["quality agreement 0.950 >= 0.9"],
    ),
    # Missing data: never a pass.
    ("no canary sample", STABLE, None, {}, Verdict.INCONCLUSIVE, ["no canary metrics"]),
    ("no stable sample", None, sample(), {}, Verdict.INCONCLUSIVE, ["no stable metrics"]),
    ("no samples at all", None, None, {}, Verdict.INCONCLUSIVE, ["no stable metrics", "no canary metrics"]),
    (
        "stale canary",
        STABLE,
        sample(stale=True, error="last scrape 300 s ago"),
        {},
        Verdict.INCONCLUSIVE,
        ["canary metrics stale (last scrape 300 s ago)"],
    ),
    ("stale stable", sample(stale=True), sample(), {}, Verdict.INCONCLUSIVE, ["stable metrics stale"]),
    (
        "canary TTFT missing",
        STABLE,
        sample(ttft_p95_seconds=None),
        {},
        Verdict.INCONCLUSIVE,
        ["canary TTFT p95 missing"],
    ),
    (
        "stable ITL missing",
        sample(itl_p95_seconds=None),
        sample(),
        {},
        Verdict.INCONCLUSIVE,
        ["stable ITL p95 missing"],
    ),
    (
        "canary counts missing",
        STABLE,
        sample(requests=None, errors=None),
        {},
        Verdict.INCONCLUSIVE,
        ["canary request/error counts missing"],
    ),
    (
        "canary errors missing",
        STABLE,
        sample(errors=None),
        {},
        Verdict.INCONCLUSIVE,
        ["canary request/error counts missing"],
    ),
    (
        "stable requests missing",
        sample(requests=None),
        sample(),
        {},
        Verdict.INCONCLUSIVE,
        ["stable request count missing"],
    ),
    (
        "too few canary requests",
        STABLE,
        sample(requests=3.0),
        {},
        Verdict.INCONCLUSIVE,
        ["canary requests 3 < minRequests 10"],
    ),
    (
        "too few canary requests hides a bad ratio",
        STABLE,
        sample(requests=3.0, ttft_p95_seconds=5.0),
        {},
        Verdict.INCONCLUSIVE,
        ["canary requests 3 < minRequests 10"],
    ),
    (
        "too few stable requests",
        sample(requests=4.0),
        sample(),
        {},
        Verdict.INCONCLUSIVE,
        ["stable requests 4 < minRequests 10"],
    ),
    (
        "no canary traffic",
        STABLE,
        sample(requests=0.0, ttft_p95_seconds=None, itl_p95_seconds=None),
        {},
        Verdict.INCONCLUSIVE,
        ["no canary requests"],
    ),
    (
        "quality required but not run",
        STABLE,
        sample(),
        {"quality_required": True},
        Verdict.INCONCLUSIVE,
        ["quality probe did not run"],
    ),
    # Errors fail early: judged against minRequests when traffic is short.
    (
        "many errors in few requests fail",
        STABLE,
        sample(requests=4.0, errors=3.0),
        {},
        Verdict.FAIL,
        ["error rate at least 0.300 > 0.01", "judged over minRequests 10"],
    ),
    (
        "errors fail even with missing latencies",
        STABLE,
        sample(requests=20.0, errors=20.0, ttft_p95_seconds=None, itl_p95_seconds=None),
        {},
        Verdict.FAIL,
        ["error rate 1.000 > 0.01", "also: canary TTFT p95 missing"],
    ),
    # Latency floor: a few milliseconds are noise.
    (
        "sub-floor latencies compare as equal",
        sample(ttft_p95_seconds=0.001, itl_p95_seconds=0.002),
        sample(ttft_p95_seconds=0.004, itl_p95_seconds=0.004),
        {},
        Verdict.PASS,
        ["TTFT p95 ratio 1.00"],
    ),
    (
        "floor off: the same numbers fail",
        sample(ttft_p95_seconds=0.001, itl_p95_seconds=0.002),
        sample(ttft_p95_seconds=0.004, itl_p95_seconds=0.004),
        {"latency_floor_s": 0.0},
        Verdict.FAIL,
        ["TTFT p95 ratio 4.00 > 1.5", "ITL p95 ratio 2.00 > 1.5"],
    ),
    (
        "stable p95 zero without floor",
        sample(ttft_p95_seconds=0.0),
        sample(),
        {"latency_floor_s": 0.0},
        Verdict.INCONCLUSIVE,
        ["stable TTFT p95 is 0"],
    ),
    (
        "both zero without floor",
        sample(ttft_p95_seconds=0.0),
        sample(ttft_p95_seconds=0.0),
        {"latency_floor_s": 0.0},
        Verdict.PASS,
        ["TTFT p95 ratio 1.00"],
    ),
]


@pytest.mark.parametrize(
    ("stable", "canary", "kwargs", "verdict", "fragments"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_verdicts(
    stable: RevisionSample | None,
    canary: RevisionSample | None,
    kwargs: dict[str, Any],
    verdict: Verdict,
    fragments: list[str],
) -> None:
    result = analyse(SPEC, stable, canary, step=1, now=NOW, **kwargs)
    assert result.verdict == verdict, result.message
    assert result.message.startswith(f"{verdict.value}: ")
    for fragment in fragments:
        assert fragment in result.message


def test_result_records_measured_values_and_round_trips_through_status() -> None:
    result = analyse(
        SPEC,
        STABLE,
        sample(ttft_p95_seconds=0.3, itl_p95_seconds=0.1, requests=40.0, errors=2.0),
        step=2,
        now=NOW,
        quality_agreement=0.75,
    )
    assert result.step == 2 and result.time == NOW
    assert result.ttft_p95_ratio == pytest.approx(1.5)
    assert result.itl_p95_ratio == pytest.approx(2.0)
    assert result.error_rate == pytest.approx(0.05)
    assert result.quality_agreement == 0.75
    assert result.canary_requests == 40
    dumped = result.model_dump(mode="json", by_alias=True)
    assert {"ttftP95Ratio", "itlP95Ratio", "errorRate", "qualityAgreement", "canaryRequests"} <= dumped.keys()
    assert AnalysisResult.model_validate(dumped) == result


def test_inconclusive_still_records_what_was_measured() -> None:
    result = analyse(SPEC, STABLE, sample(requests=3.0, ttft_p95_seconds=0.4), step=0, now=NOW)
    assert result.verdict == Verdict.INCONCLUSIVE
    assert result.ttft_p95_ratio == pytest.approx(2.0)
    assert result.canary_requests == 3


def test_min_requests_zero_still_needs_traffic() -> None:
    spec = SPEC.model_copy(update={"min_requests": 0})
    idle = sample(requests=0.0, ttft_p95_seconds=None, itl_p95_seconds=None)
    assert analyse(spec, STABLE, idle, step=0, now=NOW).verdict == Verdict.INCONCLUSIVE
    assert analyse(spec, STABLE, sample(requests=1.0), step=0, now=NOW).verdict == Verdict.PASS


def test_error_rate_never_exceeds_one() -> None:
    # `increase()` extrapolates, so errors can slightly exceed requests.
    result = analyse(SPEC, STABLE, sample(requests=10.0, errors=10.4), step=0, now=NOW)
    assert result.verdict == Verdict.FAIL and result.error_rate == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quality_agreement": 1.5}, "quality agreement must be within 0..1"),
        ({"latency_floor_s": -1.0}, "latency_floor_s must be >= 0"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        analyse(SPEC, STABLE, sample(), step=0, now=NOW, **kwargs)


@pytest.mark.parametrize("field", ["ttft_p95_seconds", "requests", "errors"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_samples_reject_impossible_values(field: str, value: float) -> None:
    with pytest.raises(ValidationError):
        RevisionSample(**{field: value})
