"""Test support: watch worker pods while they drain and record how often each one restarted before it went.

Why it exists: a drained worker must stay up and idle until its pod is deleted; a worker that exits after
draining is restarted by the kubelet (restartPolicy Always) and the pod is then deleted "because the worker no
longer answers". The only trace of that is the pod's `status.containerStatuses[].restartCount` while it still
exists, so the operator and end-to-end tests (scale-down, rollout, rollback) watch the pods of a namespace over
the API (one watch in a thread, resumed from the last resourceVersion) and assert that every pod that was marked
draining kept restartCount 0 to the end. Nothing here runs in the operator; it imports only the kubernetes client.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from crds.pods import DRAINING, LABEL_DEPLOYMENT, marked

WATCH_SECONDS = 2  # one watch request lasts this long, so a stop is noticed within it


def restarts_of(pod: Mapping[str, Any]) -> int:
    """The pod's container restarts, summed over its containers."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount") or 0) for s in statuses)


class DrainedPodRestarts:
    """Within `with`: every version of every worker pod in `namespace` (of `deployment` when given) is seen;
    `drained()` gives, per pod marked draining at some point, the most restarts any version showed."""

    def __init__(
        self, kubeconfig: Path | str, namespace: str, deployment: str | None = None, max_seconds: float = 1800.0
    ) -> None:
        from kubernetes import client, config

        self.namespace = namespace
        self.selector = f"{LABEL_DEPLOYMENT}={deployment}" if deployment else LABEL_DEPLOYMENT
        self.max_seconds = max_seconds
        self._api = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._restarts: dict[str, int] = {}  # uid -> most restarts seen
        self._names: dict[str, str] = {}  # uid -> pod name
        self._draining: set[str] = set()  # uids seen marked draining
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="drained-pod-restarts", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(WATCH_SECONDS + 30)

    def seen(self, pod: Mapping[str, Any]) -> None:
        """Record one version of a pod (the watch calls it; tests of this module may too)."""
        meta = pod.get("metadata") or {}
        uid = meta.get("uid") or meta.get("name") or ""
        with self._lock:
            self._names[uid] = meta.get("name") or uid
            self._restarts[uid] = max(self._restarts.get(uid, 0), restarts_of(pod))
            if marked((meta.get("labels") or {}).get(DRAINING)):
                self._draining.add(uid)

    def drained(self) -> dict[str, int]:
        """Pod name -> most restarts seen, for every pod seen marked draining. Raises if the watch failed."""
        if self._error is not None:
            raise AssertionError(f"the pod watch failed: {self._error!r}")
        with self._lock:
            return {self._names[uid]: self._restarts[uid] for uid in sorted(self._draining)}

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        version: str | None = None
        failures = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                if version is None:
                    listed = self._api.api_client.sanitize_for_serialization(
                        self._api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                    )
                    for pod in listed.get("items") or []:
                        self.seen(pod)
                    version = (listed.get("metadata") or {}).get("resourceVersion")
                response = self._api.list_namespaced_pod(
                    self.namespace,
                    label_selector=self.selector,
                    watch=True,
                    resource_version=version,
                    timeout_seconds=WATCH_SECONDS,
                    _preload_content=False,
                    _request_timeout=WATCH_SECONDS + 10,
                )
                version = self._events(response, version)
                failures = 0
            except Exception as error:  # noqa: BLE001 - retried a few times, then reported by drained()
                failures += 1
                version = None  # list again: a gap in the watch must not hide a restart
                if failures > 10:
                    self._error = error
                    return
                self._stop.wait(0.2)

    def _events(self, response: Any, version: str | None) -> str | None:
        """Read one watch response (urllib3 yields it line by line); the resourceVersion to resume from."""
        try:
            for line in response:
                if not line.strip():
                    continue
                event = json.loads(line)
                pod = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return None  # e.g. 410 Gone: list again
                self.seen(pod)
                version = (pod.get("metadata") or {}).get("resourceVersion") or version
                if self._stop.is_set():
                    break
        finally:
            response.release_conn()
        return version
