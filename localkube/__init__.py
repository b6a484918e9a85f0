"""A local Kubernetes API stand-in plus a process kubelet, for development and tests (no real cluster runs on our machines)."""
