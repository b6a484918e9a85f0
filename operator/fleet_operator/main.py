"""Start the operator: read the drain-token key, find the cluster, build the kopf registry, run kopf until a signal
stops it."""

from __future__ import annotations

import asyncio
import logging
import random
import threading

import kopf

from fleet_operator.handlers import build_registry
from fleet_operator.kube import load_credentials
from fleet_operator.settings import OperatorSettings


def run(settings: OperatorSettings, stop_flag: threading.Event | asyncio.Event | None = None) -> None:
    """Run the operator in this thread until SIGINT/SIGTERM (or `stop_flag`, for embedding in tests/tools).

    Raises SettingsError (before touching the cluster) when no drain key is configured."""
    drain_key = settings.load_drain_key()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level != "debug":  # kopf logs every handler call of every object at INFO
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if settings.insecure_ephemeral_drain_key and not (settings.drain_key_file or settings.drain_key):
        logging.getLogger(__name__).warning(
            "no drain key: using a random one for this process only (development mode); after a restart the "
            "operator cannot POST /drain to older pods. Set LLMFLEET_OPERATOR_DRAIN_KEY_FILE in production."
        )
    credentials = load_credentials(settings.kubeconfig, settings.context)
    registry = build_registry(settings, credentials, drain_key)
    kopf.run(
        registry=registry,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        standalone=settings.peering is None,
        peering_name=settings.peering,
        priority=peering_priority(settings, random.SystemRandom()),
        liveness_endpoint=settings.liveness_endpoint,
        memo=kopf.Memo(),
        stop_flag=stop_flag,
    )


def peering_priority(settings: OperatorSettings, rng: random.Random) -> int:
    """The configured priority; unset with peering, a random one, because kopf pauses every replica when it sees
    another of the same priority (replicas of one Deployment cannot be told apart otherwise); else 0."""
    if settings.priority is not None:
        return settings.priority
    return rng.randint(1, 2**31 - 1) if settings.peering else 0
