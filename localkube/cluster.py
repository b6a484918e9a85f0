"""``Cluster``: a whole localkube (API server, controllers, kubelet) in a background thread, for tests and tools.

    with Cluster(kubeconfig=tmp_path / "kubeconfig") as cluster:
        subprocess.run(["kubectl", "get", "pods"], env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})

The API server gets a free port on 127.0.0.1 and its own event loop; ``stop()`` stops every pod process it started.
"""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from localkube.options import Options
from localkube.server import LocalKube


class ClusterError(RuntimeError):
    pass


def check_loopback(host: str) -> str:
    """localkube serves on 127.0.0.0/8 only: it has no authentication."""
    try:
        if ipaddress.ip_address(host) in ipaddress.ip_network("127.0.0.0/8"):
            return host
    except ValueError:
        pass
    raise ClusterError(f"localkube binds to 127.0.0.0/8 only (it has no authentication); got host {host!r}")


class Cluster:
    def __init__(
        self,
        kubeconfig: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        state: str | Path | None = None,
        workdir: str | Path | None = None,
        kubelet: bool = True,
        node_labels: dict[str, str] | None = None,
        node_capacity: dict[str, str] | None = None,
        restart_backoff: tuple[float, float] = (1.0, 60.0),
        pod_subnet: str | None = None,
        event_log_size: int = 20_000,
        start_timeout: float = 30.0,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="localkube-"))
        self.kubeconfig = Path(kubeconfig) if kubeconfig is not None else self.workdir / "kubeconfig"
        self.options = Options(
            host=check_loopback(host),
            port=port,
            state_file=Path(state) if state else None,
            workdir=self.workdir,
            kubelet=kubelet,
            node_labels=dict(node_labels or {}),
            node_capacity=dict(node_capacity or {}),
            restart_backoff=restart_backoff,
            pod_subnet=pod_subnet,
            kubeconfig=self.kubeconfig,
            event_log_size=event_log_size,
        )
        self._start_timeout = start_timeout
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.kube: LocalKube | None = None

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> Cluster:
        if self._thread is not None:
            raise ClusterError("this cluster is already started")
        self._thread = threading.Thread(target=self._thread_main, name="localkube", daemon=True)
        self._thread.start()
        if not self._ready.wait(self._start_timeout):
            raise ClusterError(f"localkube did not start within {self._start_timeout} s")
        if self._error is not None:
            raise ClusterError(f"localkube failed to start: {self._error!r}") from self._error
        return self

    def stop(self, timeout: float = 60.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop_event is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_event.set)
        self._thread.join(timeout)
        self._thread = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *_exc_info) -> None:
        self.stop()

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        kube = LocalKube(self.options)
        try:
            await kube.start()
        except BaseException as exc:  # noqa: BLE001 - reported to start() in the calling thread
            self._error = exc
            self._ready.set()
            await kube.stop()
            return
        self.kube = kube
        self._ready.set()
        await self._stop_event.wait()
        await kube.stop()

    # -------------------------------------------------------------------------------------------- accessors

    @property
    def url(self) -> str:
        if self.kube is None:
            raise ClusterError("the cluster is not running")
        return self.kube.url

    @property
    def port(self) -> int:
        return self.kube.port if self.kube is not None else 0

    def env(self) -> dict[str, str]:
        """Environment variables that point clients at this cluster."""
        return {"KUBECONFIG": str(self.kubeconfig)}

    def call(self, fn: Callable[[LocalKube], Any], timeout: float = 30.0) -> Any:
        """Run ``fn(kube)`` on the cluster's event loop thread (where the store may be touched) and return its result."""
        kube = self.kube
        if self._loop is None or kube is None:
            raise ClusterError("the cluster is not running")
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(kube))
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread, which re-raises it
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result(timeout)
