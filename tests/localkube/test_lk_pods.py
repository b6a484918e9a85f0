"""Conformance: the process kubelet (probes, restarts, graceful deletion, env, logs, endpoints, scheduling)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import httpx
import kubernetes
import pytest
from kubernetes import watch
from kubernetes.client import ApiException

from localkube.testing import wait_for

PY = sys.executable


def pod(name: str, command: list[str], **container) -> dict:
    spec_container = {"name": container.pop("container_name", "main"), "image": "python:3.11", "command": command}
    pod_spec = container.pop("pod_spec", {})
    labels = container.pop("labels", None)
    spec_container.update(container)
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"terminationGracePeriodSeconds": 5, "containers": [spec_container], **pod_spec},
    }
    if labels:
        body["metadata"]["labels"] = labels
    return body


@pytest.fixture(scope="module")
def core(api):
    return kubernetes.client.CoreV1Api(api)


def read(core, namespace: str, name: str):
    return core.read_namespaced_pod(name, namespace)


def is_ready(p) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])


def gone(core, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
        return False
    except ApiException as exc:
        return exc.status == 404


def deleting_or_gone(core, namespace: str, name: str) -> bool:
    try:
        return core.read_namespaced_pod(name, namespace).metadata.deletion_timestamp is not None
    except ApiException as exc:
        return exc.status == 404


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def test_http_server_becomes_ready_through_its_probe(core, kubectl, namespace):
    server = pod(
        "web",
        ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8000"],
        labels={"app": "web"},
        env=[{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        ports=[{"name": "http", "containerPort": 8000}],
        readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    )
    broken = pod(
        "web-wrong-port",
        ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8000"],
        labels={"app": "web"},
        env=[{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        ports=[{"name": "http", "containerPort": 8000}],
        readinessProbe={"httpGet": {"path": "/", "port": 8001}, "periodSeconds": 1, "failureThreshold": 1},
    )
    core.create_namespaced_pod(namespace, server)
    core.create_namespaced_pod(namespace, broken)
    core.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    )
    kubectl("wait", "--for=condition=Ready", "pod/web", "-n", namespace, "--timeout=30s")
    p = read(core, namespace, "web")
    ip = p.status.pod_ip
    assert ip.startswith("127.") and ip != "127.0.0.1" and p.status.phase == "Running"
    assert p.spec.node_name == "localkube-node" and p.status.host_ip == "127.0.0.1"
    status = p.status.container_statuses[0]
    assert status.ready and status.started and status.restart_count == 0 and status.state.running.started_at
    assert status.container_id and status.image == "python:3.11" and status.image_id
    assert [c.type for c in p.status.conditions] == [
        "PodReadyToStartContainers",
        "Initialized",
        "Ready",
        "ContainersReady",
        "PodScheduled",
    ]
    assert httpx.get(f"http://{ip}:8000/").status_code == 200  # the real process serves on its own pod IP
    # the pod whose probe targets the wrong port is running but never ready
    wait_for(
        lambda: any(
            e.reason == "Unhealthy" and e.involved_object.name == "web-wrong-port"
            for e in core.list_namespaced_event(namespace).items
        ),
        what="a failed readiness probe",
    )
    other = read(core, namespace, "web-wrong-port")
    assert other.status.phase == "Running" and not is_ready(other)
    endpoints = wait_for(
        lambda: (
            (e := core.read_namespaced_endpoints("web", namespace)).subsets
            and e.subsets[0].addresses
            and e.subsets[0].not_ready_addresses
            and e
        ),
        what="endpoints",
    )
    subset = endpoints.subsets[0]
    assert [a.ip for a in subset.addresses] == [ip] and subset.ports[0].port == 8000
    assert [a.target_ref.name for a in subset.not_ready_addresses] == ["web-wrong-port"]
    slices = (
        kubernetes.client.DiscoveryV1Api(core.api_client)
        .list_namespaced_endpoint_slice(namespace, label_selector="kubernetes.io/service-name=web")
        .items
    )
    ready = {e.target_ref.name: e.conditions.ready for e in slices[0].endpoints}
    assert ready == {"web": True, "web-wrong-port": False}
    table = kubectl("get", "pods", "-n", namespace, "--no-headers")
    rows = {line.split()[0]: line.split() for line in table.splitlines()}
    assert rows["web"][1:4] == ["1/1", "Running", "0"] and rows["web-wrong-port"][1:3] == ["0/1", "Running"]
    logs = kubectl("logs", "web", "-n", namespace)
    assert f"Serving HTTP on {ip} port 8000" in logs and '"GET / HTTP/1.1" 200' in logs


def test_deletion_runs_prestop_then_sigterm(core, kubectl, namespace, tmp_path):
    marks = tmp_path / "marks"
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        def stop(*_):
            with open({str(marks)!r}, "a") as f:
                f.write("sigterm\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        with open({str(tmp_path / "pid")!r}, "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.1)
    """)
    body = pod(
        "graceful",
        [PY, "-c", script],
        lifecycle={"preStop": {"exec": {"command": ["sh", "-c", f"echo prestop >> {marks}"]}}},
        pod_spec={"terminationGracePeriodSeconds": 20},
    )
    core.create_namespaced_pod(namespace, body)
    wait_for(lambda: is_ready(read(core, namespace, "graceful")), what="graceful pod ready")
    pid = int(wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(), what="pid file"))
    assert pid_alive(pid)
    kubectl("delete", "pod", "graceful", "-n", namespace, "--timeout=30s")  # waits until the object is gone
    assert marks.read_text().splitlines() == ["prestop", "sigterm"]
    assert not pid_alive(pid)
    assert gone(core, namespace, "graceful")


def test_http_prestop_hook_and_readiness_gates(core, kubectl, namespace, tmp_path):
    marks = tmp_path / "marks"
    script = textwrap.dedent(f"""
        import http.server, os, signal, sys
        def stop(*_):
            with open({str(marks)!r}, "a") as f:
                f.write("sigterm\\n")
            os._exit(0)
        signal.signal(signal.SIGTERM, stop)
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/drain":
                    with open({str(marks)!r}, "a") as f:
                        f.write("prestop-http\\n")
                self.send_response(200)
                self.end_headers()
        http.server.HTTPServer((os.environ["LOCALKUBE_POD_IP"], 8080), Handler).serve_forever()
    """)
    body = pod(
        "hooked",
        [PY, "-c", script],
        ports=[{"containerPort": 8080}],
        readinessProbe={"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 1},
        lifecycle={"preStop": {"httpGet": {"path": "/drain", "port": 8080}}},
        pod_spec={"readinessGates": [{"conditionType": "example.com/warm"}], "terminationGracePeriodSeconds": 20},
    )
    core.create_namespaced_pod(namespace, body)
    waiting = wait_for(
        lambda: (
            (x := read(core, namespace, "hooked")).status.container_statuses
            and x.status.container_statuses[0].ready
            and x
        ),
        what="container ready",
    )
    assert not is_ready(waiting)  # its readiness gate is still closed
    core.patch_namespaced_pod_status(  # strategic merge: conditions merge by type
        "hooked",
        namespace,
        {"status": {"conditions": [{"type": "example.com/warm", "status": "True"}]}},
        _content_type="application/strategic-merge-patch+json",
    )
    wait_for(lambda: is_ready(read(core, namespace, "hooked")), what="Ready once the gate opens")
    kubectl("delete", "pod", "hooked", "-n", namespace, "--timeout=30s")
    assert marks.read_text().splitlines() == ["prestop-http", "sigterm"]


def test_grace_period_ends_with_sigkill_of_the_whole_group(core, namespace, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, subprocess, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "300"])
        with open({str(tmp_path / "pids")!r}, "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        while True:
            time.sleep(0.1)
    """)
    core.create_namespaced_pod(
        namespace, pod("stubborn", [PY, "-c", script], pod_spec={"terminationGracePeriodSeconds": 1})
    )
    pids = wait_for(lambda: (tmp_path / "pids").exists() and (tmp_path / "pids").read_text().split(), what="pids")
    deleting = core.delete_namespaced_pod("stubborn", namespace)
    assert deleting.metadata.deletion_grace_period_seconds == 1
    wait_for(lambda: gone(core, namespace, "stubborn"), what="pod removal after SIGKILL")
    assert not any(pid_alive(int(p)) for p in pids)


def test_crashing_container_restarts_and_keeps_logs(core, kubectl, namespace):
    core.create_namespaced_pod(namespace, pod("crasher", ["sh", "-c", "echo attempt; exit 3"]))
    p = wait_for(
        lambda: (
            (x := read(core, namespace, "crasher")).status.container_statuses
            and x.status.container_statuses[0].restart_count >= 2
            and x
        ),
        what="restarts",
    )
    status = p.status.container_statuses[0]
    assert p.status.phase == "Running" and not status.ready
    assert status.last_state.terminated.exit_code == 3 and status.last_state.terminated.reason == "Error"
    assert "attempt" in kubectl("logs", "crasher", "-n", namespace, "--previous")
    reasons = {
        e.reason for e in core.list_namespaced_event(namespace, field_selector="involvedObject.name=crasher").items
    }
    assert {"Scheduled", "Started", "BackOff"} <= reasons


def test_env_sources_and_terminal_phases(core, kubectl, namespace):
    core.create_namespaced_secret(namespace, {"metadata": {"name": "creds"}, "stringData": {"token": "t0k"}})
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "settings"}, "data": {"mode": "fast", "level": "3"}}
    )
    env = [
        {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
        {"name": "GREETING", "value": "hello-$(MY_NAME)"},
    ]
    script = (
        "import os, json; print(json.dumps({k: os.environ.get(k) for k in "
        "['MY_NAME','MY_NS','MY_IP','TOKEN','MODE','GREETING','LOCALKUBE_POD_IP','CFG_level','ARG']}))"
    )
    core.create_namespaced_pod(
        namespace,
        pod(
            "env",
            ["python", "-c", script + "; import sys; print(sys.argv[1:])", "$(MODE)"],
            env=env + [{"name": "ARG", "value": "x"}],
            envFrom=[{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
            pod_spec={"restartPolicy": "Never"},
        ),
    )
    p = wait_for(
        lambda: (x := read(core, namespace, "env")).status.phase == "Succeeded" and x, what="env pod to finish"
    )
    lines = kubectl("logs", "env", "-n", namespace).splitlines()
    values = json.loads(lines[0])
    assert values == {
        "MY_NAME": "env",
        "MY_NS": namespace,
        "MY_IP": p.status.pod_ip,
        "TOKEN": "t0k",
        "MODE": "fast",
        "GREETING": "hello-env",
        "LOCALKUBE_POD_IP": p.status.pod_ip,
        "CFG_level": "3",
        "ARG": "x",
    }
    assert lines[1] == "['fast']"
    assert p.status.container_statuses[0].state.terminated.reason == "Completed"
    core.create_namespaced_pod(namespace, pod("fails", ["sh", "-c", "exit 1"], pod_spec={"restartPolicy": "Never"}))
    failed = wait_for(lambda: (x := read(core, namespace, "fails")).status.phase == "Failed" and x, what="Failed phase")
    assert failed.status.container_statuses[0].restart_count == 0
    core.create_namespaced_pod(
        namespace,
        pod(
            "retries",
            ["sh", "-c", "test -e $MARK && exit 0; touch $MARK; exit 1"],
            env=[{"name": "MARK", "value": f"/tmp/lk-retry-{namespace}"}],
            pod_spec={"restartPolicy": "OnFailure"},
        ),
    )
    done = wait_for(
        lambda: (x := read(core, namespace, "retries")).status.phase == "Succeeded" and x, what="OnFailure success"
    )
    assert done.status.container_statuses[0].restart_count == 1
    os.unlink(f"/tmp/lk-retry-{namespace}")


def test_missing_secret_blocks_until_created(core, namespace):
    core.create_namespaced_pod(
        namespace,
        pod(
            "waits", ["sleep", "300"], env=[{"name": "S", "valueFrom": {"secretKeyRef": {"name": "later", "key": "k"}}}]
        ),
    )
    waiting = wait_for(
        lambda: (
            (s := read(core, namespace, "waits").status.container_statuses)
            and s[0].state.waiting
            and s[0].state.waiting.reason == "CreateContainerConfigError"
            and s[0]
        ),
        what="config error",
    )
    assert 'secret "later" not found' in waiting.state.waiting.message
    core.create_namespaced_secret(namespace, {"metadata": {"name": "later"}, "stringData": {"k": "v"}})
    wait_for(lambda: read(core, namespace, "waits").status.phase == "Running", what="start after the secret appears")


def test_liveness_failure_restarts_and_startup_probe_gates(core, namespace):
    core.create_namespaced_pod(
        namespace,
        pod(
            "unlive",
            ["sleep", "300"],
            livenessProbe={"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 1},
            pod_spec={"terminationGracePeriodSeconds": 1},
        ),
    )
    core.create_namespaced_pod(
        namespace,
        pod(
            "slowstart",
            ["sh", "-c", "sleep 1; touch /tmp/lk-started-$NS; sleep 300"],
            env=[{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
            startupProbe={
                "exec": {"command": ["sh", "-c", f"test -e /tmp/lk-started-{namespace}"]},
                "periodSeconds": 1,
                "failureThreshold": 30,
            },
        ),
    )
    first = wait_for(
        lambda: (s := read(core, namespace, "slowstart").status.container_statuses) and s[0].state.running and s[0],
        what="slowstart running",
    )
    if not os.path.exists(f"/tmp/lk-started-{namespace}"):
        assert first.started is False and first.ready is False  # not started until the startup probe passes
    wait_for(lambda: is_ready(read(core, namespace, "slowstart")), what="ready after the startup probe")
    os.unlink(f"/tmp/lk-started-{namespace}")
    restarted = wait_for(
        lambda: (s := read(core, namespace, "unlive").status.container_statuses) and s[0].restart_count >= 1 and s[0],
        what="liveness restart",
    )
    assert "liveness probe" in (restarted.last_state.terminated.message or "")


def test_init_containers_run_first(core, kubectl, namespace, tmp_path):
    marker = tmp_path / "init-done"
    body = pod("withinit", ["sh", "-c", f"cat {marker}; sleep 300"])
    body["spec"]["initContainers"] = [
        {"name": "setup", "image": "busybox", "command": ["sh", "-c", f"echo from-init > {marker}"]}
    ]
    core.create_namespaced_pod(namespace, body)
    wait_for(lambda: is_ready(read(core, namespace, "withinit")), what="pod with init container ready")
    p = read(core, namespace, "withinit")
    assert p.status.init_container_statuses[0].state.terminated.exit_code == 0
    wait_for(lambda: "from-init" in kubectl("logs", "withinit", "-n", namespace), what="main container output")


def test_extended_resources_are_unschedulable(core, kubectl, namespace):
    body = pod("gpu", ["sleep", "300"], resources={"limits": {"nvidia.com/gpu": "1"}})
    core.create_namespaced_pod(namespace, body)
    p = wait_for(lambda: (x := read(core, namespace, "gpu")).status.conditions and x, what="scheduling verdict")
    scheduled = next(c for c in p.status.conditions if c.type == "PodScheduled")
    assert scheduled.status == "False" and scheduled.reason == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in scheduled.message and p.status.phase == "Pending" and not p.spec.node_name
    kubectl("delete", "pod", "gpu", "-n", namespace, "--timeout=10s")  # never bound: removed at once


def test_force_delete_and_typed_watch(core, namespace, tmp_path):
    # $$ is Kubernetes' escape for a literal $ in commands, so the shell sees $$ (its pid)
    core.create_namespaced_pod(
        namespace, pod("forced", ["sh", "-c", f"echo $$$$ > {tmp_path / 'pid'}; exec sleep 300"])
    )
    wait_for(lambda: is_ready(read(core, namespace, "forced")), what="forced pod ready")
    pid = int(wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip(), what="pid"))
    listing = core.list_namespaced_pod(namespace, field_selector="metadata.name=forced")
    stream = watch.Watch().stream(
        core.list_namespaced_pod,
        namespace,
        field_selector="metadata.name=forced",
        resource_version=listing.metadata.resource_version,
        timeout_seconds=10,
    )
    core.delete_namespaced_pod("forced", namespace, grace_period_seconds=0)
    last = None
    for event in stream:
        assert isinstance(event["object"], kubernetes.client.V1Pod)  # typed decoding of every event works
        last = event["type"]
        if last == "DELETED":
            break
    assert last == "DELETED" and gone(core, namespace, "forced")
    wait_for(lambda: not pid_alive(pid), what="the process to be killed after a force deletion")


def test_eviction_honours_disruption_budgets(core, api, namespace):
    for n in range(2):
        core.create_namespaced_pod(namespace, pod(f"member{n}", ["sleep", "300"], labels={"app": "guarded"}))
    kubernetes.client.PolicyV1Api(api).create_namespaced_pod_disruption_budget(
        namespace,
        {"metadata": {"name": "guard"}, "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "guarded"}}}},
    )
    wait_for(lambda: all(is_ready(read(core, namespace, f"member{n}")) for n in range(2)), what="members ready")
    wait_for(
        lambda: (
            kubernetes.client.PolicyV1Api(api)
            .read_namespaced_pod_disruption_budget("guard", namespace)
            .status.current_healthy
            == 2
        ),
        what="budget status",
    )
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod_eviction("member0", namespace, {"metadata": {"name": "member0"}})
    assert refused.value.status == 429
    kubernetes.client.PolicyV1Api(api).patch_namespaced_pod_disruption_budget(
        "guard", namespace, {"spec": {"minAvailable": 1}}
    )
    wait_for(
        lambda: (
            kubernetes.client.PolicyV1Api(api)
            .read_namespaced_pod_disruption_budget("guard", namespace)
            .status.disruptions_allowed
            == 1
        ),
        what="budget to allow one disruption",
    )
    core.create_namespaced_pod_eviction("member0", namespace, {"metadata": {"name": "member0"}})
    assert deleting_or_gone(core, namespace, "member0")


def test_pod_spec_is_immutable_but_metadata_and_images_are_not(core, kubectl, namespace):
    manifest = pod("fixed", ["sleep", "300"])
    kubectl.apply(manifest, "-n", namespace)
    kubectl("label", "pod", "fixed", "-n", namespace, "role=test")
    manifest["spec"]["containers"][0]["image"] = "python:3.12"
    kubectl.apply(manifest, "-n", namespace)  # image changes are allowed (and defaults do not count as changes)
    assert read(core, namespace, "fixed").spec.containers[0].image == "python:3.12"
    live = kubectl.json("get", "pod", "fixed", "-n", namespace)
    live["spec"]["containers"][0]["command"] = ["sleep", "1"]
    refused = kubectl.run("replace", "-f", "-", input=json.dumps(live), check=False)
    assert refused.returncode != 0 and "pod updates may not change fields other than" in refused.stderr
