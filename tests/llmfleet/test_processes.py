"""`ManagedProcess`: a child and everything it spawns go away on stop(); a child that exits early is reported with
its log instead of being waited for."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from llmfleet.processes import ManagedProcess, ProcessError, free_port, free_ports


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_stop_terminates_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild"
    script = f"sleep 300 & echo $! > {pid_file}; trap '' TERM; wait"  # the leader ignores SIGTERM
    proc = ManagedProcess("group", ["sh", "-c", script], tmp_path / "log", stop_timeout_s=1).start()
    proc.wait_until(lambda: pid_file.is_file() and pid_file.read_text().strip() != "", "the grandchild", 10)
    grandchild = int(pid_file.read_text())
    leader = proc.pid
    assert leader is not None and _alive(grandchild)
    proc.stop()
    for _ in range(50):
        if not _alive(grandchild) and not _alive(leader):
            break
        time.sleep(0.1)
    assert not _alive(grandchild) and not _alive(leader)
    assert not proc.running()


def test_wait_until_reports_an_early_exit_with_the_log(tmp_path):
    proc = ManagedProcess("broken", ["sh", "-c", "echo cannot bind >&2; exit 3"], tmp_path / "log").start()
    with pytest.raises(ProcessError, match=r"(?s)broken exited with code 3 before ready.*cannot bind"):
        proc.wait_until(lambda: False, "ready", timeout_s=10)
    proc.stop()


def test_wait_until_times_out_with_what_it_waited_for(tmp_path):
    proc = ManagedProcess("slow", ["sleep", "30"], tmp_path / "log", stop_timeout_s=2).start()
    try:
        with pytest.raises(ProcessError, match="no the port within 0 s"):
            proc.wait_until(lambda: False, "the port", timeout_s=0.3, poll_s=0.1)
    finally:
        proc.stop()


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_ports_are_distinct_and_free() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64
    for port in ports[:8]:  # each can be bound now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
