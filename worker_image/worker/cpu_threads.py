"""How many CPU threads torch uses in a worker: what the container was given, not what the node has.

Why: torch sizes its intra-op pool from the CPUs it can see, which in a container is the whole node. A worker
limited to 2 CPUs (a CFS quota) on a 64-core node would run 64 threads that the kernel throttles in turn: far
slower than 2 threads, and noisy for its neighbours. The operator sets `OMP_NUM_THREADS` from the variant's CPU
request (torch honours it by itself); without it, the worker reads the cgroup CPU limit (v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`) and uses that many threads, rounded up. With neither, torch's default
stands. `bench/cpu_threads.py` on 2 cores (SmolLM2-135M, 16 requests): 1 thread 92 tok/s, 2 threads 171 (1.86x),
so the pool should be as large as the CPU the container may really use, and no larger.

vLLM on CPU (`--engine vllm`) pins its model-runner process to CPU cores by itself (`VLLM_CPU_OMP_THREADS_BIND`,
default `auto`: the first cores the process may use, keeping one for its scheduler process). That is right for a
container with its own cpuset (the kubelet's static CPU manager), and wrong where containers share the node's
cores: every vLLM pod on the node pins to the same first core. Two vLLM pods pinned to core 0 of a 2-core machine
starved one another: a runnable model runner got 30 ms of CPU in a 59 s drain while the other pod's ran (per-process
CPU ticks sampled each second in the e2e canary test; its stream hung until the gateway's 60 s read timeout).
`vllm_cpu_env` therefore turns the pinning off (`nobind`) when the process may run on every core of the node,
and leaves vLLM's choice when the container has a cpuset of its own or the variable is set.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(read: Callable[[Path], str | None] = _read, root: Path = CGROUP_ROOT) -> float | None:
    """CPUs this container may use per the cgroup quota (e.g. 1.5); None when unlimited or unknown."""
    v2 = read(root / "cpu.max")
    if v2 is not None:
        quota_v2, _, period_v2 = v2.partition(" ")
        if quota_v2 == "max":
            return None
        try:
            return int(quota_v2) / int(period_v2 or 100_000)
        except ValueError:
            return None
    quota_s, period_s = read(root / "cpu" / "cpu.cfs_quota_us"), read(root / "cpu" / "cpu.cfs_period_us")
    try:
        quota, period = int(quota_s or ""), int(period_s or "")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_threads(env: Mapping[str, str], limit: float | None, available: int) -> int | None:
    """Threads to set, or None to leave torch's choice (OMP_NUM_THREADS given, or no limit below what is seen)."""
    if env.get("OMP_NUM_THREADS"):
        return None
    if limit is None:
        return None
    wanted = max(1, math.ceil(limit - 1e-9))
    return wanted if wanted < available else None


VLLM_CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def _allowed_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def vllm_cpu_env(env: Mapping[str, str], allowed: int, online: int, limit: float | None) -> dict[str, str]:
    """The variables to add to `env` before vLLM starts on CPU. Where the process may run on all `online` cores of
    the node (a shared cpuset, where vLLM's `auto` pins every pod to the same cores): `VLLM_CPU_OMP_THREADS_BIND=
    nobind` and, since vLLM then sets no `OMP_NUM_THREADS` itself, that per `cpu_threads` (the container's CPU
    `limit`). Nothing when the container has fewer `allowed` cores of its own or the binding is already set."""
    if env.get(VLLM_CPU_BIND_ENV) or allowed < online:
        return {}
    threads = cpu_threads(env, limit, allowed)
    return {VLLM_CPU_BIND_ENV: "nobind"} | ({"OMP_NUM_THREADS": str(threads)} if threads is not None else {})


def configure_vllm_cpu_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Apply `vllm_cpu_env` to `environ` (default: this process's environment, which vLLM's processes inherit);
    call before vLLM starts. Returns what it set."""
    env = os.environ if environ is None else environ
    allowed = _allowed_cpus()
    changes = vllm_cpu_env(env, allowed, os.cpu_count() or allowed, cgroup_cpu_limit())
    env.update(changes)
    return changes


def configure_torch_threads() -> int | None:
    """Apply `cpu_threads` to torch in this process; returns the thread count set (None: left as is)."""
    import torch

    threads = cpu_threads(os.environ, cgroup_cpu_limit(), _allowed_cpus())
    if threads is not None:
        torch.set_num_threads(threads)
    return threads
