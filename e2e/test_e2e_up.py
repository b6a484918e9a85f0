"""`llmfleet up` (what `make demo` runs) end to end, with the real bundled model: apply -> Ready -> a streamed
answer through the gateway that says "Paris", the `GATEWAY_URL=`/`API_KEY=`/`KUBECONFIG=` lines work for a
client and for kubectl, a request without the key is refused, and SIGTERM stops every process it started.

It runs its own fleet (not the session's shared one): what is tested is the command itself.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from llmfleet.traffic import stream_chat

BIN = Path(sys.executable).parent


def _descendants(root: int) -> set[int]:
    """PIDs of every live process below `root` (children of children included), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {root}
    for _ in range(64):  # bounded depth
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        if not frontier:
            break
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _read_lines(proc: subprocess.Popen[str], wanted: set[str], timeout_s: float) -> dict[str, str]:
    """KEY=VALUE lines from the process' stdout until all `wanted` keys came (bounded in time and lines)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    for _ in range(1000):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or wanted <= found.keys():
            break
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            break
        if line is None:
            break
        key, sep, value = line.strip().partition("=")
        if sep and key in wanted:
            found[key] = value
    return found


def test_llmfleet_up_serves_the_bundled_model_and_stops_cleanly(tmp_path: Path, figures) -> None:
    err_path = tmp_path / "up.stderr"
    started = time.monotonic()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [str(BIN / "llmfleet"), "up", "--work-dir", str(tmp_path / "work")],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "COLUMNS": "160"},
        )
    try:
        lines = _read_lines(proc, {"GATEWAY_URL", "API_KEY", "KUBECONFIG"}, timeout_s=240)
        assert len(lines) == 3, f"llmfleet up printed {lines}; stderr:\n{err_path.read_text()[-4000:]}"
        ready_s = time.monotonic() - started
        output = err_path.read_text()
        assert "Paris" in output, output[-3000:]

        # the printed lines are enough for a client ...
        answer = "".join(
            stream_chat(
                lines["GATEWAY_URL"], lines["API_KEY"], "smollm2", "What is the capital of France?", max_tokens=24
            )
        )
        assert "Paris" in answer
        refused = httpx.post(
            f"{lines['GATEWAY_URL']}/v1/chat/completions",
            timeout=30,
            json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert refused.status_code == 401
        # ... and for kubectl
        kubectl = subprocess.run(
            [str(BIN / "kubectl"), "get", "infd", "smollm2", "-o", "jsonpath={.status.readyReplicas}"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KUBECONFIG": lines["KUBECONFIG"], "KUBECACHEDIR": str(tmp_path / "kubecache")},
        )
        assert kubectl.returncode == 0 and int(kubectl.stdout) >= 1, kubectl.stderr

        # SIGTERM stops everything it started: no process below it survives
        below = _descendants(proc.pid)
        assert len(below) >= 5  # localkube, prometheus, operator, gateway, a worker pod (at least)
        stop_started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        stop_s = time.monotonic() - stop_started
        assert code == 0, err_path.read_text()[-3000:]
        for _ in range(50):  # bounded: processes reparented to init may take a moment to go
            survivors = {pid for pid in below if _alive(pid)}
            if not survivors:
                break
            time.sleep(0.2)
        assert not survivors, f"left running: {survivors}"
        figures(
            f"llmfleet up: answer streamed and lines printed after {ready_s:.1f} s; {len(below)} processes "
            f"started; SIGTERM stopped all in {stop_s:.1f} s"
        )
    finally:
        if proc.poll() is None:  # a failed assertion: still stop the fleet cleanly
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
