"""`LocalFleet`: the whole fleet on one machine, as separate processes, for `llmfleet up` and the e2e suite.

Why it exists: the product is several programs talking over HTTP (API server, operator, gateway, workers,
Prometheus). The local fleet runs exactly those programs, each as a subprocess in its own process group, on free
loopback ports, with their logs and files in one work directory:

- localkube (`python -m localkube`): the API server and a process kubelet that runs worker pods;
- the CRD, a namespace and an API-key Secret (a generated key), applied through the API;
- Prometheus (Debian `prometheus`, when on PATH) scraping the worker pods through a file_sd list that a thread
  keeps equal to the Ready pods (`scrape_sync`); without Prometheus the operator scrapes pods directly;
- the operator (`llmfleet operator`, told the Prometheus URL; `LLMFLEET_OPERATOR_WORKER_CACHE_DIR=""` so pods
  share the host's model cache), with a kopf liveness endpoint that tells when it is up;
- the gateway (`llmfleet gateway`, Kubernetes mode, keys from the Secret).

    with LocalFleet(FleetSettings(work_dir=tmp)) as fleet:
        fleet.apply_file("examples/smollm2-cpu.yaml")
        print(fleet.gateway_url, fleet.api_key, fleet.kubeconfig)

`stop()` (also on exceptions) stops everything in reverse order; localkube stops the pod processes it started.
"""

from __future__ import annotations

import fcntl
import importlib.resources
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmfleet.kube import Kube, load_manifests
from llmfleet.processes import ManagedProcess, ProcessError, free_port, free_ports
from llmfleet.scrape_sync import ScrapeTargetSync

KEYS_SECRET = "llmfleet-api-keys"
# What a fresh start removes from a reused work dir (never anything else: the user may point it anywhere).
_STATE_ENTRIES = (
    "kubeconfig",
    "localkube",
    "prometheus-data",
    "prometheus.yml",
    "file_sd.json",
    "api-key",
    "gateway.yaml",
    "kubecache",
)


class FleetSettings(BaseModel):
    """How the local fleet runs. Defaults suit `llmfleet up`; the e2e suite shortens the timers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    work_dir: Path | None = Field(
        None, description="Folder for logs, kubeconfig and state; unset = a temporary folder removed at stop."
    )
    namespace: str = Field(
        "default",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Namespace of the API-key Secret and of deployments applied without one.",
    )
    prometheus: bool = Field(True, description="Run Prometheus when the `prometheus` binary is on PATH.")
    scrape_interval_s: float = Field(2.0, gt=0, le=60, description="Prometheus scrape and file_sd refresh period.")
    operator_resync_s: float = Field(10.0, gt=0, le=600, description="The operator's resync period.")
    operator_env: dict[str, str] = Field(
        default_factory=dict, description="Extra LLMFLEET_OPERATOR_* variables (e.g. WORKER_EXTRA_ARGS)."
    )
    gateway_settings: dict[str, Any] = Field(
        default_factory=dict, description="gateway.settings.GatewaySettings fields (timeouts, tiers, ...)."
    )
    restart_backoff: tuple[float, float] = Field((1.0, 10.0), description="Pods' crash-loop back-off: base, cap (s).")
    start_timeout_s: float = Field(120.0, gt=0, description="Longest wait for each process to come up.")
    log_level: str = Field(
        "info",
        pattern="^(debug|info|warning|error)$",
        description="Log level of the operator and gateway (their logs are files).",
    )

    @field_validator("operator_env")
    @classmethod
    def _operator_prefix(cls, env: dict[str, str]) -> dict[str, str]:
        wrong = sorted(k for k in env if not k.startswith("LLMFLEET_OPERATOR_"))
        if wrong:
            raise ValueError(f"operator_env takes LLMFLEET_OPERATOR_* variables only; got {', '.join(wrong)}")
        return env


def _python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def llmfleet_argv(*args: str) -> list[str]:
    """Run `llmfleet ARGS` with this interpreter (works without the console script on PATH)."""
    return _python_module("llmfleet.cli", *args)


def generate_api_key() -> str:
    return "sk-llmfleet-" + secrets.token_urlsafe(24)


def crd_manifest_path() -> Path:
    return Path(str(importlib.resources.files("crds") / "inferencedeployment.yaml"))


class LocalFleet:
    """localkube + Prometheus + operator + gateway as subprocesses; see the module docstring."""

    def __init__(self, settings: FleetSettings | None = None, report: Callable[[str], None] | None = None) -> None:
        self.settings = settings or FleetSettings()
        self._report = report or (lambda _line: None)
        given = self.settings.work_dir
        self._own_work_dir = given is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="llmfleet-local-")) if given is None else given.resolve()
        self.kubeconfig = self.work_dir / "kubeconfig"
        self.logs = self.work_dir / "logs"
        self.api_key = generate_api_key()
        self.localkube: ManagedProcess | None = None
        self.prometheus: ManagedProcess | None = None
        self.operator: ManagedProcess | None = None
        self.gateway: ManagedProcess | None = None
        self.scrape_sync: ScrapeTargetSync | None = None
        self.kube: Kube | None = None
        self.api_url = ""
        self.prometheus_url: str | None = None
        self.gateway_url = ""
        self.operator_health_url = ""
        self.operator_metrics_url = ""  # the operator's /metrics, on its own internal port
        self.gateway_metrics_url = ""  # the gateway's /metrics, on its own internal port
        self._lock_file: Any = None
        self._gateway_port = 0  # chosen at start: the operator asks the gateway for its queue
        self._gateway_metrics_port = 0  # chosen at start: Prometheus scrapes the gateway's internal metrics port
        self._operator_env: dict[str, str] = {}

    # ----------------------------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> LocalFleet:
        try:
            self._gateway_port, self._gateway_metrics_port = free_ports(2)
            self.gateway_metrics_url = f"http://127.0.0.1:{self._gateway_metrics_port}/metrics"
            self._prepare_work_dir()
            self._start_localkube()
            self._install_basics()
            self._start_prometheus()
            self._start_operator()
            self._start_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop everything this fleet started, newest first (idempotent)."""
        for name in ("gateway", "operator"):
            proc: ManagedProcess | None = getattr(self, name)
            if proc is not None:
                proc.stop()
        if self.scrape_sync is not None:
            self.scrape_sync.stop()
            self.scrape_sync = None
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.kube is not None:
            self.kube.close()
            self.kube = None
        if self.localkube is not None:
            self.localkube.stop()  # SIGTERM: localkube stops every pod process it started
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def processes(self) -> list[ManagedProcess]:
        return [p for p in (self.localkube, self.prometheus, self.operator, self.gateway) if p is not None]

    def urls(self) -> dict[str, str]:
        """What a user connects to: the API server, the gateway, Prometheus (when running)."""
        urls = {"api server": self.api_url, "gateway": self.gateway_url}
        if self.prometheus_url:
            urls["prometheus"] = self.prometheus_url
        return urls

    # ------------------------------------------------------------------------------------------------ steps

    def _prepare_work_dir(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.work_dir / ".lock", "w")  # noqa: SIM115 - held until stop()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise ProcessError(
                f"another local fleet is running in {self.work_dir}: stop it, or use another work dir (--work-dir)"
            ) from None
        for entry in _STATE_ENTRIES:
            path = self.work_dir / entry
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        self.logs.mkdir(exist_ok=True)

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMFLEET_OPERATOR_")}
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["KUBECACHEDIR"] = str(self.work_dir / "kubecache")
        env.update(extra or {})
        return env

    def _start_localkube(self) -> None:
        base, cap = self.settings.restart_backoff
        self.localkube = ManagedProcess(
            "localkube",
            _python_module(
                "localkube",
                "--port",
                "0",
                "--kubeconfig",
                str(self.kubeconfig),
                "--workdir",
                str(self.work_dir / "localkube"),
                "--restart-backoff",
                f"{base:g},{cap:g}",
            ),
            self.logs / "localkube.log",
            self._env(),
            stop_timeout_s=60,
        ).start()
        self.localkube.wait_until(self.kubeconfig.is_file, "kubeconfig", self.settings.start_timeout_s)
        self.kube = Kube(self.kubeconfig)
        self.api_url = self.kube.url
        self.localkube.wait_http(f"{self.api_url}/readyz", self.settings.start_timeout_s, "API server")
        self._report(f"localkube API server at {self.api_url}")

    def _install_basics(self) -> None:
        assert self.kube is not None and self.localkube is not None
        self.kube.apply_all(load_manifests(crd_manifest_path()))

        kube = self.kube

        def established() -> bool:
            crd = kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", "inferencedeployments.llmfleet.io")
            conditions = ((crd or {}).get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

        self.localkube.wait_until(established, "the CRD established", 30)
        self.ensure_namespace(self.settings.namespace)
        self.kube.apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {
                    "name": KEYS_SECRET,
                    "namespace": self.settings.namespace,
                    "labels": {"app.kubernetes.io/part-of": "llmfleet"},
                },
                "stringData": {"api-keys": f"{self.api_key}\n"},
            }
        )
        key_file = self.work_dir / "api-key"
        key_file.write_text(self.api_key + "\n")
        key_file.chmod(0o600)
        self._report(f"CRD installed; API key in Secret {self.settings.namespace}/{KEYS_SECRET}")

    def ensure_namespace(self, namespace: str) -> None:
        assert self.kube is not None
        if self.kube.get("v1", "Namespace", namespace) is None:
            self.kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})

    def _start_prometheus(self) -> None:
        from fleet_operator.metrics_source import local_prometheus_config

        binary = shutil.which("prometheus")
        if not self.settings.prometheus or binary is None:
            why = "disabled" if not self.settings.prometheus else "`prometheus` is not on PATH"
            self._report(f"Prometheus not started ({why}): the operator scrapes the pods directly")
            return
        file_sd = self.work_dir / "file_sd.json"
        self.scrape_sync = ScrapeTargetSync(self.kubeconfig, file_sd, self.settings.scrape_interval_s).start()
        config = local_prometheus_config(file_sd, scrape_interval_s=self.settings.scrape_interval_s)
        interval = f"{self.settings.scrape_interval_s:g}s"
        config["scrape_configs"].append(
            {
                "job_name": "llmfleet-gateway",
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "static_configs": [{"targets": [f"127.0.0.1:{self._gateway_metrics_port}"]}],
            }
        )
        config_path = self.work_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        port = free_port()
        self.prometheus = ManagedProcess(
            "prometheus",
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.work_dir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1d",
                "--log.level=warn",
            ],
            self.logs / "prometheus.log",
            self._env(),
        ).start()
        self.prometheus_url = f"http://127.0.0.1:{port}"
        self.prometheus.wait_http(f"{self.prometheus_url}/-/ready", self.settings.start_timeout_s, "readiness")
        self._report(f"Prometheus at {self.prometheus_url} (scraping worker pods every {interval})")

    def _start_operator(self) -> None:
        port, metrics_port, alerts_port = free_ports(3)
        self.operator_health_url = f"http://127.0.0.1:{port}/healthz"
        self.operator_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        env = {
            "LLMFLEET_OPERATOR_HTTP_PORT": str(alerts_port),  # /alerts (no token here: off)
            "LLMFLEET_OPERATOR_METRICS_PORT": str(metrics_port),
            "LLMFLEET_OPERATOR_WORKER_CACHE_DIR": "",  # pods keep the host's HOME and model cache
            "LLMFLEET_OPERATOR_RESYNC_SECONDS": f"{self.settings.operator_resync_s:g}",
            "LLMFLEET_OPERATOR_DELETION_RETRY_SECONDS": "1",
            "LLMFLEET_OPERATOR_LIVENESS_ENDPOINT": self.operator_health_url,
            "LLMFLEET_OPERATOR_LOG_LEVEL": self.settings.log_level,
            # One gateway here, so its own count of requests held at zero is exact and has no scrape lag.
            "LLMFLEET_OPERATOR_GATEWAY_URL": f"http://127.0.0.1:{self._gateway_port}",
            "LLMFLEET_OPERATOR_GATEWAY_API_KEY": self.api_key,
            "LLMFLEET_OPERATOR_DRAIN_KEY_FILE": str(self._drain_key_file()),
        }
        if self.prometheus_url:
            env["LLMFLEET_OPERATOR_PROMETHEUS_URL"] = self.prometheus_url
        env.update(self.settings.operator_env)
        self._operator_env = env
        self.operator = ManagedProcess(
            "operator", llmfleet_argv("operator"), self.logs / "operator.log", self._env(env)
        )
        self._launch_operator()
        self._report(f"operator running (pid {self.operator.pid}, its metrics at {self.operator_metrics_url})")

    def _drain_key_file(self) -> Path:
        """The operator's drain-token key (owner-only file in the work dir, kept across operator restarts, as the
        chart's Secret is in a cluster)."""
        path = self.work_dir / "operator-drain.key"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as key:
                key.write(secrets.token_urlsafe(32))
        return path

    def _launch_operator(self) -> None:
        assert self.operator is not None
        self.operator.start()
        self.operator.wait_http(self.operator_health_url, self.settings.start_timeout_s, "kopf liveness")

    def restart_operator(self, crash: bool = True) -> None:
        """Stop the operator (SIGKILL when `crash`, like a lost pod; else SIGTERM) and start it again."""
        assert self.operator is not None
        if crash:
            self.operator.kill()
        else:
            self.operator.stop()
        self._launch_operator()

    def _start_gateway(self) -> None:
        port = self._gateway_port
        config_path = self.work_dir / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(dict(self.settings.gateway_settings)))
        self.gateway = ManagedProcess(
            "gateway",
            llmfleet_argv(
                "gateway",
                "--port",
                str(port),
                "--kubeconfig",
                str(self.kubeconfig),
                "--api-keys-secret",
                f"{self.settings.namespace}/{KEYS_SECRET}",
                "--metrics-port",
                str(self._gateway_metrics_port),
                "--config",
                str(config_path),
                "--log-level",
                self.settings.log_level,
            ),
            self.logs / "gateway.log",
            self._env(),
        ).start()
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.gateway.wait_http(f"{self.gateway_url}/ready", self.settings.start_timeout_s, "readiness")
        self._report(f"gateway at {self.gateway_url} (its metrics at {self.gateway_metrics_url})")

    # ---------------------------------------------------------------------------------------------- helpers

    def apply_file(self, path: Path | str, namespace: str | None = None) -> list[dict[str, Any]]:
        assert self.kube is not None
        return self.kube.apply_all(load_manifests(path), namespace or self.settings.namespace)

    def apply(self, doc: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        assert self.kube is not None
        return self.kube.apply(doc, namespace or self.settings.namespace)

    def check_running(self) -> None:
        """Raise ProcessError naming the first part that has exited."""
        for proc in self.processes():
            if not proc.running():
                raise ProcessError(f"{proc.name} exited; log {proc.log_path}:\n{proc.log_tail()}")
