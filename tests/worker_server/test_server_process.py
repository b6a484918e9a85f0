"""`llmfleet worker` as a real process (fake engine): SIGTERM and POST /drain drain it, in-flight streams finish,
new requests get 503; SIGTERM exits 0 once drained, while a POST /drain leaves the process up and idle until a
SIGTERM (the kubelet deleting the pod) makes it exit 0; bad flags exit 2 with a message."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner
from worker.server.fake_engine import DEFAULT_SCRIPT

from llmfleet.cli import app

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def worker(spawn_worker, tmp_path: Path):
    """`worker(*flags, env=None)`: `llmfleet worker` with the fake engine, gated by a file in tmp_path."""

    def start(*args: str, env: dict[str, str] | None = None):
        gate = tmp_path / "gate"
        process = spawn_worker(
            [
                sys.executable,
                "-m",
                "llmfleet.cli",
                "worker",
                "--model",
                "fake://proc-model",
                "--engine",
                "fake",
                "--fake-gate-file",
                str(gate),
                *args,
            ],
            env=env,
        )
        process.gate = gate
        return process

    return start


# Greedy: a sampled fake answer starts at a random place in its script, and a start inside a multi-byte character
# decodes to no text, so the first event would wait behind the gate (which stays shut in these tests) for 60 s.
GATED_STREAM = {"prompt": "hi", "max_tokens": 25, "stream": True, "temperature": 0}


def _first_data_line(lines: Iterator[str]) -> dict:
    line = next(line for line in lines if line.startswith("data: "))
    return json.loads(line.removeprefix("data: "))


def test_sigterm_drains_and_exits_0(worker, wait) -> None:
    w = worker()
    http = httpx.Client(base_url=w.base_url, timeout=30)
    wait(lambda: http.get("/ready").status_code == 200, "readiness")
    body = {"prompt": "hi", "max_tokens": 25, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert _first_data_line(lines)["choices"][0]["text"] == "T"
        w.proc.send_signal(signal.SIGTERM)
        wait(lambda: http.get("/ready").status_code == 503, "readiness to fail")
        refused = http.post("/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert http.get("/drain").json() | {"seconds_left": None} == {
            "state": "draining",
            "draining": True,
            "reason": "SIGTERM",
            "inflight": 1,
            "remaining_tokens_estimate": 24,
            "seconds_left": None,
            "timed_out": False,
        }
        w.gate.touch()
        payloads = [
            json.loads(line.removeprefix("data: "))
            for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert "T" + "".join(p["choices"][0]["text"] for p in payloads) == DEFAULT_SCRIPT[:25]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert w.wait_exit() == 0


def test_post_drain_with_token_and_timeout(worker, wait, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-123\n")
    w = worker("--drain-timeout", "0.3", "--drain-token-file", str(token_file))
    http = httpx.Client(base_url=w.base_url, timeout=30)
    wait(lambda: http.get("/ready").status_code == 200, "readiness")
    with http.stream("POST", "/v1/completions", json=GATED_STREAM) as s:
        lines = s.iter_lines()
        _first_data_line(lines)
        assert http.post("/drain", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert http.post("/drain", headers={"Authorization": "Bearer tok-123"}).status_code == 202
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]  # gate stays shut
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "aborted"
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
    wait(lambda: http.get("/drain").json()["state"] == "drained", "the drain to finish")
    assert w.proc.poll() is None and http.get("/drain").json()["timed_out"]
    w.proc.send_signal(signal.SIGTERM)
    assert w.wait_exit(timeout_s=10) == 0


def test_post_drain_stays_up_until_sigterm(worker, wait, tmp_path: Path) -> None:
    """The kubelet restarts a worker that exits (`restartPolicy: Always`): a drained worker waits for its pod's
    deletion, idle, not ready and alive, and SIGTERM then ends it at once."""
    w = worker(env={"LLMFLEET_DRAIN_TOKEN": "tok-456"})
    http = httpx.Client(base_url=w.base_url, timeout=30)
    wait(lambda: http.get("/ready").status_code == 200, "readiness")
    assert http.post("/drain", headers={"Authorization": "Bearer tok-456"}).status_code == 202
    wait(lambda: http.get("/drain").json()["state"] == "drained", "the drain to finish")
    for _ in range(5):  # answers for a while (an exiting worker stops within uvicorn's 0.1 s tick)
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 503
        assert http.get("/drain").json()["inflight"] == 0
        time.sleep(0.1)
    assert w.proc.poll() is None, "the drained worker exited before its pod was deleted"
    w.proc.send_signal(signal.SIGTERM)
    assert w.wait_exit(timeout_s=10) == 0


def test_second_sigterm_aborts_and_exits_0(worker, wait) -> None:
    w = worker("--drain-timeout", "600")
    http = httpx.Client(base_url=w.base_url, timeout=30)
    wait(lambda: http.get("/ready").status_code == 200, "readiness")
    with http.stream("POST", "/v1/completions", json=GATED_STREAM) as s:
        lines = s.iter_lines()
        _first_data_line(lines)
        w.proc.send_signal(signal.SIGTERM)
        wait(lambda: http.get("/drain").json()["draining"], "the drain")
        w.proc.send_signal(signal.SIGTERM)
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
    assert w.wait_exit() == 0


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--quantization", "int3"], {}, "quantization"),
        (["--max-tokens-policy", "truncate"], {}, "max_tokens_policy"),
        (["--max-body-bytes", "100"], {}, "max_body_bytes"),
        ([], {"LLMFLEET_DRAIN_TOKEN": " "}, "LLMFLEET_DRAIN_TOKEN is set but empty"),
        ([], {"LLMFLEET_FAULT_ERROR_RATE": "2"}, "error_rate"),
        (["--drain-token-file", "/nonexistent/token"], {}, "cannot read --drain-token-file"),
    ],
)
def test_bad_configuration_exits_2(args, env, message) -> None:
    """In-process (the same command function the process runs): it stops before any server starts."""
    result = CliRunner().invoke(
        app, ["worker", "--model", "fake://m", "--engine", "fake", "--host", "127.0.0.1", "--port", "0", *args], env=env
    )
    assert result.exit_code == 2 and message in result.output, result.output


def test_bad_configuration_exits_2_as_a_process() -> None:
    cmd = [
        sys.executable,
        "-m",
        "llmfleet.cli",
        "worker",
        "--model",
        "fake://m",
        "--engine",
        "fake",
        "--quantization",
        "int3",
    ]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "quantization" in result.stderr, result.stderr
