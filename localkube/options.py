"""``Options``: the settings of one localkube instance (listener, node, kubelet, persistence).

Plain data below every other part: ``LocalKube`` (server.py) is built from them, and the parts that read a
setting (the controllers, the kubelet and its pod workers) get them through the views in ``services.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

NODE_NAME = "localkube-node"


@dataclass
class Options:
    host: str = "127.0.0.1"
    port: int = 0
    state_file: Path | None = None
    workdir: Path | None = None  # pod logs and per-pod files; a temporary folder when None
    kubelet: bool = True
    node_name: str = NODE_NAME
    node_labels: dict[str, str] = field(default_factory=dict)
    node_capacity: dict[str, str] = field(default_factory=dict)  # extra resources, e.g. {"nvidia.com/gpu": "1"}
    restart_backoff: tuple[float, float] = (1.0, 60.0)
    event_log_size: int = 20_000
    event_ttl: float = 3600.0  # seconds an Event lives after its last activity
    pod_subnet: str | None = None  # loopback /24 for pod IPs; a random one inside 127.0.0.0/8 when None
    kubeconfig: Path | None = None  # written once the API server listens; also given to pods as KUBECONFIG
