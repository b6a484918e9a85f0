"""The gateway in front of the real worker server (around its fake engine): a client disconnect frees the engine's
request and KV cache, a draining worker's 503 sends requests to another worker, `MODEL:VARIANT` and the LoRA
adapter names reach the worker in a form it serves, and a pod that lacks an adapter the status says it has is
retried elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from gateway.routing import AdapterRoute, DeploymentRoute, Endpoint, RevisionRoute, RoutingTable, VariantRoute
from gateway.sources import StaticSource
from gateway.testing import FixedSource, StaticBackend, chat, eventually, run_gateway

fake_engine = pytest.importorskip("worker.server.fake_engine")
serve = pytest.importorskip("worker.server.serve")
worker_settings = pytest.importorskip("worker.server.settings")


@contextlib.asynccontextmanager
async def workers(n: int, make: Callable[..., Any] | None = None, **engine_kw: object) -> AsyncIterator[list]:
    """n live workers on 127.0.0.1 in this event loop (engines from `make(i)`, default fake engines); yields
    (server, engine, url) triples."""
    started = []
    try:
        for i in range(n):
            engine = make(i) if make is not None else fake_engine.FakeEngine(**engine_kw)
            settings = worker_settings.WorkerSettings(
                model="fake://fake-model", engine="fake", host="127.0.0.1", port=0
            )
            server = serve.WorkerServer(engine, settings, configure_logging=False, log_level="warning")
            task = asyncio.create_task(server.serve())
            started.append((server, engine, task))
            await eventually(lambda s=server, t=task: s.server.started or t.done(), "the worker started")
            await eventually(lambda s=server: s.service.loaded, "the engine loaded")
        yield [(s, e, f"http://127.0.0.1:{s.port}") for s, e, _ in started]
    finally:
        for server, _, _task in started:
            server.server.should_exit = True
        await asyncio.gather(*(t for _, _, t in started), return_exceptions=True)


async def test_client_disconnect_frees_the_workers_request_and_kv_cache() -> None:
    async with workers(1, itl_s=0.02) as [(server, engine, url)]:
        source = StaticSource([StaticBackend("fake-model", "default", (url,))])
        async with run_gateway(source, open_mode=True) as gw, gw.client() as c:
            body = chat(model="fake-model", stream=True, max_tokens=1000)
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for chunk in r.aiter_raw():
                    seen += chunk.count(b"data:")
                    if seen >= 3:
                        break
                assert engine.stats().num_running == 1 and engine.stats().kv_cache_usage > 0
            await eventually(lambda: len(set(engine.aborted)) == 1, "the engine aborted the request")
            await eventually(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0, "KV freed")
            assert len(server.service.inflight) == 0
            assert gw.state.outstanding == {}


async def test_a_draining_workers_503_is_retried_on_another_worker() -> None:
    async with workers(2) as [(draining, d_engine, d_url), (_, engine, url)]:
        # named, not by URL (a port changes from run to run): prefix affinity's order is then fixed, and some of the
        # six prompts below try the draining pod first (the retries counter says so)
        eps = tuple(
            Endpoint(url=u, name=f"pod-{i}", variant="default", revision="r") for i, u in enumerate((d_url, url))
        )
        table = RoutingTable(
            {
                "fake-model": DeploymentRoute(
                    "fake-model",
                    "fake-model",
                    variants=(VariantRoute("default", 1, revisions=(RevisionRoute("r", 1, eps),)),),
                )
            }
        )
        draining.service.begin_drain("test")  # lame duck: answers 503 + Retry-After to new requests
        async with run_gateway(FixedSource(table), open_mode=True) as gw, gw.client() as c:
            for i in range(6):
                body = chat(model="fake-model", stream=i % 2 == 0, content=f"q{i}", max_tokens=4)
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            retries = await gw.metrics_text()
    assert d_engine.submitted == [] and len(engine.submitted) == 6
    assert 'llmfleet_gateway_retries_total{model="fake-model",reason="503"}' in retries


class LoraFakeEngine(fake_engine.FakeEngine):
    """The fake engine serving LoRA adapters as the worker's `LoraEngineClient` protocol asks (registered names,
    `generate(..., lora_name)`), recording the adapter of each request."""

    lora_enabled = True

    def __init__(self, adapters: dict[str, str], **kw: Any) -> None:
        super().__init__(**kw)
        self._adapters = dict(adapters)
        self.lora_requests: list[str | None] = []

    def lora_adapters(self) -> dict[str, str]:
        return dict(self._adapters)

    async def load_lora(self, name: str, path: str) -> None:
        self._adapters[name] = path

    async def unload_lora(self, name: str) -> None:
        del self._adapters[name]

    def generate(
        self, prompt: Any, params: Any, request_id: str, priority: int = 0, lora_name: str | None = None
    ) -> AsyncIterator[Any]:
        self.lora_requests.append(lora_name)
        return super().generate(prompt, params, request_id, priority)


def lora_table(urls: list[str], adapters: dict[str, list[str]]) -> RoutingTable:
    """Both workers in variant `default` (weight 1) and in variant `cheap` (weight 0: only by suffix); `adapters`
    lists each adapter's pods by URL. The pods are named `pod-0`, `pod-1`, ... in `urls`' order, not by URL: prefix
    affinity ranks pods by hashing their names, and a URL's port changes from run to run."""
    names = {u: f"pod-{i}" for i, u in enumerate(urls)}
    routes = {name: AdapterRoute(name, pods=frozenset(names[u] for u in pods)) for name, pods in adapters.items()}
    variants = tuple(
        VariantRoute(
            v,
            w,
            revisions=(
                RevisionRoute("r", 1, tuple(Endpoint(url=u, name=names[u], variant=v, revision="r") for u in urls)),
            ),
        )
        for v, w in (("default", 1), ("cheap", 0))
    )
    return RoutingTable({"fake-model": DeploymentRoute("fake-model", "fake-model", variants=variants, adapters=routes)})


async def test_variants_and_adapters_reach_the_real_worker_in_a_form_it_serves() -> None:
    """`fake-model:sql` and `sql` select the adapter on the pod that has it; `fake-model:cheap` (a variant) is
    served as the base model, which is all the worker knows of it."""
    adapters = [{"sql": "/adapters/sql"}, {}]
    async with workers(2, make=lambda i: LoraFakeEngine(adapters[i])) as [(_, with_sql, url), (_, plain, url2)]:
        table = lora_table([url, url2], {"sql": [url]})
        async with run_gateway(FixedSource(table), open_mode=True) as gw, gw.client() as c:
            answers = {}
            for model in ("fake-model:sql", "sql", "fake-model:cheap", "fake-model"):
                for stream in (False, True):
                    r = await c.post("/v1/chat/completions", json=chat(model=model, stream=stream, max_tokens=2))
                    assert r.status_code == 200, (model, r.text)
                    answers[model, stream] = r
    assert with_sql.lora_requests.count("sql") == 4 and "sql" not in plain.lora_requests
    assert answers["fake-model:sql", False].json()["model"] == "fake-model:sql"  # named as asked
    assert answers["sql", False].json()["model"] == "sql"
    assert answers["fake-model:cheap", False].headers["x-llmfleet-variant"] == "cheap"


async def test_a_pod_without_the_adapter_the_status_lists_is_retried_elsewhere() -> None:
    """The status is a step behind (the worker restarted, or the adapter was unloaded since): its 404
    `model_not_found` came before the engine saw the request, so another pod that has it takes it; with none
    left the answer is 503 `adapter_not_ready`."""
    adapters = [{"sql": "/adapters/sql"}, {}]
    async with workers(2, make=lambda i: LoraFakeEngine(adapters[i])) as [(_, with_sql, url), (_, lacking, url2)]:
        stale = lora_table([url, url2], {"sql": [url, url2]})
        async with run_gateway(FixedSource(stale), open_mode=True) as gw, gw.client() as c:
            for i in range(6):
                body = chat(model="sql", stream=i % 2 == 0, content=f"q{i}", max_tokens=2)
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            retries = await gw.metrics_text()
        assert with_sql.lora_requests == ["sql"] * 6 and lacking.submitted == []
        assert 'llmfleet_gateway_retries_total{model="fake-model",reason="adapter_missing"}' in retries
        only_stale = lora_table([url, url2], {"sql": [url2]})
        async with run_gateway(FixedSource(only_stale), open_mode=True) as gw, gw.client() as c:
            r = await c.post("/v1/chat/completions", json=chat(model="fake-model:sql"))
            base = await c.post("/v1/chat/completions", json=chat(model="fake-model", max_tokens=1))
    assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_not_ready" and r.headers["retry-after"]
    assert base.status_code == 200
