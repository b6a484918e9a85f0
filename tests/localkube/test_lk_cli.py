"""``python -m localkube``: foreground server, kubeconfig, persistence with --state, SIGTERM stops pod processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import kubernetes

from llmfleet.processes import free_port
from localkube.testing import wait_for


def start(tmp_path: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "localkube",
            "--port",
            str(port),
            "--kubeconfig",
            str(tmp_path / "kubeconfig"),
            "--state",
            str(tmp_path / "state.json"),
            "--workdir",
            str(tmp_path / "work"),
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def client(tmp_path: Path) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(str(tmp_path / "kubeconfig")))


def pid_alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def test_foreground_server_persists_state_and_stops_pods(tmp_path):
    port = free_port()
    proc = start(tmp_path, port)
    try:
        assert "localkube: API server at" in proc.stdout.readline()
        core = client(tmp_path)
        core.create_namespaced_config_map("default", {"metadata": {"name": "kept"}, "data": {"k": "v"}})
        core.create_namespaced_pod(
            "default",
            {
                "metadata": {"name": "sleeper"},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "busybox",
                            "command": ["sh", "-c", f"echo $$$$ > {tmp_path / 'pid'}; exec sleep 300"],
                        }
                    ]
                },
            },
        )
        pid = int(
            wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip(), what="pod pid")
        )
        first_ip = core.read_namespaced_pod("sleeper", "default").status.pod_ip
        wait_for((tmp_path / "state.json").exists, what="state file")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not pid_alive(pid)  # stopping localkube stops every pod process
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (tmp_path / "pid").unlink()
    again = start(tmp_path, port)
    try:
        again.stdout.readline()
        core = client(tmp_path)
        assert core.read_namespaced_config_map("kept", "default").data == {"k": "v"}
        new_pid = int(
            wait_for(
                lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip(),
                what="the pod to run again after the restart",
            )
        )
        pod = core.read_namespaced_pod("sleeper", "default")
        assert pod.status.container_statuses[0].restart_count >= 1 and new_pid != pid
        assert pod.status.pod_ip == first_ip  # the pod subnet is kept in the state file
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(30)


def test_refuses_non_loopback_hosts(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "localkube", "--host", "0.0.0.0", "--kubeconfig", str(tmp_path / "kc")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "127.0.0.0/8" in result.stderr
