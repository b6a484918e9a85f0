"""The operator's LoRA adapter calls against a scripted worker: what `GET /v1/models` becomes (`AdapterProbe`),
loads and unloads with the drain token, refusals kept for the next pass, and two whole passes (plan -> execute ->
observe -> plan) that take a pod from Loading to Loaded for a good adapter and to Failed (with one Warning Event)
for a bad one, while the base keeps serving."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from fleet_operator.adapter_client import WorkerAdapters, error_text, serves_adapters
from fleet_operator.drain_client import WorkerDrains
from fleet_operator.execute import execute
from fleet_operator.testing import DEPLOYMENT, ScriptedApi

from controllers import LoadAdapter, Observed, Policy, UnloadAdapter, reconcile
from controllers.drain_token import drain_token
from controllers.observed import AdapterResult, PodInfo, PodPhase, ProbeState
from controllers.pods import PodDefaults
from controllers.revision import variant_revision
from crds.models import InferenceDeploymentSpec

KEY = b"operator-drain-key-for-adapter-tests-0123"
TOKEN = drain_token(KEY, "ns", "m", "u")
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


@dataclass
class _State:
    """What the scripted worker serves and what it was sent."""

    adapters: dict[str, str] = field(default_factory=dict)  # name -> path
    calls: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)
    models_status: int = 200


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Worker(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = [{"id": "m", "object": "model"}]
            data += [{"id": n, "object": "model", "root": p, "parent": "m"} for n, p in sorted(state.adapters.items())]
            self._send(state.models_status, {"object": "list", "data": data})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            auth = self.headers.get("Authorization")
            state.calls.append((self.path, body, auth))
            if auth != f"Bearer {TOKEN}":
                return self._send(401, {"error": {"message": "bad token", "code": "unauthorized"}})
            name = body["lora_name"]
            if self.path == "/v1/unload_lora_adapter":
                if state.adapters.pop(name, None) is None:
                    return self._send(404, {"error": {"message": f"no adapter {name}"}})
                return self._send(200, {})
            if "bad" in body["lora_path"]:
                return self._send(400, {"error": {"message": "rank 64 is over --max-lora-rank 16"}})
            if name in state.adapters:
                return self._send(400, {"error": {"message": f"adapter {name} is already loaded"}})
            state.adapters[name] = body["lora_path"]
            return self._send(200, {})

        def _send(self, code: int, body: Any) -> None:
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            pass

    return Worker


@pytest.fixture
def worker() -> Iterator[tuple[_State, str]]:
    state = _State()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state, f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
async def client() -> Any:
    adapters = WorkerAdapters(WorkerDrains(key=KEY).token, probe_timeout_s=5, load_timeout_s=5)
    try:
        yield adapters
    finally:
        await adapters.aclose()


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    ("spec", "serves"),
    [
        ({"engine": {"lora": {}}}, True),
        ({"engine": {"lora": None}}, False),
        ({"adapters": [{"name": "a", "source": "/a"}]}, True),
        ({"adapters": []}, False),
        ({}, False),
        (None, False),
    ],
)
def test_which_specs_are_probed_for_adapters(spec, serves):
    assert serves_adapters(spec) is serves


@pytest.mark.parametrize(
    ("status", "body", "text"),
    [
        (400, {"error": {"message": "rank too large"}}, "rank too large"),
        (500, {"detail": "x"}, 'HTTP 500: {"detail":"x"}'),
        (502, "plain", 'HTTP 502: "plain"'),
    ],
)
def test_error_text_prefers_the_openai_message(status, body, text):
    assert error_text(httpx.Response(status, json=body)) == text


async def test_probe_lists_only_the_entries_with_a_parent(worker, client):
    state, address = worker
    state.adapters = {"sql": "/a/sql", "poet": "/a/poet"}
    probe = await client.probe(address)
    assert probe.state == ProbeState.ANSWERED and probe.adapters == {"sql", "poet"}


async def test_probe_failures(worker, client):
    state, address = worker
    state.models_status = 503
    assert (await client.probe(address)).state == ProbeState.FAILED
    assert (await client.probe(_closed_port())).state == ProbeState.UNREACHABLE
    assert (await client.probe(None)).state == ProbeState.UNREACHABLE


async def test_probe_all_asks_live_ready_pods_with_an_ip(worker, client):
    _, address = worker
    host, port = address.split(":")
    pods = [
        PodInfo(name="ready", ip=host, phase=PodPhase.RUNNING, ready=True),
        PodInfo(name="starting", ip=host, phase=PodPhase.RUNNING, ready=False),
        PodInfo(name="draining", ip=host, phase=PodPhase.RUNNING, ready=True, draining=True),
        PodInfo(name="no-ip", phase=PodPhase.RUNNING, ready=True),
    ]
    probes = await client.probe_all(pods, int(port))
    assert list(probes) == ["ready"]


async def test_loads_carry_the_token_and_answers_are_read_once(worker, client):
    state, address = worker
    state.adapters = {"old": "/a/old"}
    loads = [LoadAdapter("p", address, "sql", "/a/sql"), LoadAdapter("p", address, "bad", "/a/bad")]
    await client.run(("ns", "m"), DEPLOYMENT["metadata"], loads, [UnloadAdapter("p", address, "old")])
    assert state.adapters == {"sql": "/a/sql"}
    assert {auth for _, _, auth in state.calls} == {f"Bearer {TOKEN}"}
    results = sorted(client.take_results(("ns", "m")), key=lambda r: r.adapter)
    assert results == [
        AdapterResult("p", "bad", "/a/bad", "rank 64 is over --max-lora-rank 16"),
        AdapterResult("p", "sql", "/a/sql", None),
    ]
    assert client.take_results(("ns", "m")) == ()


async def test_replace_unloads_the_old_copy_first_and_a_missing_one_is_fine(worker, client):
    state, address = worker
    state.adapters = {"sql": "/a/sql-v1"}
    await client.run(("ns", "m"), DEPLOYMENT["metadata"], [LoadAdapter("p", address, "sql", "/a/sql-v2", True)], [])
    await client.run(("ns", "m"), DEPLOYMENT["metadata"], [LoadAdapter("p", address, "new", "/a/new", True)], [])
    assert state.adapters == {"sql": "/a/sql-v2", "new": "/a/new"}
    assert [r.error for r in client.take_results(("ns", "m"))] == [None, None]
    paths = [path for path, _, _ in state.calls]
    assert paths == ["/v1/unload_lora_adapter", "/v1/load_lora_adapter"] * 2


async def test_an_unreachable_worker_is_a_result_not_an_exception(client):
    await client.run(("ns", "m"), DEPLOYMENT["metadata"], [LoadAdapter("p", _closed_port(), "sql", "/a/sql")], [])
    (result,) = client.take_results(("ns", "m"))
    assert result.error is not None and "ConnectError" in result.error


def _resource(adapters: list[dict[str, Any]], status: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = {
        "model": {"name": "m", "source": "bundled://smollm2-135m-instruct"},
        "engine": {"lora": {"maxLoras": 2}},
        "adapters": adapters,
        "variants": [{"name": "default", "replicas": 1}],
    }
    return {**DEPLOYMENT, "metadata": {**DEPLOYMENT["metadata"], "generation": 1}, "spec": spec, "status": status or {}}


def _pod(resource: dict[str, Any], address: str, defaults: PodDefaults) -> PodInfo:
    spec = InferenceDeploymentSpec.model_validate(resource["spec"])
    host = address.split(":")[0]
    return PodInfo(
        name="m-default-0",
        uid="uid-0",
        variant="default",
        revision=variant_revision("m", spec, spec.variants[0], defaults),
        phase=PodPhase.RUNNING,
        ready=True,
        ip=host,
        created_at=NOW - timedelta(minutes=5),
        owner_uid="u",
    )


async def _pass(resource: dict[str, Any], address: str, client: WorkerAdapters, now: datetime) -> dict[str, Any]:
    """One operator pass for the single pod at `address`: observe adapters, plan, execute; the new resource."""
    policy = Policy(defaults=PodDefaults(port=int(address.split(":")[1])), drain_key=KEY)
    pod = _pod(resource, address, policy.defaults)
    probes = await client.probe_all([pod], int(address.split(":")[1]))
    observed = Observed(pods=(pod,), adapter_probes=probes, adapter_results=client.take_results(("ns", "m")))
    plan = reconcile(resource, observed, now, policy)
    api = ScriptedApi()
    assert await execute(api, plan, resource, None, client) == []  # type: ignore[arg-type]
    patches = [body for verb, path, body in api.calls if verb == "patch" and path.endswith("/status")]
    status = {**resource["status"], **(patches[-1]["status"] if patches else {})}
    resource = {**resource, "status": status}
    resource["events"] = api.events()
    return resource


async def test_two_passes_load_a_good_adapter_and_report_a_bad_one(worker, client):
    state, address = worker
    resource = _resource([{"name": "sql", "source": "/a/sql"}, {"name": "broken", "source": "/a/bad"}])
    first = await _pass(resource, address, client, NOW)
    assert state.adapters == {"sql": "/a/sql"}
    assert {a["name"]: a["pods"][0]["state"] for a in first["status"]["adapters"]} == {
        "sql": "Loading",
        "broken": "Loading",
    }
    second = await _pass(first, address, client, NOW + timedelta(seconds=1))
    adapters = {a["name"]: a for a in second["status"]["adapters"]}
    assert adapters["sql"]["pods"][0]["state"] == "Loaded" and adapters["sql"]["readyReplicas"] == 1
    assert adapters["broken"]["pods"][0]["state"] == "Failed"
    assert "max-lora-rank" in adapters["broken"]["pods"][0]["message"]
    (condition,) = [c for c in second["status"]["conditions"] if c["type"] == "AdaptersReady"]
    assert condition["status"] == "False" and condition["reason"] == "AdapterLoadFailed"
    warnings = [e for e in second["events"] if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["AdapterLoadFailed"] and "broken" in warnings[0]["message"]
    third = await _pass(second, address, client, NOW + timedelta(seconds=2))  # within the back-off: nothing sent
    assert not [e for e in third["events"] if e["type"] == "Warning"]
    assert sum(1 for path, body, _ in state.calls if body.get("lora_name") == "broken") == 1


async def test_an_adapter_removed_from_the_spec_is_unloaded(worker, client):
    state, address = worker
    state.adapters = {"sql": "/a/sql", "gone": "/a/gone"}
    resource = _resource([{"name": "sql", "source": "/a/sql"}])
    after = await _pass(resource, address, client, NOW)
    assert state.adapters == {"sql": "/a/sql"}
    assert [a["name"] for a in after["status"]["adapters"]] == ["sql"]
