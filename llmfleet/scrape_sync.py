"""Keeps Prometheus' file_sd target list equal to the worker pods that are Ready, as pods come and go.

Why it exists: on localkube there is no Prometheus Operator and no Kubernetes service discovery that could reach
pod IPs, so the local fleet hands Prometheus a file_sd JSON file instead (the operator's `metrics_source` decides
which pods count and writes the file atomically). A small thread lists the pods labelled `llmfleet.io/deployment`
every few seconds and rewrites the file when the set changed.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from fleet_operator.metrics_source import scrape_targets, write_file_sd

from llmfleet.kube import Kube

log = logging.getLogger(__name__)


class ScrapeTargetSync:
    """A daemon thread that refreshes `path` from the cluster's worker pods every `interval_s` seconds."""

    def __init__(self, kubeconfig: Path, path: Path, interval_s: float = 2.0) -> None:
        self.kubeconfig = kubeconfig
        self.path = path
        self.interval_s = interval_s
        self.targets = 0  # how many pods the file lists now
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sync_once(self, kube: Kube) -> bool:
        """One refresh; True when the file changed."""
        targets = scrape_targets(kube.pods(None, namespace=None))
        self.targets = len(targets)
        return write_file_sd(self.path, targets)

    def start(self) -> ScrapeTargetSync:
        write_file_sd(self.path, [])  # Prometheus starts with an empty, valid list
        self._thread = threading.Thread(target=self._run, name="llmfleet-file-sd", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _run(self) -> None:
        with Kube(self.kubeconfig, timeout_s=10) as kube:
            while not self._stop.is_set():
                try:
                    if self.sync_once(kube):
                        log.info("Prometheus targets: %d worker pod(s)", self.targets)
                except Exception as error:  # noqa: BLE001 - the API may be briefly away: keep the last file
                    self.errors += 1
                    log.debug("cannot refresh the scrape targets: %s", error)
                self._stop.wait(self.interval_s)
