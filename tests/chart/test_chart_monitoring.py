"""Monitoring: the alerts fire on the right data with the labels the operator's webhook needs, and the scrape
configs and dashboard say what the workers, gateway and operator actually export.

The PrometheusRule is checked with the real Prometheus rule engine: `promtool check rules` for syntax and
`promtool test rules` with synthetic worker series (what the PodMonitor's relabelling produces) for behaviour.
Dashboard queries are checked by promtool too, by wrapping each one into a recording rule.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from crds.pods import LABEL_DEPLOYMENT, LABEL_REVISION, LABEL_VARIANT, PORT_NAME

CHART = Path(__file__).resolve().parents[2] / "charts" / "llmfleet"
SCALE_ALERTS = {"LLMFleetTTFTSLOBurn", "LLMFleetQueueDepthHigh", "LLMFleetKVCacheSaturated"}
BUCKETS = ["0.1", "0.5", "1", "2", "5", "+Inf"]


def prometheus_label(kubernetes_label: str) -> str:
    """How Prometheus' Kubernetes discovery names a pod label: non-alphanumerics become underscores."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", kubernetes_label)


def _rules_file(rendered, folder: Path) -> Path:
    (rule,) = rendered.of_kind("PrometheusRule")
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], check=False, capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check(rendered_sets, promtool, tmp_path):
    rules = _rules_file(rendered_sets["monitoring"], tmp_path)
    result = _promtool(promtool, "check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout


def test_scaling_alerts_carry_what_the_webhook_needs(rendered_sets):
    (rule,) = rendered_sets["monitoring"].of_kind("PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    for name in SCALE_ALERTS:
        assert alerts[name]["labels"]["llmfleet_scale"] == "up"
        assert "by (namespace, deployment, variant" in alerts[name]["expr"], "the webhook needs these labels"
    for name in set(alerts) - SCALE_ALERTS:
        assert "llmfleet_scale" not in alerts[name]["labels"], f"{name} is for people, not for scaling"


def _ttft_series(deployment: str, bucket_rates: dict[str, int]) -> list[dict[str, str]]:
    """Cumulative TTFT histogram buckets of one pod, each growing by its rate per minute."""
    labels = f'namespace="llm",deployment="{deployment}",variant="default",pod="{deployment}-0"'
    return [
        {"series": f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{le}"}}', "values": f"0+{rate}x20"}
        for le, rate in bucket_rates.items()
    ]


def _gauge(metric: str, variant: str, pod: str, value: float, deployment: str = "smollm2") -> dict[str, str]:
    labels = f'namespace="llm",deployment="{deployment}",variant="{variant}",pod="{pod}"'
    return {"series": f"{metric}{{{labels}}}", "values": f"{value}x20"}


def _scale_labels(deployment: str, variant: str) -> dict[str, str]:
    return {"namespace": "llm", "deployment": deployment, "variant": variant, "severity": "warning",
            "llmfleet_scale": "up"}  # fmt: skip


def _slow_and_fast_ttft() -> list[dict[str, str]]:
    # "slow": every first token takes 2-5 s (p95 = 2 + 3 * 0.95 = 4.85 s); "fast": all under 0.5 s.
    slow = {le: (0 if float(le.replace("+Inf", "inf")) < 5 else 10) for le in BUCKETS}
    fast = {le: (0 if le == "0.1" else 10) for le in BUCKETS}
    return _ttft_series("slow", slow) + _ttft_series("fast", fast)


def _alert_tests(ttft_fires: bool) -> list[dict[str, Any]]:
    ttft_alerts = []
    if ttft_fires:
        ttft_alerts = [{
            "exp_labels": _scale_labels("slow", "default"),
            "exp_annotations": {
                "summary": "TTFT p95 of slow/default above its 2s SLO",
                "description": "p95 time to first token over 5m is 4.85s for InferenceDeployment llm/slow, variant "
                "default (SLO 2s). The operator scales the variant up when this alert reaches its webhook.",
            },
        }]  # fmt: skip
    return [
        {
            "interval": "1m",
            "input_series": [
                *_slow_and_fast_ttft(),
                # variant default: mean waiting 10 per pod (> 8) fires; int4: mean 6 (max 12) does not.
                _gauge("vllm:num_requests_waiting", "default", "a", 20),
                _gauge("vllm:num_requests_waiting", "default", "b", 0),
                _gauge("vllm:num_requests_waiting", "int4", "c", 12),
                _gauge("vllm:num_requests_waiting", "int4", "d", 0),
                # a pod scraped without the deployment label is never a scaling target
                {"series": 'vllm:num_requests_waiting{namespace="llm",pod="stray"}', "values": "100x20"},
                _gauge("vllm:kv_cache_usage_perc", "default", "a", 0.95),
                _gauge("vllm:kv_cache_usage_perc", "default", "b", 0.93),
                _gauge("vllm:kv_cache_usage_perc", "int4", "c", 0.99),
                _gauge("vllm:kv_cache_usage_perc", "int4", "d", 0.5),
            ],
            "alert_rule_test": [
                {"eval_time": "10m", "alertname": "LLMFleetTTFTSLOBurn", "exp_alerts": ttft_alerts},
                {
                    "eval_time": "10m",
                    "alertname": "LLMFleetQueueDepthHigh",
                    "exp_alerts": [{
                        "exp_labels": _scale_labels("smollm2", "default"),
                        "exp_annotations": {
                            "summary": "Requests queue up in smollm2/default",
                            "description": "On average 10 requests wait per pod of InferenceDeployment llm/smollm2, "
                            "variant default (threshold 8).",
                        },
                    }],
                },
                {
                    "eval_time": "10m",
                    "alertname": "LLMFleetKVCacheSaturated",
                    "exp_alerts": [{
                        "exp_labels": _scale_labels("smollm2", "default"),
                        "exp_annotations": {
                            "summary": "KV cache of smollm2/default is saturated",
                            "description": "Mean KV-cache use is 94% across the pods of InferenceDeployment "
                            "llm/smollm2, variant default (threshold 0.9): new requests wait or get preempted.",
                        },
                    }],
                },
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                {"series": 'up{job="fleet-llmfleet-operator",namespace="llm",pod="op-0"}', "values": "0x20"},
                {
                    "series": "llmfleet_operator_rollouts_total"
                    '{namespace="llm",deployment="smollm2",result="rolled_back"}',
                    "values": "0 0 1 1 1 1",
                },
            ],
            "alert_rule_test": [
                {
                    "eval_time": "10m",
                    "alertname": "LLMFleetOperatorDown",
                    "exp_alerts": [{
                        "exp_labels": {"severity": "warning"},
                        "exp_annotations": {
                            "summary": "No llmfleet operator is up",
                            "description": "Prometheus has scraped no healthy llmfleet operator for 5 minutes: "
                            "InferenceDeployments are neither reconciled nor autoscaled.",
                        },
                    }],
                },
                {
                    "eval_time": "4m",
                    "alertname": "LLMFleetCanaryRolledBack",
                    "exp_alerts": [{
                        "exp_labels": {"severity": "warning", "namespace": "llm", "deployment": "smollm2",
                                       "result": "rolled_back"},
                        "exp_annotations": {
                            "summary": "A canary of smollm2 was rolled back",
                            "description": "The canary analysis of InferenceDeployment llm/smollm2 failed and the "
                            "operator rolled it back; `kubectl describe infd smollm2` says why.",
                        },
                    }],
                },
            ],
        },
    ]  # fmt: skip


@pytest.mark.parametrize(("slo_seconds", "ttft_fires"), [(2, True), (5, False)])
def test_alerts_fire_exactly_where_the_thresholds_say(render, promtool, tmp_path, slo_seconds, ttft_fires):
    values = {"monitoring": {"enabled": True, "prometheusRule": {"ttftP95Seconds": slo_seconds}}}
    rules = _rules_file(render(values), tmp_path)
    tests = _alert_tests(ttft_fires)
    if not ttft_fires:
        tests = tests[:1]  # the SLO value only changes the TTFT alert; the rest is covered by the first case
    spec = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}
    test_file = tmp_path / "alerts_test.yaml"
    test_file.write_text(yaml.safe_dump(spec, width=1000))
    result = _promtool(promtool, "test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout + result.stderr


def test_pod_monitor_relabels_pod_labels_into_deployment_and_variant(rendered_sets):
    monitor = rendered_sets["monitoring"].get("PodMonitor", "fleet-llmfleet-workers")
    spec = monitor["spec"]
    assert spec["selector"] == {"matchExpressions": [{"key": LABEL_DEPLOYMENT, "operator": "Exists"}]}
    assert spec["namespaceSelector"] == {"matchNames": ["llm"]}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] == PORT_NAME and endpoint["path"] == "/metrics"
    relabel = {tuple(r["sourceLabels"]): r["targetLabel"] for r in endpoint["relabelings"]}
    assert relabel == {
        (prometheus_label(LABEL_DEPLOYMENT),): "deployment",
        (prometheus_label(LABEL_VARIANT),): "variant",
        (prometheus_label(LABEL_REVISION),): "revision",
    }
    assert monitor["metadata"]["labels"]["release"] == "kps", "monitoring.labels reach the monitors"


def test_cluster_wide_pod_monitor_watches_every_namespace(rendered_sets):
    monitor = rendered_sets["two-operators-cluster-wide"].get("PodMonitor", "fleet-llmfleet-workers")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def _metrics_port_is_private(rendered, value_set: str, name: str) -> dict[str, int]:
    """`name`'s Service exposes only `http`, and (with monitoring on) a PodMonitor scrapes the pods' `metrics` port;
    returns the container's ports by name."""
    deployment = rendered.get("Deployment", name)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] != ports["metrics"]
    service = rendered.get("Service", name)
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http"}
    assert [m for m in rendered.of_kind("ServiceMonitor") if m["metadata"]["name"] == name] == []
    monitors = [m for m in rendered.of_kind("PodMonitor") if m["metadata"]["name"] == name]
    if value_set != "monitoring" and not monitors:
        return ports  # monitoring off in this value set: nothing scrapes it
    (monitor,) = monitors  # "monitoring" turns the monitors on
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [deployment["metadata"]["namespace"]]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["honorLabels"]) == ("metrics", "/metrics", True)
    return ports


def test_gateway_metrics_are_scraped_from_the_pods_internal_port_never_through_the_service(rendered_sets, value_set):
    """The gateway's /metrics names pod URLs, deployments and namespaces: it is served on its own port (metricsPort,
    bound to the pod IP), scraped by a PodMonitor, and the Service (what API clients reach) does not expose it."""
    rendered = rendered_sets[value_set]
    if "fleet-llmfleet-gateway" not in {d["metadata"]["name"] for d in rendered.of_kind("Deployment")}:
        return  # gateway.enabled=false in this value set
    ports = _metrics_port_is_private(rendered, value_set, "fleet-llmfleet-gateway")
    (container,) = rendered.get("Deployment", "fleet-llmfleet-gateway")["spec"]["template"]["spec"]["containers"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    assert (flags["metrics-port"], flags["port"]) == (str(ports["metrics"]), str(ports["http"]))
    assert flags["metrics-host"] == "$(POD_IP)"
    assert value_set != "custom-gateway" or ports["metrics"] == 9191


def test_operator_metrics_are_scraped_from_the_pods_internal_port_never_through_the_service(rendered_sets, value_set):
    """The operator's /metrics names deployments and namespaces: it is served on its own port (metricsPort, bound
    to the pod IP), scraped by a PodMonitor, and the Service (what Alertmanager reaches) does not expose it."""
    rendered = rendered_sets[value_set]
    ports = _metrics_port_is_private(rendered, value_set, "fleet-llmfleet-operator")
    (container,) = rendered.get("Deployment", "fleet-llmfleet-operator")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LLMFLEET_OPERATOR_METRICS_PORT"] == str(ports["metrics"]) != env["LLMFLEET_OPERATOR_HTTP_PORT"]
    assert env["LLMFLEET_OPERATOR_METRICS_HOST"] == "$(POD_IP)"


def test_alertmanager_config_routes_scale_alerts_to_the_operator_with_the_token(rendered_sets):
    rendered = rendered_sets["monitoring"]
    (config,) = rendered.of_kind("AlertmanagerConfig")
    route = config["spec"]["route"]
    assert {"name": "llmfleet_scale", "value": "up", "matchType": "="} in route["matchers"]
    assert {"deployment", "variant", "namespace"} <= set(route["groupBy"])
    (receiver,) = config["spec"]["receivers"]
    (hook,) = receiver["webhookConfigs"]
    service = rendered.get("Service", "fleet-llmfleet-operator")
    assert hook["url"] == f"http://fleet-llmfleet-operator.llm.svc:{service['spec']['ports'][0]['port']}/alerts"
    auth = hook["httpConfig"]["authorization"]
    assert auth["type"] == "Bearer"
    assert auth["credentials"] == {"name": "fleet-llmfleet-alerts-token", "key": "token"}
    rendered.get("Secret", "fleet-llmfleet-alerts-token")


def _dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_shows_the_slo_load_fleet_and_rollout_signals(dashboard):
    titles = {p["title"] for p in dashboard["panels"] if p["type"] != "row"}
    assert {
        "TTFT p95 by variant",
        "ITL p95 by variant",
        "Queue depth by variant",
        "KV-cache usage by variant",
        "Replicas per variant",
        "Canary weight",
        "Canary analysis verdicts",
    } <= titles
    text = " ".join(expr for _, expr in _dashboard_queries(dashboard))
    for metric in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "llmfleet_operator_replicas",
        "llmfleet_operator_canary_weight",
        "llmfleet_operator_analysis_verdicts_total",
    ):
        assert metric in text, metric
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_operator_gauges_are_not_summed_over_operator_replicas(dashboard):
    """With peering only the working replica exports the CR-derived gauges (a standby drops them), but for a moment
    around a handover two may: `max` never counts a fleet twice. Counters (`..._total`) are per replica and add up."""
    for _, expr in _dashboard_queries(dashboard):
        for gauge in (
            "llmfleet_operator_replicas",
            "llmfleet_operator_ready_replicas",
            "llmfleet_operator_desired_replicas",
            "llmfleet_operator_canary_weight",
        ):
            if f"{gauge}{{" in expr:
                assert not expr.startswith("sum"), expr


def test_dashboard_queries_are_valid_promql(dashboard, promtool, tmp_path):
    substitutions = {"$__rate_interval": "5m", "$namespace": "llm", "$deployment": "smollm2"}
    exprs = [expr for _, expr in _dashboard_queries(dashboard)]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(SELECTOR, label): the selector is PromQL
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", variable["query"]["query"])
            assert match, variable["query"]
            exprs.append(match.group(1))
    rules = []
    for i, raw in enumerate(exprs):
        expr = raw
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unsubstituted variable in {expr}"
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _promtool(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_configmap_is_labelled_for_grafana_and_holds_the_dashboard(rendered_sets, dashboard):
    (configmap,) = [c for c in rendered_sets["monitoring"].of_kind("ConfigMap") if "dashboard" in c["metadata"]["name"]]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["llmfleet.json"]) == dashboard


def test_operator_metric_names_used_by_the_chart_are_defined_in_the_readme(dashboard, rendered_sets):
    readme = (CHART / "README.md").read_text()
    defined = set(re.findall(r"^\| `(llmfleet_operator_\w+)` \|", readme, flags=re.MULTILINE))
    (rule,) = rendered_sets["monitoring"].of_kind("PrometheusRule")
    used_text = json.dumps(dashboard) + json.dumps(rule)
    used = set(re.findall(r"llmfleet_operator_\w+", used_text))
    assert used, "the chart uses no operator metric?"
    assert used <= defined, f"metrics used but not defined in the README contract: {sorted(used - defined)}"


def test_readme_alertmanager_receiver_posts_to_the_operator_with_a_bearer_token():
    readme = (CHART / "README.md").read_text()
    block = re.search(r"<!-- alertmanager-receiver -->\s*```yaml\n(.*?)```", readme, flags=re.DOTALL)
    assert block, "README lacks the Alertmanager receiver example"
    config = yaml.safe_load(block.group(1))
    route = next(r for r in config["route"]["routes"] if r["receiver"] == "llmfleet-operator")
    assert 'llmfleet_scale="up"' in route["matchers"]
    assert {"namespace", "deployment", "variant"} <= set(route["group_by"])
    (receiver,) = [r for r in config["receivers"] if r["name"] == "llmfleet-operator"]
    (hook,) = receiver["webhook_configs"]
    assert hook["url"].endswith(".svc:8081/alerts")
    assert hook["http_config"]["authorization"]["type"] == "Bearer"
