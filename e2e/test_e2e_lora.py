"""LoRA adapters on the local fleet, end to end, with the real bundled model (SmolLM2-135M) and random PEFT adapters.

One pod of a deployment with `engine.lora` and two adapters starts; the operator loads both into it
(`status.adapters`: Loaded, `AdaptersReady` True); answers streamed through the gateway with `model: base:adapter`
differ from the base model's (the adapter is applied) and are greedy-stable. Then the CR is edited:
- a third adapter is added: the pod is not restarted or replaced (same uid, restartCount 0, one pod), and the new
  adapter answers through the gateway within seconds (the figure is printed);
- an adapter of too high a rank is added: `AdaptersReady` False with the worker's reason, a Warning Event, the
  gateway answers 503 `adapter_not_ready` for it, and the base and the other adapters keep serving;
- an adapter is removed: the worker no longer lists it, the gateway answers 404 for it.
"""

from __future__ import annotations

import time

import httpx
import pytest
from worker.model.bundled import ensure_bundled
from worker.model.testing import make_random_lora

from llmfleet.traffic import ChatError, stream_chat

MODEL = "lora"
ENGINE = {
    "type": "builtin",
    "dtype": "float32",
    "maxNumSeqs": 4,
    "maxNumBatchedTokens": 256,
    "kvCacheBytes": "24Mi",
    "lora": {"maxLoras": 2, "maxLoraRank": 8},
}
PROMPT = "Write one sentence about the sea."

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Random adapters for the bundled model: three good ones (rank 8) and one of rank 32 (over maxLoraRank)."""
    model_dir = ensure_bundled("smollm2-135m-instruct")  # the pods share the host's model cache
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for seed, (name, rank) in enumerate([("sql", 8), ("poet", 8), ("late", 8), ("huge", 32)], start=1):
        make_random_lora(root / name, model_dir, rank=rank, alpha=2.0 * rank, init_std=0.05, seed=seed)
        made[name] = str(root / name)
    return made


def _answer(fleet, model: str) -> str:
    return "".join(stream_chat(fleet.gateway_url, fleet.api_key, model, PROMPT, max_tokens=12, timeout_s=60))


def _status(fleet, model: str) -> tuple[int, dict]:
    response = httpx.post(
        f"{fleet.gateway_url}/v1/chat/completions",
        json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
        headers={"authorization": f"Bearer {fleet.api_key}"},
        timeout=60,
        trust_env=False,
    )
    return response.status_code, response.json() if response.content else {}


def _adapter_states(scene) -> dict[str, list[str]]:
    status = (scene.infd(MODEL) or {}).get("status") or {}
    return {a["name"]: [p["state"] for p in a.get("pods") or []] for a in status.get("adapters") or []}


def _condition(scene, kind: str) -> dict:
    status = (scene.infd(MODEL) or {}).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def _worker_adapters(scene) -> set[str]:
    (pod,) = scene.ready_pods(MODEL)
    port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p.get("name") == "http")
    body = httpx.get(f"http://{pod['status']['podIP']}:{port}/v1/models", timeout=10, trust_env=False).json()
    return {m["id"] for m in body["data"] if m.get("parent")}


def _pod_identity(scene) -> list[tuple[str, str, int]]:
    return sorted(
        (
            p["metadata"]["name"],
            p["metadata"]["uid"],
            sum(int(c.get("restartCount") or 0) for c in p["status"].get("containerStatuses") or []),
        )
        for p in scene.pods(MODEL)
    )


def _answers(fleet, model: str) -> str | None:
    try:
        return _answer(fleet, model)
    except ChatError:
        return None


def test_adapters_load_stream_and_change_without_restarting_pods(scene, fleet, figures, adapters) -> None:
    doc = scene.deployment(MODEL, replicas=1, engine=ENGINE)
    doc["spec"]["adapters"] = [
        {"name": "sql", "source": adapters["sql"]},
        {"name": "poet", "source": f"file://{adapters['poet']}"},
    ]
    started = time.monotonic()
    scene.apply(doc)
    scene.wait_until(lambda: scene.settled(MODEL, 1), "one ready pod", timeout_s=180)
    scene.wait_until(
        lambda: _adapter_states(scene) == {"sql": ["Loaded"], "poet": ["Loaded"]} and _adapter_states(scene),
        "both adapters Loaded in status.adapters",
        timeout_s=60,
    )
    loaded_s = time.monotonic() - started
    assert _condition(scene, "AdaptersReady").get("status") == "True"
    assert _worker_adapters(scene) == {"sql", "poet"}

    base = _answer(fleet, MODEL)
    sql = scene.wait_until(lambda: _answers(fleet, f"{MODEL}:sql"), "the gateway routes lora:sql", timeout_s=30)
    assert sql == _answer(fleet, f"{MODEL}:sql"), "greedy answers of one adapter differ"
    poet = _answer(fleet, "poet")  # the adapter's own name, as vLLM serves it
    assert len({base, sql, poet}) == 3, f"an adapter changed nothing: base={base!r} sql={sql!r} poet={poet!r}"
    pods_before = _pod_identity(scene)

    # a third adapter, by editing the CR: loaded into the running pod, no restart
    added_at = time.monotonic()
    scene.patch(MODEL, {"spec": {"adapters": [*doc["spec"]["adapters"], {"name": "late", "source": adapters["late"]}]}})
    late = scene.wait_until(lambda: _answers(fleet, f"{MODEL}:late"), "the third adapter answers", timeout_s=60)
    answered_s = time.monotonic() - added_at
    assert late not in (base, sql, poet)
    assert _pod_identity(scene) == pods_before, "adding an adapter restarted or replaced a pod"

    # a bad adapter: a condition and a Warning Event; the base and the others keep serving
    spec_adapters = [*doc["spec"]["adapters"], {"name": "late", "source": adapters["late"]}]
    scene.patch(MODEL, {"spec": {"adapters": [*spec_adapters, {"name": "huge", "source": adapters["huge"]}]}})
    failed = scene.wait_until(
        lambda: (c := _condition(scene, "AdaptersReady")).get("reason") == "AdapterLoadFailed" and c,
        "AdaptersReady False for the rank-32 adapter",
        timeout_s=60,
    )
    assert failed["status"] == "False" and "huge" in failed["message"]
    warnings = scene.wait_until(
        lambda: [e for e in scene.events(MODEL) if e["reason"] == "AdapterLoadFailed" and e["type"] == "Warning"],
        "a Warning Event for the bad adapter",
        timeout_s=30,
    )
    assert "huge" in warnings[0]["message"]
    code, body = _status(fleet, f"{MODEL}:huge")
    assert code == 503 and body["error"]["code"] == "adapter_not_ready", body
    assert _answer(fleet, MODEL) == base and _answer(fleet, f"{MODEL}:sql") == sql

    # removing an adapter unloads it; the gateway no longer knows it
    scene.patch(MODEL, {"spec": {"adapters": [a for a in spec_adapters if a["name"] != "poet"]}})
    scene.wait_until(lambda: _worker_adapters(scene) == {"sql", "late"}, "poet unloaded from the worker", timeout_s=60)
    scene.wait_until(lambda: _status(fleet, "poet")[0] == 404, "the gateway answers 404 for poet", timeout_s=30)
    assert _pod_identity(scene) == pods_before, "changing adapters restarted or replaced a pod"
    figures(
        f"2 adapters Loaded {loaded_s:.1f} s after apply; a 3rd added by editing the CR answered through the "
        f"gateway {answered_s:.1f} s later with no pod restart; a rank-32 adapter -> AdaptersReady False + Warning, "
        f"base still served; removal unloaded it"
    )
