"""CPU threads of a worker: the container's CPU limit (cgroup v2/v1) or OMP_NUM_THREADS, never the node's cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from worker.cpu_threads import cgroup_cpu_limit, configure_vllm_cpu_env, cpu_threads, vllm_cpu_env


def reader(files: dict[str, str]):
    return lambda path: files.get(str(path.relative_to("/cg")))


@pytest.mark.parametrize(
    "files,expected",
    [
        ({"cpu.max": "200000 100000"}, 2.0),
        ({"cpu.max": "150000 100000"}, 1.5),
        ({"cpu.max": "50000"}, 0.5),  # period defaults to 100 ms
        ({"cpu.max": "max 100000"}, None),
        ({"cpu.max": "garbage here"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, 3.0),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({}, None),
    ],
    ids=["v2 2 cpus", "v2 1.5", "v2 no period", "v2 unlimited", "v2 garbage", "v1 3 cpus", "v1 unlimited", "none"],
)
def test_cgroup_cpu_limit(files: dict[str, str], expected: float | None) -> None:
    assert cgroup_cpu_limit(reader(files), Path("/cg")) == expected


@pytest.mark.parametrize(
    "env,limit,available,expected",
    [
        ({}, 2.0, 64, 2),
        ({}, 1.5, 64, 2),  # rounded up: the quota allows 1.5 cores of work per period
        ({}, 0.25, 64, 1),
        ({}, 8.0, 4, None),  # a limit above what the process can see changes nothing
        ({}, 4.0, 4, None),
        ({}, None, 64, None),
        ({"OMP_NUM_THREADS": "3"}, 2.0, 64, None),  # the operator's (or the user's) setting wins; torch reads it
    ],
)
def test_cpu_threads(env: dict[str, str], limit: float | None, available: int, expected: int | None) -> None:
    assert cpu_threads(env, limit, available) == expected


@pytest.mark.parametrize(
    "env,allowed,online,limit,expected",
    [
        # every core of the node: vLLM's `auto` would pin each pod to the same first core
        ({}, 2, 2, None, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
        ({}, 64, 64, 4.0, {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "4"}),
        ({"OMP_NUM_THREADS": "3"}, 64, 64, 4.0, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}),  # the operator's count
        # a cpuset of its own (static CPU manager): vLLM pins within it, as it chooses
        ({}, 4, 64, 4.0, {}),
        # the user's (or the chart's) binding stands
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, 64, 64, None, {}),
        ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, 2, 2, None, {}),
    ],
    ids=["shared 2 cores", "shared, limit 4", "shared, OMP set", "own cpuset", "user list", "user auto"],
)
def test_vllm_cpu_env(
    env: dict[str, str], allowed: int, online: int, limit: float | None, expected: dict[str, str]
) -> None:
    assert vllm_cpu_env(env, allowed, online, limit) == expected


def test_configure_vllm_cpu_env_sets_what_it_decides() -> None:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "auto", "PATH": "/bin"}
    assert configure_vllm_cpu_env(env) == {} and env == {"VLLM_CPU_OMP_THREADS_BIND": "auto", "PATH": "/bin"}
    env = {"PATH": "/bin"}
    changed = configure_vllm_cpu_env(env)
    assert env == {"PATH": "/bin", **changed}
    # this machine's own cpuset decides; either way what is set is what vllm_cpu_env says
    allowed = len(os.sched_getaffinity(0))
    assert changed == vllm_cpu_env({"PATH": "/bin"}, allowed, os.cpu_count() or allowed, cgroup_cpu_limit())
