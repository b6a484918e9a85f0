"""Fixtures for the worker server tests: a live uvicorn server in a thread around a given engine, and helpers.

Tests reach the helpers through fixtures (pytest runs with --import-mode=importlib, so test modules cannot import
this file by name).
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from worker.engine.protocol import EngineClient
from worker.server.fake_engine import FakeEngine, thread_event_gate
from worker.server.serve import WorkerServer
from worker.server.settings import WorkerSettings


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 10.0, poll_s: float = 0.01) -> Any:
    """Poll `predicate` until it returns a truthy value (bounded in count and time); fail with `what`."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / poll_s) + 1):
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    pytest.fail(f"timed out waiting for {what}")


@dataclass
class Live:
    """A running worker: its URL, clients, engine and the server object (for exit code / service state)."""

    worker: WorkerServer
    engine: Any
    thread: threading.Thread
    base_url: str
    _scraper: httpx.Client | None = None

    @property
    def service(self) -> Any:
        return self.worker.service

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=30, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30)

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample's value from /metrics (None when absent)."""
        if self._scraper is None:
            self._scraper = self.http()
        text = self._scraper.get("/metrics").text
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            series, _, value = line.rpartition(" ")
            metric_name, _, label_text = series.partition("{")
            if metric_name != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                return float(value)
        return None

    def stop(self) -> None:
        if self._scraper is not None:
            self._scraper.close()
        if self.thread.is_alive():
            self.worker.server.should_exit = True
            self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "the worker thread did not stop"


class Launcher:
    """Starts live workers on 127.0.0.1 and stops them all at the end."""

    def __init__(self) -> None:
        self.started: list[Live] = []

    def __call__(
        self,
        engine: EngineClient | None = None,
        wait_loaded: bool = True,
        load_timeout_s: float = 10.0,
        max_bytes_per_token: int | None = None,
        **overrides: Any,
    ) -> Live:
        engine = engine if engine is not None else FakeEngine()
        fields: dict[str, Any] = {"model": "fake://fake-model", "engine": "fake", "host": "127.0.0.1", "port": 0}
        fields.update(overrides)
        worker = WorkerServer(
            engine,
            WorkerSettings(**fields),
            configure_logging=False,
            log_level="warning",
            max_bytes_per_token=max_bytes_per_token,
        )
        thread = threading.Thread(target=worker.run, name="worker-under-test", daemon=True)
        thread.start()
        wait_until(lambda: worker.server.started or not thread.is_alive(), "the server to start")
        assert thread.is_alive(), "the worker thread died during start-up"
        live = Live(worker, engine, thread, f"http://127.0.0.1:{worker.port}")
        self.started.append(live)
        if wait_loaded:
            wait_until(
                lambda: worker.service.loaded or worker.service.load_error,
                "the engine to load",
                timeout_s=load_timeout_s,
                poll_s=0.05,
            )
        return live

    def stop_all(self) -> None:
        for live in self.started:
            live.stop()


@pytest.fixture
def start_worker() -> Iterator[Launcher]:
    """`start_worker(engine=None, wait_loaded=True, max_bytes_per_token=None, **settings)`: a live worker for this
    test (a FakeEngine by default)."""
    launcher = Launcher()
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def module_launcher() -> Iterator[Launcher]:
    """Like `start_worker`, for workers shared by a whole module."""
    launcher = Launcher()
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def shared_worker(module_launcher: Launcher) -> Live:
    """One live worker around a default FakeEngine for a whole module (tests that need no special settings)."""
    return module_launcher()


@pytest.fixture
def gated() -> Callable[..., tuple[FakeEngine, threading.Event]]:
    """`gated(**fake_engine_kwargs)`: a fake engine whose requests pause after their first token until the
    returned event is set (so a test controls exactly when an in-flight stream may finish)."""

    def make(**kwargs: Any) -> tuple[FakeEngine, threading.Event]:
        event = threading.Event()
        return FakeEngine(gate=thread_event_gate(event), **kwargs), event

    return make


@pytest.fixture
def wait() -> Callable[..., Any]:
    return wait_until


def open_raw_request(base_url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a POST over a plain socket (so a test can drop the connection mid-request) and return the socket."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


@pytest.fixture
def raw_request() -> Iterator[Callable[[str, str, dict[str, Any]], socket.socket]]:
    opened: list[socket.socket] = []

    def open_(base_url: str, path: str, body: dict[str, Any]) -> socket.socket:
        sock = open_raw_request(base_url, path, body)
        opened.append(sock)
        return sock

    yield open_
    for sock in opened:
        sock.close()


class WorkerProcess:
    """A worker subprocess on a random 127.0.0.x address; stderr is pumped in a thread (so it never blocks) and
    the bound port is read from uvicorn's start-up line."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, start_timeout_s: float = 60.0) -> None:
        self.host = f"127.0.0.{random.randint(2, 250)}"
        self.proc = subprocess.Popen(
            [*argv, "--host", self.host, "--port", "0"],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.base_url = f"http://{self.host}:{self._port(start_timeout_s)}"

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)

    def _port(self, timeout_s: float) -> int:
        pattern = re.compile(rf"running on http://{re.escape(self.host)}:(\d+)")
        deadline = time.monotonic() + timeout_s
        for _ in range(10_000):
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.log.append(line)
            match = pattern.search(line)
            if match:
                return int(match.group(1))
        self.proc.kill()
        pytest.fail("the worker did not start:\n" + "".join(self.log))

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def spawn_worker() -> Iterator[Callable[..., WorkerProcess]]:
    """`spawn_worker(argv, env=None)`: start `argv` (a worker command without --host/--port) as a process."""
    started: list[WorkerProcess] = []

    def spawn(argv: list[str], env: dict[str, str] | None = None, start_timeout_s: float = 60.0) -> WorkerProcess:
        process = WorkerProcess(argv, env, start_timeout_s)
        started.append(process)
        return process

    yield spawn
    for process in started:
        process.kill()
