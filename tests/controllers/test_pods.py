"""The worker pod manifest: command, binding, probes, drain hook, security, placement, identity."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controllers import CreatePod, Observed, Policy
from controllers.drain_token import drain_token
from controllers.pods import (
    PodDefaults,
    extra_engine_args,
    model_path,
    pod_template,
    prestop_script,
    service_manifest,
    service_matches,
)
from crds.helpers import parse_spec


def _pod(kit, spec=None):
    plan = kit.reconcile(kit.resource(spec), Observed(), kit.now)
    return plan.of_type(CreatePod)[0].manifest


def _container(pod):
    (container,) = pod["spec"]["containers"]
    return container


def _flag(args, name):
    return args[args.index(name) + 1]


def test_command_carries_model_engine_and_variant_settings(kit):
    pod = _pod(
        kit,
        {
            "model": {
                "name": "smollm2",
                "source": "bundled://smollm2-135m-instruct",
                "maxModelLen": 2048,
                "revision": "v1.2",
            },
            "engine": {
                "type": "builtin",
                "maxNumSeqs": 16,
                "kvCacheBytes": "64Mi",
                "enablePrefixCaching": False,
                "enableChunkedPrefill": False,
                "maxNumBatchedTokens": 2048,
                "extraArgs": {"gpu-memory-utilization": 0.9, "trust-remote-code": True},
            },
            "variants": [{"name": "q", "quantization": "int4", "extraArgs": {"gpu-memory-utilization": 0.5}}],
            "drain": {"timeoutSeconds": 30, "terminationGracePeriodSeconds": 45},
        },
    )
    container = _container(pod)
    args = container["args"]
    assert container["command"] == ["llmfleet", "worker"]
    assert _flag(args, "--model") == "bundled://smollm2-135m-instruct"
    assert _flag(args, "--served-model-name") == "smollm2"
    assert (_flag(args, "--engine"), _flag(args, "--quantization")) == ("builtin", "int4")
    assert (_flag(args, "--max-model-len"), _flag(args, "--max-num-seqs")) == ("2048", "16")
    assert _flag(args, "--kv-cache-bytes") == str(64 * 2**20)
    assert "--no-enable-prefix-caching" in args and "--no-enable-chunked-prefill" in args
    assert _flag(args, "--revision") == "v1.2" and _flag(args, "--max-num-batched-tokens") == "2048"
    assert _flag(args, "--drain-timeout") == "30"
    assert _flag(args, "--gpu-memory-utilization") == "0.5"  # the variant's value wins
    assert "--trust-remote-code" in args
    assert "--host" not in args  # the worker binds to $POD_IP
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "LLMFLEET_DRAIN_TOKEN" not in env  # no operator key in this policy: no token, POST /drain stays off
    assert pod["spec"]["terminationGracePeriodSeconds"] == 45


def test_probes_ports_and_drain_hook(kit):
    container = _container(_pod(kit))
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # big models load slowly
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    compile(command[2], "<preStop>", "exec")


KEY = b"operator-drain-key-for-tests-0123456789"


@pytest.mark.parametrize(
    ("template_env", "expected_names"),
    [
        ([], ["LLMFLEET_DRAIN_TOKEN", "POD_IP"]),
        # a CR cannot pin its own token: the derived one replaces it
        ([{"name": "LLMFLEET_DRAIN_TOKEN", "value": "mine"}], ["LLMFLEET_DRAIN_TOKEN", "POD_IP"]),
    ],
)
def test_pods_carry_the_drain_token_derived_from_the_operator_key(kit, template_env, expected_names):
    resource = kit.resource({"template": {"env": template_env}})
    plan = kit.reconcile(resource, Observed(), kit.now, Policy(drain_key=KEY))
    (container,) = plan.of_type(CreatePod)[0].manifest["spec"]["containers"]
    tokens = [e for e in container["env"] if e["name"] == "LLMFLEET_DRAIN_TOKEN"]
    assert tokens == [{"name": "LLMFLEET_DRAIN_TOKEN", "value": drain_token(KEY, "default", "smollm2", kit.uid)}]
    assert [e["name"] for e in container["env"][:2]] == expected_names
    assert not any("secretKeyRef" in (e.get("valueFrom") or {}) for e in container["env"])


def test_a_key_rotation_changes_the_token_of_new_pods_but_not_the_revision(kit):
    resource = kit.resource()
    before = kit.reconcile(resource, Observed(), kit.now, Policy(drain_key=KEY)).of_type(CreatePod)[0]
    after = kit.reconcile(resource, Observed(), kit.now, Policy(drain_key=b"rotated-" + KEY)).of_type(CreatePod)[0]
    none = kit.reconcile(resource, Observed(), kit.now, Policy()).of_type(CreatePod)[0]
    assert before.revision == after.revision == none.revision and before.name == after.name
    env = [{e["name"]: e.get("value") for e in c.manifest["spec"]["containers"][0]["env"]} for c in (before, after)]
    assert env[0]["LLMFLEET_DRAIN_TOKEN"] != env[1]["LLMFLEET_DRAIN_TOKEN"]


def test_resources_and_gpus(kit):
    resources = _container(
        _pod(kit, {"variants": [{"name": "g", "resources": {"cpu": 2, "memory": "8Gi", "nvidia.com/gpu": 1}}]})
    )["resources"]
    assert resources == {
        "requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"},
    }
    assert "resources" not in _container(_pod(kit))


def test_security_context_is_locked_down(kit):
    pod = _pod(kit)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["automountServiceAccountToken"] is False
    security = _container(pod)["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in _container(pod)["volumeMounts"]} >= {"/tmp"}


def test_identity_labels_and_owner(kit):
    pod = _pod(kit, {"template": {"labels": {"team": "a"}}})  # llmfleet.io/ keys are refused (crds.validate)
    meta = pod["metadata"]
    labels = meta["labels"]
    assert labels["llmfleet.io/deployment"] == "smollm2"
    assert labels["llmfleet.io/variant"] == "default"
    assert len(labels["llmfleet.io/revision"]) == 10 and labels["team"] == "a"
    assert meta["name"] == f"smollm2-default-{labels['llmfleet.io/revision']}-0"
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "llmfleet.io/v1alpha1",
            "kind": "InferenceDeployment",
            "name": "smollm2",
            "uid": kit.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def test_template_placement_and_extra_pod_fields(kit):
    pod = _pod(
        kit,
        {
            "template": {
                "image": "example.com/worker:1",
                "imagePullPolicy": "IfNotPresent",
                "nodeSelector": {"gpu": "h100"},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "serviceAccountName": "workers",
                "env": [{"name": "LOG", "value": "debug"}],
                "podSpec": {"runtimeClassName": "nvidia", "volumes": [{"name": "extra", "emptyDir": {}}]},
            }
        },
    )
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"gpu": "h100"}
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["serviceAccountName"] == "workers" and spec["runtimeClassName"] == "nvidia"
    assert {v["name"] for v in spec["volumes"]} >= {"extra", "tmp"}
    container = _container(pod)
    assert (container["image"], container["imagePullPolicy"]) == ("example.com/worker:1", "IfNotPresent")
    assert {"name": "LOG", "value": "debug"} in container["env"]


def test_allow_listed_pod_fields_and_mounts_reach_the_pod_and_the_operator_fields_win(kit):
    extras = {
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
        "schedulerName": "gpu-scheduler",
        "imagePullSecrets": [{"name": "registry"}],
        "dnsPolicy": "None",
        "dnsConfig": {"nameservers": ["10.0.0.10"]},
        "volumes": [
            {"name": "templates", "configMap": {"name": "chat", "defaultMode": 0o440}},
            {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        ],
    }
    mounts = [{"name": "templates", "mountPath": "/etc/templates", "readOnly": True}]
    pod = _pod(kit, {"template": {"podSpec": extras, "volumeMounts": mounts}})
    spec = pod["spec"]
    for key in ("affinity", "topologySpreadConstraints", "schedulerName", "imagePullSecrets", "dnsPolicy", "dnsConfig"):
        assert spec[key] == extras[key], key
    assert [v["name"] for v in spec["volumes"]][:2] == ["templates", "scratch"]
    assert spec["volumes"][0] == {"name": "templates", "configMap": {"name": "chat", "defaultMode": 0o440}}
    assert {"name": "tmp", "emptyDir": {}} in spec["volumes"]
    assert mounts[0] in _container(pod)["volumeMounts"]
    assert {"name": "tmp", "mountPath": "/tmp"} in _container(pod)["volumeMounts"]
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
    assert not {"hostNetwork", "hostPID", "hostIPC", "nodeName", "initContainers"} & set(spec)


def test_pvc_sources_are_mounted_read_only(kit):
    pod = _pod(kit, {"model": {"name": "llama", "source": "pvc://weights/llama-8b"}})
    container = _container(pod)
    assert _flag(container["args"], "--model") == "/models/weights/llama-8b"
    assert {"name": "model", "mountPath": "/models/weights", "readOnly": True} in container["volumeMounts"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("bundled://x", "bundled://x"),
        ("hf://org/repo", "hf://org/repo"),
        ("/data/m", "/data/m"),
        ("pvc://claim", "/models/claim"),
        ("pvc://claim/a/b", "/models/claim/a/b"),
    ],
)
def test_model_path(source, expected):
    assert model_path(source) == expected


@pytest.mark.parametrize(
    ("extra", "argv"),
    [
        ({"b": 1, "a": "x"}, ["--a", "x", "--b", "1"]),
        ({"flag": True, "off": False, "none": None}, ["--flag"]),
        ({"--dashed": 2}, ["--dashed", "2"]),
        ({"rep": [1, "two"]}, ["--rep", "1", "--rep", "two"]),
        ({"cfg": {"b": 1, "a": 2}}, ["--cfg", '{"a":2,"b":1}']),
    ],
)
def test_extra_engine_args(extra, argv):
    assert extra_engine_args(extra) == argv


def test_operator_extra_args_come_last():
    spec = parse_spec({"model": {"name": "m", "source": "/m"}, "variants": [{"name": "v"}]})
    template = pod_template("m", spec, spec.variants[0], PodDefaults(extra_args=("--engine", "fake")))
    assert template["spec"]["containers"][0]["args"][-2:] == ["--engine", "fake"]


def test_service_selects_the_workers(kit):
    meta = kit.resource()["metadata"]
    service = service_manifest(meta, PodDefaults())
    assert service["metadata"]["name"] == "smollm2-workers"
    assert service["spec"]["selector"] == {"llmfleet.io/deployment": "smollm2"}
    assert service["spec"]["clusterIP"] == "None"
    assert service_matches(service, service)
    drifted = json.loads(json.dumps(service))
    drifted["spec"]["selector"] = {"app": "x"}
    assert not service_matches(drifted, service)


class _DrainStub(BaseHTTPRequestHandler):
    """Answers like a worker: POST /drain starts a drain, GET /drain counts in-flight requests down to zero."""

    posts: list[str | None]
    inflight: list[int]

    def do_POST(self):
        self.posts.append(self.headers.get("Authorization"))
        self._answer(202, {"draining": True, "inflight": self.inflight[0]})

    def do_GET(self):
        self.inflight[0] = max(0, self.inflight[0] - 1)
        self._answer(200, {"draining": True, "inflight": self.inflight[0]})

    def _answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_prestop_script_drains_with_the_token_and_waits_for_in_flight():
    handler = type("Handler", (_DrainStub,), {"posts": [], "inflight": [2]})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        script = prestop_script(server.server_address[1], timeout_seconds=20)
        env = {"POD_IP": "127.0.0.1", "LLMFLEET_DRAIN_TOKEN": "s3cret"}
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert handler.posts == ["Bearer s3cret"]
    assert handler.inflight == [0]  # it polled until nothing was in flight


def test_prestop_script_ends_quietly_when_the_worker_is_gone():
    script = prestop_script(1, timeout_seconds=5)  # nothing listens on port 1
    result = subprocess.run([sys.executable, "-c", script], env={"POD_IP": "127.0.0.1"}, timeout=30)
    assert result.returncode == 0


@pytest.mark.parametrize(
    "resources,template_env,expected",
    [
        ({"cpu": "2"}, [], "2"),
        ({"cpu": "1500m"}, [], "2"),
        ({"cpu": "250m"}, [], "1"),
        ({}, [], None),
        ({"cpu": "4"}, [{"name": "OMP_NUM_THREADS", "value": "1"}], "1"),  # the user's own setting wins
    ],
)
def test_worker_threads_follow_the_cpu_request(kit, resources, template_env, expected):
    pod = _pod(
        kit,
        {
            "model": {"name": "m", "source": "bundled://smollm2-135m-instruct"},
            "variants": [{"name": "default", "resources": resources}],
            "template": {"env": template_env},
        },
    )
    env = [e for e in _container(pod)["env"] if e["name"] == "OMP_NUM_THREADS"]
    assert [e["value"] for e in env] == ([] if expected is None else [expected])
