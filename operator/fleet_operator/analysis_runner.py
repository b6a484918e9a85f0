"""Canary analysis in the operator: fetch the samples a due check needs, run the probe, let the controllers judge.

Why it exists: the decisions (is a check due, what is compared, what the numbers mean, what follows) are pure and
live in `controllers.rollout` and `controllers.analysis`; this is the I/O around them. The reconcile loop calls
`AnalysisRunner.check` once per pass, before planning; the check is due `intervalSeconds` after the previous one
(`controllers.rollout.analysis_request`), and the plan asks for a pass at that moment, so the loop's own wake-ups
are the analysis timer. The result goes into `Observed.analysis`; the planner records it in
`status.rollout.analysis` (bounded) with an Event and counts failures towards a rollback.

The analysis clock starts when the canary's metrics series first appear, not when the canary starts (a metrics
source sees new pods only after its next scrape, and a check on no data is only a wasted interval): until then
each pass only looks for them (a sample of each canary revision, and of stable, which also sets the scrape
source's baselines) and hands "series present" to `controllers.rollout.await_series`, with when the canary's
first pod became ready. What it found goes into `Observed.canary_metrics_since` (recorded in
`status.rollout.canaryMetricsSince`) or, after the timeout, a failed check.

Per changed variant, one check takes:
- the stable and the canary revision's `RevisionSample` over the interval from the metrics source (Prometheus
  when configured, else the pods' own /metrics; see `metrics_source`), only once the canary has a ready pod
  (before that there is nothing to measure, and an Inconclusive check per interval would only be noise);
- when the quantization differs between stable and canary, the quality probe (`quality_probe.run_probe`: the
  fixed prompts, greedily, on one stable and one canary pod). Greedy outputs of two fixed revisions do not change,
  so a successful probe is remembered per (variant, stable, canary) and not repeated at every check;
- `controllers.analysis.analyse` over those, and `controllers.rollout.combine` across variants.
Nothing here raises into the loop: missing data is an Inconclusive check, never a pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controllers.analysis import RevisionSample, analyse, series_present
from controllers.pods import PodDefaults
from controllers.rollout import (
    AnalysisRequest,
    Comparison,
    analysis_request,
    await_series,
    canary_ready_since,
    combine,
)
from controllers.running_spec import DeploymentView
from crds.models import AnalysisResult
from fleet_operator.metrics_source import (
    MetricsSource,
    PrometheusSource,
    ScrapeSource,
    ScrapeTarget,
    Selector,
    scrape_targets,
)
from fleet_operator.quality_probe import run_probe

log = logging.getLogger(__name__)

# Remembered quality-probe results (variant, stable revision, canary revision) -> agreement; oldest dropped.
MAX_REMEMBERED_PROBES = 64


@dataclass(frozen=True)
class AnalysisObservation:
    """What one pass found: a check's result, and/or the moment the canary's metrics series appeared."""

    result: AnalysisResult | None = None
    metrics_since: datetime | None = None


def metrics_source(prometheus_url: str | None) -> MetricsSource:
    """Prometheus when a URL is configured, else scraping the pods."""
    return PrometheusSource(prometheus_url) if prometheus_url else ScrapeSource()


class AnalysisRunner:
    """Runs due canary analysis checks (one instance per operator; its memory is only a cache)."""

    def __init__(self, source: MetricsSource, defaults: PodDefaults, *, probe_timeout_s: float = 60.0) -> None:
        self.source = source
        self.defaults = defaults
        self.probe_timeout_s = probe_timeout_s
        self._agreements: dict[tuple[str, str, str], float] = {}

    async def aclose(self) -> None:
        await self.source.aclose()

    async def check(
        self, resource: Mapping[str, Any] | DeploymentView, pods: Sequence[Mapping[str, Any]], now: datetime
    ) -> AnalysisObservation:
        """The analysis check due now for this deployment, or the look for the canary's series while its clock
        has not started; an empty observation when nothing is due (or the canary has no ready pod yet).
        `resource`: the object, or the pass's `DeploymentView` of it (then it is not parsed again)."""
        view = DeploymentView.of(resource)
        request = analysis_request(view, now, self.defaults)
        if request is None:
            return AnalysisObservation()
        meta = view.meta
        namespace, name = meta.get("namespace", "default"), meta["name"]
        targets = scrape_targets(pods)
        if not all(_of(targets, c.variant, c.canary) for c in request.comparisons):
            return AnalysisObservation()
        if request.awaiting_series:
            return await self._look_for_series(request, namespace, name, targets, pods, now)
        results = await asyncio.gather(
            *(self._compare(request, c, namespace, name, targets, now) for c in request.comparisons)
        )
        return AnalysisObservation(
            result=combine(
                dict(zip((c.variant for c in request.comparisons), results, strict=True)), step=request.step, now=now
            )
        )

    async def _look_for_series(
        self,
        request: AnalysisRequest,
        namespace: str,
        name: str,
        targets: Sequence[ScrapeTarget],
        pods: Sequence[Mapping[str, Any]],
        now: datetime,
    ) -> AnalysisObservation:
        """Sample every compared revision once: "present" when each canary revision has series (the stable
        samples only set the scrape source's baselines, so the first check covers the same interval for both)."""
        selectors = [Selector(namespace, name, c.variant, c.canary) for c in request.comparisons]
        stable = [
            Selector(namespace, name, c.variant, c.stable)
            for c in request.comparisons
            if _of(targets, c.variant, c.stable)
        ]
        samples = await asyncio.gather(*(self._sample(s, targets, request.window_s) for s in (*selectors, *stable)))
        present = all(series_present(sample) for sample in samples[: len(selectors)])
        ready = [canary_ready_since(pods, c.variant, c.canary) for c in request.comparisons]
        ready_since = None if any(r is None for r in ready) else max(r for r in ready if r is not None)
        wait = await_series(request, present=present, ready_since=ready_since, now=now)
        if wait.metrics_since is not None:
            log.info("%s/%s: the canary's metrics series appeared: the analysis clock starts", namespace, name)
        return AnalysisObservation(result=wait.result, metrics_since=wait.metrics_since)

    async def _compare(
        self,
        request: AnalysisRequest,
        comparison: Comparison,
        namespace: str,
        name: str,
        targets: Sequence[ScrapeTarget],
        now: datetime,
    ) -> AnalysisResult:
        stable_pods = _of(targets, comparison.variant, comparison.stable)
        canary_pods = _of(targets, comparison.variant, comparison.canary)
        stable, canary = await asyncio.gather(
            self._sample(Selector(namespace, name, comparison.variant, comparison.stable), targets, request.window_s)
            if stable_pods
            else _none(),
            self._sample(Selector(namespace, name, comparison.variant, comparison.canary), targets, request.window_s),
        )
        agreement, detail = None, ""
        if comparison.quality_required:
            agreement, detail = await self._quality(request, comparison, stable_pods, canary_pods)
        result = analyse(
            request.spec,
            stable,
            canary,
            step=request.step,
            now=now,
            quality_agreement=agreement,
            quality_required=comparison.quality_required,
        )
        if detail:
            message = f"{result.message} [{detail}]"
            result = result.model_copy(update={"message": message[:4093] + "..." if len(message) > 4096 else message})
        return result

    async def _sample(self, selector: Selector, targets: Sequence[ScrapeTarget], window_s: float) -> RevisionSample:
        try:
            return await self.source.revision(selector, targets, window_s)
        except Exception as error:  # noqa: BLE001 - a source must not raise, but a bug there is missing data here
            log.warning("metrics for %s failed: %s", selector.describe(), error)
            return RevisionSample(stale=True, error=f"{type(error).__name__}: {error}")

    async def _quality(
        self,
        request: AnalysisRequest,
        comparison: Comparison,
        stable_pods: Sequence[ScrapeTarget],
        canary_pods: Sequence[ScrapeTarget],
    ) -> tuple[float | None, str]:
        """(agreement, detail): remembered, or measured on the first ready pod of each revision."""
        key = (comparison.variant, comparison.stable, comparison.canary)
        if key in self._agreements:
            return self._agreements[key], ""
        if not stable_pods:
            return None, "quality probe: no ready stable pod"
        result = await run_probe(
            f"http://{stable_pods[0].address}",
            f"http://{canary_pods[0].address}",
            model=request.model,
            timeout_s=self.probe_timeout_s,
        )
        if result.agreement is not None:
            self._agreements[key] = result.agreement
            while len(self._agreements) > MAX_REMEMBERED_PROBES:
                del self._agreements[next(iter(self._agreements))]
        return result.agreement, result.detail


def _of(targets: Sequence[ScrapeTarget], variant: str, revision: str) -> list[ScrapeTarget]:
    return [t for t in targets if t.variant == variant and t.revision == revision]


async def _none() -> None:
    return None
