"""/metrics: vLLM's names with the model_name label, values that move with traffic, llmfleet's own series."""

from __future__ import annotations

from worker.engine.protocol import EngineStats
from worker.metrics import ServerGauges, WorkerMetrics

VLLM_NAMES = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "llmfleet:draining",
    "llmfleet:inflight_requests",
    "llmfleet:remaining_tokens_estimate",
    "llmfleet:requests_total",
]


def test_every_series_is_exported_with_the_model_name(start_worker) -> None:
    live = start_worker(served_model_name="served")
    text = live.http().get("/metrics").text
    for name in VLLM_NAMES:
        assert live.metric(name, model_name="served") is not None, name
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert "# TYPE vllm:prompt_tokens_total counter" in text
    assert "_created" not in text


def test_metrics_move_with_traffic(start_worker, gated) -> None:
    engine, gate = gated()
    live = start_worker(engine)
    http = live.http()
    body = {"prompt": "xyz", "max_tokens": 8, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # one token out, then the gate holds it
        assert live.metric("vllm:num_requests_running") == 1
        assert live.metric("vllm:kv_cache_usage_perc") > 0
        assert live.metric("llmfleet:inflight_requests") == 1
        assert live.metric("llmfleet:remaining_tokens_estimate") == 7
        assert live.metric("vllm:prompt_tokens_total") == 3
        assert live.metric("vllm:time_to_first_token_seconds_count") == 1
        gate.set()
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    live.openai().completions.create(model="fake-model", prompt="abcd", max_tokens=5, temperature=0)

    assert live.metric("vllm:prompt_tokens_total") == 7
    assert live.metric("vllm:generation_tokens_total") == 13
    assert live.metric("vllm:time_to_first_token_seconds_count") == 2
    assert live.metric("vllm:inter_token_latency_seconds_count") == 7 + 4
    assert live.metric("vllm:e2e_request_latency_seconds_count") == 2
    assert live.metric("vllm:request_success_total", finished_reason="length") == 2
    assert live.metric("vllm:request_success_total", finished_reason="stop") == 0
    assert live.metric("vllm:num_requests_running") == 0
    assert live.metric("llmfleet:inflight_requests") == 0
    assert live.metric("llmfleet:remaining_tokens_estimate") == 0
    assert live.metric("llmfleet:requests_total") == 2
    assert live.metric("vllm:prefix_cache_queries_total") == 7


def test_error_counter_by_status_code(start_worker) -> None:
    live = start_worker()
    http = live.http()
    assert http.post("/v1/completions", json={"prompt": "x", "n": 3}).status_code == 400
    assert http.post("/v1/completions", content=b"{").status_code == 400
    assert http.post("/v1/completions", json={"prompt": "x", "model": "other"}).status_code == 404
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert http.get("/v1/models").status_code == 200  # not a generation request: not counted
    assert live.metric("llmfleet:request_errors_total", code="400") == 2
    assert live.metric("llmfleet:request_errors_total", code="404") == 1
    assert live.metric("llmfleet:requests_total") == 4


def test_scrape_time_series_come_from_the_engine_snapshot() -> None:
    stats = EngineStats(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.5,
        num_preemptions_total=4,
        prefix_cache_queries_total=100,
        prefix_cache_hits_total=64,
    )
    metrics = WorkerMetrics("m", lambda: stats, lambda: ServerGauges(True, 5, 321))
    text = metrics.render().decode()
    for line in [
        'vllm:num_requests_running{model_name="m"} 3.0',
        'vllm:num_requests_waiting{model_name="m"} 2.0',
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5',
        'vllm:num_preemptions_total{model_name="m"} 4.0',
        'vllm:prefix_cache_queries_total{model_name="m"} 100.0',
        'vllm:prefix_cache_hits_total{model_name="m"} 64.0',
        'llmfleet:draining{model_name="m"} 1.0',
        'llmfleet:inflight_requests{model_name="m"} 5.0',
        'llmfleet:remaining_tokens_estimate{model_name="m"} 321.0',
    ]:
        assert line in text.splitlines(), line


def test_two_apps_in_one_process_do_not_share_metrics() -> None:
    a = WorkerMetrics("a", EngineStats, lambda: ServerGauges(False, 0, 0))
    b = WorkerMetrics("b", EngineStats, lambda: ServerGauges(False, 0, 0))
    a.generated(5)
    assert 'vllm:generation_tokens_total{model_name="a"} 5.0' in a.render().decode()
    assert 'vllm:generation_tokens_total{model_name="b"} 0.0' in b.render().decode()


def test_a_backend_registry_replaces_our_vllm_series() -> None:
    """The vLLM backend exports vLLM's own series: ours under the same names must then be left out."""
    from prometheus_client import CollectorRegistry, Gauge

    backend = CollectorRegistry()
    Gauge("vllm:num_requests_running", "vLLM's own", ["model_name", "engine"], registry=backend).labels("m", "0").set(7)
    metrics = WorkerMetrics("m", lambda: EngineStats(num_running=3), lambda: ServerGauges(True, 1, 2), backend)
    metrics.generated(5)
    lines = metrics.render().decode().splitlines()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 7.0' in lines
    assert not any(line.startswith("vllm:generation_tokens") for line in lines)
    assert sum(line.startswith("# TYPE vllm:num_requests_running ") for line in lines) == 1
    assert 'llmfleet:draining{model_name="m"} 1.0' in lines


def test_spec_decode_counters_only_when_the_engine_speculates() -> None:
    from worker.core.spec_decode import SpecDecodeStats

    spec = SpecDecodeStats()
    spec.observe(4, 3)
    spec.observe(4, 1)
    metrics = WorkerMetrics("m", lambda: EngineStats(spec_decode=spec), lambda: ServerGauges(False, 0, 0))
    lines = metrics.render().decode().splitlines()
    for line in [
        'vllm:spec_decode_num_drafts_total{model_name="m"} 2.0',
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 8.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 0.0',
    ]:
        assert line in lines, line
    plain = WorkerMetrics("m", EngineStats, lambda: ServerGauges(False, 0, 0)).render().decode()
    assert "spec_decode" not in plain
