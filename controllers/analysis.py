"""Canary analysis: one check of the canary revision against stable on LLM metrics, as a pure function.

Why it exists: the decision to keep or roll back a canary must be explainable, testable with tables and identical
whether the numbers came from Prometheus or from scraping pods. `analyse` takes per-revision samples aggregated
over the check's interval (`RevisionSample`), the optional quality-probe agreement and the CR's `AnalysisSpec`,
and returns the `AnalysisResult` stored in `status.rollout.analysis`: a verdict, the measured values and a message
that says why.

Rules (each check is judged on its own; the verdict is the worst of them):
- Fail if any measured value breaks its threshold: TTFT p95 ratio (canary / stable) > `ttftP95MaxRatio`,
  ITL p95 ratio > `itlP95MaxRatio`, quality agreement < `qualityMinAgreement`, or the canary error rate
  (5xx and aborted streams over requests) > `errorRateMax`.
- Missing data is Inconclusive, never Pass: a missing or stale sample, a missing metric, no canary requests,
  fewer than `minRequests` requests on either revision (a p95 over a handful of requests is noise), or a required
  quality probe that did not run.
- Errors fail early, soundly: with fewer than `minRequests` requests the error rate is judged against
  errors / minRequests (the lowest rate possible had the missing requests all succeeded). Three errors in four
  requests fail at once; one error in four is Inconclusive until more traffic arrives.
- Latencies below `latency_floor_s` are raised to it before taking ratios: at a few milliseconds the histogram
  buckets cannot tell 4 ms from 8 ms, and a 2x "regression" there is noise, not a reason to roll back.

It also holds `histogram_quantile`, the same estimate PromQL's `histogram_quantile` computes from cumulative
bucket counts, and the delta helpers the scrape path uses to turn two scrapes of cumulative counters into counts
over the interval between them (what `rate`/`increase` do in PromQL).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from crds.models import AnalysisResult, AnalysisSpec, Verdict

# Latencies are floored to this before ratios are taken (see the module docstring).
DEFAULT_LATENCY_FLOOR_S = 0.005
_MESSAGE_LIMIT = 4096


class RevisionSample(BaseModel):
    """Metrics of one revision aggregated over an analysis interval; any value may be missing (None).

    `requests` and `errors` are counts over the interval (PromQL `increase`, so possibly fractional); `errors`
    counts 5xx responses and streams the server aborted or failed after they started. `stale` marks data older
    than the source's freshness limit: a stale sample is treated as missing.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    ttft_p95_seconds: float | None = Field(None, ge=0, description="p95 time to first token over the interval.")
    itl_p95_seconds: float | None = Field(None, ge=0, description="p95 inter-token latency over the interval.")
    requests: float | None = Field(None, ge=0, description="Generation requests received in the interval.")
    errors: float | None = Field(None, ge=0, description="5xx responses and aborted/failed streams in the interval.")
    pods: int | None = Field(None, ge=0, description="Pods the values were aggregated over.")
    observed_at: float | None = Field(None, description="Unix seconds of the data (oldest part of it).")
    stale: bool = Field(False, description="The data is older than the source accepts: treat as missing.")
    error: str | None = Field(None, description="Why data is missing, when the source knows (for messages).")


def series_present(sample: RevisionSample) -> bool:
    """Whether the metrics source has any series of the revision (data time known), stale or not: the analysis
    clock of a canary starts when its series first appear."""
    return sample.observed_at is not None


def _count(value: float) -> str:
    """A counter difference for people: whole when it is (nearly) whole, else one decimal (Prometheus's increase()
    extrapolates to the window's edges)."""
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.1f}"


def _fmt_ratio(value: float) -> str:
    return f"{value:.2f}"


def _latency_ratio(
    name: str,
    stable: float | None,
    canary: float | None,
    floor: float,
) -> tuple[float | None, str | None]:
    """(canary / stable with both floored, None) or (None, why it cannot be computed)."""
    if canary is None:
        return None, f"canary {name} p95 missing"
    if stable is None:
        return None, f"stable {name} p95 missing"
    low = max(stable, floor)
    if low <= 0:
        return (1.0, None) if canary <= 0 else (None, f"stable {name} p95 is 0: no ratio")
    return max(canary, floor) / low, None


def _usable(label: str, sample: RevisionSample | None) -> tuple[RevisionSample | None, str | None]:
    if sample is None:
        return None, f"no {label} metrics"
    if sample.stale:
        return None, f"{label} metrics stale" + (f" ({sample.error})" if sample.error else "")
    return sample, None


@dataclass
class _Findings:
    """What one analysis interval found, in the order the checks ran: the message lists them in that order."""

    failures: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)


def analyse(
    spec: AnalysisSpec,
    stable: RevisionSample | None,
    canary: RevisionSample | None,
    *,
    step: int,
    now: datetime,
    quality_agreement: float | None = None,
    quality_required: bool = False,
    latency_floor_s: float = DEFAULT_LATENCY_FLOOR_S,
) -> AnalysisResult:
    """Judge one analysis interval. `now` must be timezone-aware; `quality_required` is set when the rollout
    changes quantization (then a missing probe result is Inconclusive)."""
    if quality_agreement is not None and not 0 <= quality_agreement <= 1:
        raise ValueError(f"quality agreement must be within 0..1, got {quality_agreement}")
    if latency_floor_s < 0:
        raise ValueError(f"latency_floor_s must be >= 0, got {latency_floor_s}")
    found = _Findings()
    stable_ok, why = _usable("stable", stable)
    if why:
        found.missing.append(why)
    canary_ok, why = _usable("canary", canary)
    if why:
        found.missing.append(why)

    error_rate = _judge_error_rate(spec, canary_ok, found)
    _note_stable_traffic(spec, stable_ok, found)
    enough_traffic = _enough_traffic(spec, stable_ok, canary_ok)
    ratios = _judge_latencies(spec, stable_ok, canary_ok, enough_traffic, latency_floor_s, found)
    _judge_quality(spec, quality_agreement, quality_required, found)

    verdict, message = _verdict(found)
    canary_requests = canary_ok.requests if canary_ok else None
    return AnalysisResult(
        time=now,
        step=step,
        verdict=verdict,
        ttft_p95_ratio=ratios.get("ttft"),
        itl_p95_ratio=ratios.get("itl"),
        error_rate=error_rate,
        quality_agreement=quality_agreement,
        canary_requests=round(canary_requests) if canary_requests is not None else None,
        message=message,
    )


def _judge_error_rate(spec: AnalysisSpec, canary: RevisionSample | None, found: _Findings) -> float | None:
    """The canary's error rate (None without requests), judged against `errorRateMax`; with fewer than
    `minRequests` requests only its lower bound errors / minRequests can fail (see the module docstring)."""
    if canary is None:
        return None
    requests, errors = canary.requests, canary.errors
    if requests is None or errors is None:
        found.missing.append("canary request/error counts missing")
        return None
    min_requests = spec.min_requests
    counted = f"{_count(errors)} errors / {_count(requests)} requests"
    error_rate = min(errors / requests, 1.0) if requests > 0 else None
    lower_bound = min(errors / max(requests, min_requests, 1), 1.0)
    if lower_bound > spec.error_rate_max:
        found.failures.append(
            f"error rate {lower_bound:.3f} > {spec.error_rate_max:g} ({counted})"
            if requests >= min_requests and requests > 0
            else f"error rate at least {lower_bound:.3f} > {spec.error_rate_max:g} ({counted}, "
            f"judged over minRequests {min_requests})"
        )
    elif requests <= 0:
        found.missing.append("no canary requests")
    elif requests < min_requests:
        found.missing.append(f"canary requests {requests:g} < minRequests {min_requests}")
    else:
        found.passed.append(f"error rate {error_rate:.3f} <= {spec.error_rate_max:g} ({counted})")
    return error_rate


def _note_stable_traffic(spec: AnalysisSpec, stable: RevisionSample | None, found: _Findings) -> None:
    """Notes why the stable revision has too little traffic for its p95 to mean something, if it has."""
    if stable is None:
        return
    requests = stable.requests
    if requests is None:
        found.missing.append("stable request count missing")
    elif requests <= 0:
        found.missing.append("no stable requests")
    elif requests < spec.min_requests:
        found.missing.append(f"stable requests {requests:g} < minRequests {spec.min_requests}")


def _enough_traffic(spec: AnalysisSpec, stable: RevisionSample | None, canary: RevisionSample | None) -> bool:
    """Whether both revisions served at least `minRequests` (and some) requests: latency ratios are judged only then."""
    counts = (stable.requests if stable else None, canary.requests if canary else None)
    return all(count is not None and count >= spec.min_requests and count > 0 for count in counts)


def _judge_latencies(
    spec: AnalysisSpec,
    stable: RevisionSample | None,
    canary: RevisionSample | None,
    enough_traffic: bool,
    floor: float,
    found: _Findings,
) -> dict[str, float | None]:
    """TTFT and ITL p95 ratios (canary / stable), keyed "ttft" and "itl". With too little traffic a ratio is
    recorded but not judged (the traffic shortfall is noted by the other checks)."""
    ratios: dict[str, float | None] = {}
    for key, name, limit in (
        ("ttft", "TTFT", spec.ttft_p95_max_ratio),
        ("itl", "ITL", spec.itl_p95_max_ratio),
    ):
        ratio: float | None = None
        if stable is not None and canary is not None:
            ratio, why = _latency_ratio(
                name,
                getattr(stable, f"{key}_p95_seconds"),
                getattr(canary, f"{key}_p95_seconds"),
                floor,
            )
            if why:
                found.missing.append(why)
            elif ratio is not None and enough_traffic:
                (found.failures if ratio > limit else found.passed).append(
                    f"{name} p95 ratio {_fmt_ratio(ratio)} {'>' if ratio > limit else '<='} {limit:g}"
                )
        ratios[key] = ratio
    return ratios


def _judge_quality(spec: AnalysisSpec, agreement: float | None, required: bool, found: _Findings) -> None:
    """The quality probe is judged whenever it ran; its absence counts only when it is required (quantization
    changes)."""
    if agreement is not None:
        if agreement < spec.quality_min_agreement:
            found.failures.append(f"quality agreement {agreement:.3f} < {spec.quality_min_agreement:g}")
        else:
            found.passed.append(f"quality agreement {agreement:.3f} >= {spec.quality_min_agreement:g}")
    elif required:
        found.missing.append("quality probe did not run")


def _verdict(found: _Findings) -> tuple[Verdict, str]:
    """The worst verdict of the checks and the message that says why (failures also name what was missing)."""
    if found.failures:
        extra = [f"also: {'; '.join(found.missing)}"] if found.missing else []
        verdict, parts = Verdict.FAIL, found.failures + extra
    elif found.missing:
        verdict, parts = Verdict.INCONCLUSIVE, found.missing
    else:
        verdict, parts = Verdict.PASS, found.passed
    message = f"{verdict.value}: {'; '.join(parts)}"
    if len(message) > _MESSAGE_LIMIT:
        message = message[: _MESSAGE_LIMIT - 3] + "..."
    return verdict, message


# ---------------------------------------------------------------------------------------------- histogram helpers


def histogram_quantile(q: float, buckets: Mapping[float, float] | Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram given as cumulative counts per upper bound (`le`), exactly as PromQL's
    `histogram_quantile` estimates it: linear interpolation inside the bucket that holds the rank, the lower
    bound of the first bucket taken as 0, and the highest finite bound when the rank falls in the +Inf bucket.

    Returns None where PromQL returns NaN: no +Inf bucket, fewer than two buckets, or no observations.
    Counts that decrease with `le` (a scrape caught mid-update) are made monotonic, as Prometheus does.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be within 0..1, got {q}")
    items = buckets.items() if isinstance(buckets, Mapping) else buckets
    merged: dict[float, float] = {}
    for upper, count in items:
        merged[float(upper)] = merged.get(float(upper), 0.0) + float(count)  # coalesce equal bounds
    ordered = sorted(merged.items())
    if not ordered or not math.isinf(ordered[-1][0]) or len(ordered) < 2:
        return None
    monotonic: list[tuple[float, float]] = []
    highest = -math.inf
    for upper, count in ordered:
        highest = max(highest, count)
        monotonic.append((upper, highest))
    observations = monotonic[-1][1]
    if observations <= 0:
        return None
    rank = q * observations
    index = len(monotonic) - 1  # the +Inf bucket unless a finite bucket reaches the rank
    for i, (_, count) in enumerate(monotonic[:-1]):
        if count >= rank:
            index = i
            break
    if index == len(monotonic) - 1:
        return monotonic[-2][0]
    upper, count = monotonic[index]
    if index == 0 and upper <= 0:
        return upper
    start = 0.0
    if index > 0:
        previous_upper, previous_count = monotonic[index - 1]
        start = previous_upper
        count -= previous_count
        rank -= previous_count
    if count <= 0:  # only q == 0 with an empty first bucket: PromQL's 0/0 gives NaN; the lower edge is the answer
        return start
    return start + (upper - start) * (rank / count)


def counter_delta(previous: float | None, current: float) -> float:
    """Increase of a cumulative counter between two scrapes. A decrease means the counter was reset (the
    process restarted), so the whole current value is the increase, as PromQL's `increase` assumes. Without a
    previous scrape there is no interval: 0."""
    if previous is None:
        return 0.0
    return current if current < previous else current - previous


def bucket_deltas(previous: Mapping[float, float] | None, current: Mapping[float, float]) -> dict[float, float]:
    """Per-`le` increase of a cumulative histogram between two scrapes (buckets missing before count from 0).
    Without a previous scrape every delta is 0 (no interval to measure)."""
    if previous is None:
        return dict.fromkeys(current, 0.0)
    reset = any(count < previous.get(upper, 0.0) for upper, count in current.items())
    if reset:
        return dict(current)
    return {upper: count - previous.get(upper, 0.0) for upper, count in current.items()}


def merge_buckets(histograms: Iterable[Mapping[float, float]]) -> dict[float, float]:
    """Sum several histograms bucket by bucket (PromQL `sum by (le)`)."""
    total: dict[float, float] = {}
    for histogram in histograms:
        for upper, count in histogram.items():
            total[upper] = total.get(upper, 0.0) + count
    return total
