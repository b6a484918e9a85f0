"""The reconcile loop of each InferenceDeployment: observe -> `controllers.reconcile` -> execute, then wait.

A pass observes the CR and its children (asking draining pods how their drain goes), reads the CR once into a
`controllers.running_spec.DeploymentView` (its status and the spec it runs), runs the canary analysis check when
one is due (`analysis_runner`), plans, and executes the plan (marking and draining pods, and loading LoRA adapters
into them, included).

`Fleet.run` is the body of the per-deployment kopf daemon: it makes one pass, then sleeps until something
changes (a watch event on the CR or one of its pods calls `wake`), until the plan asks to look again, or until
the resync interval passes. Passes of one deployment never overlap (a lock per deployment; the deletion handler
takes it too), and wakes that arrive during a pass make the next pass start at once. `Fleet.run_deletion` is
the same loop for a deployment being deleted, run by the deletion handler until its pods are gone. Nothing here decides
anything: the plan does. Errors never escape a pass: they are kept for the next pass (where they show in the
Degraded condition) and the loop backs off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from controllers import Plan, Policy, reconcile
from controllers.running_spec import DeploymentView
from fleet_operator.adapter_client import WorkerAdapters
from fleet_operator.analysis_runner import AnalysisObservation, AnalysisRunner
from fleet_operator.drain_client import WorkerDrains
from fleet_operator.execute import execute
from fleet_operator.kube import KubeApi
from fleet_operator.observe import observe
from fleet_operator.settings import OperatorSettings

log = logging.getLogger(__name__)
Key = tuple[str, str]


@dataclass(frozen=True)
class PassResult:
    """What one pass did: the plan (None when the CR is gone or could not be read) and the errors it hit."""

    plan: Plan | None
    errors: tuple[str, ...] = ()
    gone: bool = False


@dataclass
class Fleet:
    """Reconcile loops of all InferenceDeployments this operator serves (state in memory is only a cache:
    locks, wake-up flags and the last pass's errors; everything durable is in the CRs' status)."""

    api: KubeApi
    policy: Policy
    settings: OperatorSettings
    drains: WorkerDrains | None = None  # None: pods are marked but not sent POST /drain, nor probed
    adapters: WorkerAdapters | None = None  # None: LoRA adapters are neither probed nor loaded
    analysis: AnalysisRunner | None = None  # None: no canary analysis (a canary then waits for a manual promote)
    on_pass: Callable[[Mapping[str, Any], Plan], None] | None = None  # sees each executed plan (operator metrics)
    _wakeups: dict[Key, set[asyncio.Event]] = field(default_factory=dict)  # one per loop of that deployment
    _locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    _errors: dict[Key, tuple[str, ...]] = field(default_factory=dict)

    def wake(self, namespace: str, name: str) -> None:
        """Something about this deployment changed: make its loop pass again now."""
        for event in self._wakeups.get((namespace, name), ()):
            event.set()

    async def reconcile_once(self, namespace: str, name: str) -> PassResult:
        """One observe -> plan -> execute pass."""
        key = (namespace, name)
        async with self._locks.setdefault(key, asyncio.Lock()):
            started = time.monotonic()
            try:
                seen = await observe(
                    self.api,
                    namespace,
                    name,
                    self._errors.get(key, ()),
                    drains=self.drains,
                    adapters=self.adapters,
                    port=self.policy.defaults.port,
                    network_policies=self.policy.network.enabled,
                )
            except Exception as error:  # noqa: BLE001 - the API may be down: back off, never crash
                log.warning("%s/%s: cannot read the deployment: %s", namespace, name, error)
                self._errors[key] = (f"observe: {error}"[:500],)
                return PassResult(None, self._errors[key])
            resource, observed = seen.resource, seen.observed
            if resource is None:
                return PassResult(None, gone=True)
            now = datetime.now(UTC)
            view = DeploymentView.of(resource)  # read once: the analysis and the planner share it
            if self.analysis is not None:
                try:
                    found = await self.analysis.check(view, seen.pods, now)
                except Exception:  # analysis must never stop reconciling; no result is no verdict
                    log.exception("%s/%s: canary analysis failed", namespace, name)
                    found = AnalysisObservation()
                if found.result is not None:
                    log.info("%s/%s: canary analysis: %s", namespace, name, found.result.message)
                observed = replace(observed, analysis=found.result, canary_metrics_since=found.metrics_since)
            plan = reconcile(view, observed, now, self.policy)
            errors = tuple(await execute(self.api, plan, resource, self.drains, self.adapters))
            if self.on_pass is not None:
                self.on_pass(resource, plan)
            if plan.actions:
                log.info(
                    "%s/%s: %d action(s) in %.0f ms; %s",
                    namespace,
                    name,
                    len(plan.actions),
                    (time.monotonic() - started) * 1000,
                    "; ".join(plan.notes),
                )
            self._errors[key] = errors
            return PassResult(plan, errors)

    async def run(self, namespace: str, name: str, halt: asyncio.Event) -> None:
        """Reconcile this deployment until `halt` is set or the deployment is gone."""
        key = (namespace, name)
        wakeup = self._register(key)
        try:
            while not halt.is_set():
                wakeup.clear()
                result = await self.reconcile_once(namespace, name)
                if result.gone:
                    self._forget(key)
                    return
                if result.errors:
                    delay = self.settings.error_backoff_seconds
                elif result.plan is not None and result.plan.requeue_after is not None:
                    delay = min(result.plan.requeue_after, self.settings.resync_seconds)
                else:
                    delay = self.settings.resync_seconds
                await _first_of(delay, wakeup, halt)
        finally:
            self._unregister(key, wakeup)

    async def run_deletion(self, namespace: str, name: str) -> None:
        """Deletion passes for a deployment being deleted, until nothing of it is left running (or it is gone).

        Pod events wake it like the daemon; otherwise it looks again every `deletion_retry_seconds` (and backs off
        on API errors). It never gives up: the finalizer must stay until the pods are gone."""
        key = (namespace, name)
        wakeup = self._register(key)
        try:
            while True:
                wakeup.clear()
                result = await self.reconcile_once(namespace, name)
                if result.gone or (result.plan is not None and result.plan.finished and not result.errors):
                    return
                delay = self.settings.error_backoff_seconds if result.errors else self.settings.deletion_retry_seconds
                await _first_of(delay, wakeup)
        finally:
            self._unregister(key, wakeup)
            self._forget(key)

    def _register(self, key: Key) -> asyncio.Event:
        event = asyncio.Event()
        self._wakeups.setdefault(key, set()).add(event)
        return event

    def _unregister(self, key: Key, event: asyncio.Event) -> None:
        events = self._wakeups.get(key, set())
        events.discard(event)
        if not events:
            self._wakeups.pop(key, None)

    def _forget(self, key: Key) -> None:
        self._errors.pop(key, None)
        if self.adapters is not None:
            self.adapters.forget(key)
        lock = self._locks.get(key)
        if lock is not None and not lock.locked():
            del self._locks[key]


async def _first_of(timeout: float, *events: asyncio.Event) -> None:
    """Sleep until one of the events is set or `timeout` seconds pass."""
    waiters = {asyncio.ensure_future(event.wait()) for event in events}
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
