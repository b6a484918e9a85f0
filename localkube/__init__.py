"""A local Kubernetes API stand-in plus a process kubelet, for development and tests (no real cluster runs on our machines).

``Cluster`` runs one in a background thread; ``python -m localkube`` runs one in the foreground. See README.md.
"""

from localkube.cluster import Cluster, ClusterError

__all__ = ["Cluster", "ClusterError"]
