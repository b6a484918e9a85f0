"""Start the operator: find the cluster, build the kopf registry, run kopf until a signal stops it."""

from __future__ import annotations

import asyncio
import logging
import threading

import kopf

from fleet_operator.handlers import build_registry
from fleet_operator.kube import load_credentials
from fleet_operator.settings import OperatorSettings


def run(settings: OperatorSettings, stop_flag: threading.Event | asyncio.Event | None = None) -> None:
    """Run the operator in this thread until SIGINT/SIGTERM (or `stop_flag`, for embedding in tests/tools)."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.log_level != "debug":  # kopf logs every handler call of every object at INFO
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    credentials = load_credentials(settings.kubeconfig, settings.context)
    registry = build_registry(settings, credentials)
    kopf.run(
        registry=registry,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        standalone=settings.peering is None,
        peering_name=settings.peering,
        priority=settings.priority,
        liveness_endpoint=settings.liveness_endpoint,
        memo=kopf.Memo(),
        stop_flag=stop_flag,
    )
