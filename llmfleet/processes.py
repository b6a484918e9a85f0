"""Child processes of the local fleet, each in its own process group, so that stopping one stops all it started.

Why it exists: `llmfleet up` and the e2e suite start localkube, Prometheus, the operator and the gateway as
separate programs (exactly what runs in a cluster), and must leave no orphan behind on Ctrl-C, SIGTERM or a
failing test. Every child runs in a new session (its own process group): `stop()` sends SIGTERM to the group,
waits, then SIGKILLs the group. Where `setpriv` exists, children also get `PR_SET_PDEATHSIG`, so they die with
the process that started them even if it is SIGKILLed (localkube does the same for its pods).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

_SETPRIV = shutil.which("setpriv")


class ProcessError(RuntimeError):
    """A child did not start, or exited when it should run; the message carries the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the caller binds it soon after; a race is possible but rare). For
    several ports use `free_ports`: two calls in a row can return the same port."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that are free on `host` now: all are held bound until the last is found (the
    kernel may hand a port it just released out again, which once gave two operator replicas one port)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket())
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _kill_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ManagedProcess:
    """One child program in its own process group, logging to a file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        stop_timeout_s: float = 20.0,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env if env is not None else os.environ)
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> ManagedProcess:
        if self.running():
            raise ProcessError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [_SETPRIV, "--pdeathsig", "TERM", "--", *self.argv] if _SETPRIV else self.argv
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM the process group, wait up to `stop_timeout_s`, then SIGKILL it. Returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc.pid, signal.SIGKILL)  # whatever of the group is left, the leader included
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once: a crash, with no clean-up (the e2e suite restarts the operator so)."""
        if self.proc is not None:
            _kill_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            self.proc = None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def wait_until(self, check: Callable[[], bool], what: str, timeout_s: float, poll_s: float = 0.2) -> None:
        """Poll `check` until true; fail early if the process exits, or after `timeout_s`, with the log's tail."""
        deadline = time.monotonic() + timeout_s
        for _ in range(int(timeout_s / poll_s) + 2):
            if self.proc is not None and self.proc.poll() is not None:
                raise ProcessError(
                    f"{self.name} exited with code {self.proc.returncode} before {what}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if check():
                return
            if time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        raise ProcessError(f"{self.name}: no {what} within {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def wait_http(self, url: str, timeout_s: float, what: str = "answer") -> None:
        """Wait until GET `url` answers 200."""

        def ok() -> bool:
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait_until(ok, f"{what} at {url}", timeout_s)
