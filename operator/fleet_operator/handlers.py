"""kopf handlers: thin wiring from watch events and lifecycles to `Fleet` (all decisions live in `controllers`).

- startup/cleanup: configure kopf (our finalizer name, annotation storage under `llmfleet.io`, only warnings as
  kopf's own Events) and open/close the API client, the workers' drain client and the canary analysis runner
  (its metrics source: Prometheus when configured, else pod scraping); login: the credentials found at start-up.
- a daemon per InferenceDeployment runs its reconcile loop (`Fleet.run`); kopf starts one for every existing CR
  when the operator starts (resume) and for every new one, and stops it when the CR is deleted.
- `on.event` for the CRs and for pods labelled `llmfleet.io/deployment` wakes the owning deployment's loop, so
  a dead pod or a `kubectl scale` is acted on at once rather than at the next resync.
- the autoscaler's timer, its Alertmanager/metrics HTTP server and the operator metrics are registered by
  `autoscaler.register_autoscaling`.
- `on.delete` holds the finalizer until the deployment's pods are gone: it runs deletion passes until the plan
  says `finished` (`Fleet.run_deletion`). kopf records in the CR's annotations that the handler has not
  finished, so an operator restart mid-deletion runs it again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import kopf

from crds.models import GROUP, PLURAL, VERSION
from crds.pods import LABEL_DEPLOYMENT
from fleet_operator.adapter_client import WorkerAdapters
from fleet_operator.analysis_runner import AnalysisRunner, metrics_source
from fleet_operator.autoscaler import register_autoscaling
from fleet_operator.drain_client import WorkerDrains
from fleet_operator.fleet import Fleet
from fleet_operator.kube import Credentials, KubeApi
from fleet_operator.settings import OperatorSettings

FINALIZER = "llmfleet.io/finalizer"
ANNOTATION_PREFIX = "llmfleet.io"
CR = (GROUP, VERSION, PLURAL)


def build_registry(
    operator_settings: OperatorSettings, credentials: Credentials, drain_key: bytes
) -> kopf.OperatorRegistry:
    """A kopf registry with the operator's handlers, bound to these settings, credentials and drain-token key (the
    planner puts the derived tokens into new pods; the drain client sends them)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        settings.posting.level = logging.WARNING
        settings.peering.lifetime = operator_settings.peering_lifetime_seconds
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per drain probe and scrape otherwise
        policy = replace(operator_settings.policy(), drain_key=drain_key)
        drains = WorkerDrains(key=drain_key)
        memo.fleet = Fleet(
            KubeApi(credentials, timeout=operator_settings.api_timeout_seconds),
            policy,
            operator_settings,
            drains=drains,
            adapters=WorkerAdapters(drains.token),
            analysis=AnalysisRunner(metrics_source(operator_settings.prometheus_url), policy.defaults),
        )

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        fleet: Fleet | None = getattr(memo, "fleet", None)
        if fleet is not None:
            await fleet.api.aclose()
            if fleet.drains is not None:
                await fleet.drains.aclose()
            if fleet.adapters is not None:
                await fleet.adapters.aclose()
            if fleet.analysis is not None:
                await fleet.analysis.aclose()

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        scheme, _sep, token = (credentials.authorization or "").partition(" ")
        if credentials.token_file:
            # a projected token of a few hundred bytes on a local volume: the read does not block the loop
            scheme, token = "Bearer", Path(credentials.token_file).read_text().strip()  # noqa: ASYNC240
        return kopf.ConnectionInfo(
            server=credentials.server,
            ca_path=credentials.ca_path,
            insecure=credentials.insecure,
            scheme=scheme or None,
            token=token or None,
            certificate_path=credentials.cert_path,
            private_key_path=credentials.key_path,
            username=credentials.username,
            password=credentials.password,
        )

    @kopf.daemon(*CR, id="reconcile", registry=registry, cancellation_polling=1.0)  # type: ignore[arg-type]  # kopf types handlers with every kwarg; ours take what they use
    async def reconcile_loop(namespace: str, name: str, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any) -> None:
        halt = asyncio.Event()

        async def relay() -> None:
            await stopped.wait()
            halt.set()

        relay_task = asyncio.create_task(relay())
        try:
            await memo.fleet.run(namespace, name, halt)
        finally:
            relay_task.cancel()

    @kopf.on.delete(*CR, id="finalize", registry=registry)  # type: ignore[arg-type]  # kopf types handlers with every kwarg; ours take what they use
    async def finalize(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
        await memo.fleet.run_deletion(namespace, name)

    @kopf.on.event(*CR, id="deployment-changed", registry=registry)  # type: ignore[arg-type]  # kopf types handlers with every kwarg; ours take what they use
    async def deployment_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
        memo.fleet.wake(namespace, name)

    @kopf.on.event("", "v1", "pods", id="pod-changed", labels={LABEL_DEPLOYMENT: kopf.PRESENT}, registry=registry)  # type: ignore[arg-type]  # kopf types handlers with every kwarg; ours take what they use
    async def pod_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
        memo.fleet.wake(namespace, labels[LABEL_DEPLOYMENT])

    register_autoscaling(registry, operator_settings, credentials)  # after startup above: it hooks into memo.fleet
    return registry
