"""The built-in kinds localkube serves, with the defaults, validation and table columns a real API server has.

Served: namespaces, nodes, pods (+status, log, binding, eviction), services (+status), endpoints, configmaps,
secrets, serviceaccounts, events (core v1 and events.k8s.io/v1 over one storage), leases, poddisruptionbudgets
(+status), networkpolicies, endpointslices and customresourcedefinitions (+status, see ``custom``).

NetworkPolicies are stored, defaulted and validated like a real API server does, but nothing enforces them: the
process kubelet runs every pod on a loopback address of this host, where any local process can connect.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from dataclasses import dataclass, field

from localkube.errors import Cause, forbidden, invalid_value, not_supported, required_value
from localkube.meta import age, clone, parse_time, rfc3339, validate_dns1035_label, validate_dns_label
from localkube.registry import ResourceType
from localkube.strategy import AGE_COLUMN, BASE_FIELD_SELECTORS, NAME_COLUMN, Column, Strategy, StrategyContext

_KEY_RE = re.compile(r"^[-._a-zA-Z0-9]+$")
SERVICE_CIDR = ipaddress.ip_network("10.96.0.0/16")


def _none(value) -> str:
    return "<none>" if value in (None, "", []) else str(value)


# ---------------------------------------------------------------------------------------------------- namespace


@dataclass
class NamespaceStrategy(Strategy):
    status_subresource: bool = True
    field_selectors: frozenset[str] = field(default=BASE_FIELD_SELECTORS | {"status.phase"})

    def validate_name(self, name: str) -> list[Cause]:
        return validate_dns_label("metadata.name", name)

    def prepare_create(self, obj, core):
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj["status"] = {"phase": "Active"}
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]

    def prepare_update(self, new, old, core):
        super().prepare_update(new, old, core)
        new["spec"] = clone(old.get("spec", {}))  # spec.finalizers only change through /finalize
        new["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = old["metadata"]["name"]

    def prepare_subresource_update(self, sub: str, new: dict, old: dict) -> dict:
        result = clone(old)
        result.setdefault("spec", {})["finalizers"] = list((new.get("spec") or {}).get("finalizers") or [])
        return result

    def holds_deletion(self, obj: dict) -> bool:
        return bool((obj.get("spec") or {}).get("finalizers"))

    def begin_deletion(self, obj: dict) -> None:
        obj.setdefault("status", {})["phase"] = "Terminating"

    def columns(self):
        return [NAME_COLUMN, Column("Status", description="The status of the namespace"), AGE_COLUMN]

    def cells(self, obj, now):
        return [
            obj["metadata"]["name"],
            (obj.get("status") or {}).get("phase", ""),
            age(obj["metadata"].get("creationTimestamp"), now),
        ]


# --------------------------------------------------------------------------------------------------------- node


@dataclass
class NodeStrategy(Strategy):
    status_subresource: bool = True
    field_selectors: frozenset[str] = field(default=BASE_FIELD_SELECTORS | {"spec.unschedulable"})

    def prepare_create(self, obj, core):
        pass  # nodes may set status on create

    def columns(self):
        return [
            NAME_COLUMN,
            Column("Status"),
            Column("Roles"),
            AGE_COLUMN,
            Column("Version"),
            Column("Internal-IP", priority=1),
            Column("External-IP", priority=1),
            Column("OS-Image", priority=1),
            Column("Kernel-Version", priority=1),
            Column("Container-Runtime", priority=1),
        ]

    def cells(self, obj, now):
        status = obj.get("status") or {}
        ready: dict = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        state = "Ready" if ready.get("status") == "True" else "NotReady"
        if (obj.get("spec") or {}).get("unschedulable"):
            state += ",SchedulingDisabled"
        roles = sorted(
            k.split("/", 1)[1]
            for k in (obj["metadata"].get("labels") or {})
            if k.startswith("node-role.kubernetes.io/")
        )
        info = status.get("nodeInfo") or {}
        internal = next(
            (a["address"] for a in status.get("addresses") or [] if a.get("type") == "InternalIP"), "<none>"
        )
        return [
            obj["metadata"]["name"],
            state,
            ",".join(roles) or "<none>",
            age(obj["metadata"].get("creationTimestamp"), now),
            info.get("kubeletVersion", ""),
            internal,
            "<none>",
            info.get("osImage", ""),
            info.get("kernelVersion", ""),
            info.get("containerRuntimeVersion", ""),
        ]


# ---------------------------------------------------------------------------------------------------------- pod

_POD_MUTABLE_SPEC = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds", "schedulingGates")


def _default_probe(probe: dict | None) -> None:
    if not isinstance(probe, dict):
        return
    probe.setdefault("timeoutSeconds", 1)
    probe.setdefault("periodSeconds", 10)
    probe.setdefault("successThreshold", 1)
    probe.setdefault("failureThreshold", 3)
    if isinstance(probe.get("httpGet"), dict):
        probe["httpGet"].setdefault("scheme", "HTTP")
        probe["httpGet"].setdefault("path", "/")


def _default_container(c: dict) -> None:
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    image = c.get("image", "")
    if "imagePullPolicy" not in c:
        c["imagePullPolicy"] = (
            "Always"
            if image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")) and "@" not in image
            else "IfNotPresent"
        )
    c.setdefault("resources", {})
    for port in c.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
    for name in ("readinessProbe", "livenessProbe", "startupProbe"):
        _default_probe(c.get(name))


def _qos(spec: dict) -> str:
    containers = spec.get("containers") or []
    requests = [c.get("resources", {}).get("requests") or {} for c in containers]
    limits = [c.get("resources", {}).get("limits") or {} for c in containers]
    if not any(requests) and not any(limits):
        return "BestEffort"
    guaranteed = all(
        lim.get("cpu")
        and lim.get("memory")
        and req.get("cpu", lim.get("cpu")) == lim.get("cpu")
        and req.get("memory", lim.get("memory")) == lim.get("memory")
        for req, lim in zip(requests, limits)
    )
    return "Guaranteed" if guaranteed else "Burstable"


def _validate_probe(path: str, probe, ports: set) -> list[Cause]:
    if probe is None:
        return []
    if not isinstance(probe, dict):
        return [invalid_value(path, probe, "must be an object")]
    handlers = [k for k in ("httpGet", "tcpSocket", "exec", "grpc") if k in probe]
    causes = []
    if len(handlers) != 1:
        causes.append(
            required_value(path, "must specify a handler type")
            if not handlers
            else forbidden(path, "may not specify more than 1 handler type")
        )
    for key in ("initialDelaySeconds", "timeoutSeconds", "periodSeconds", "successThreshold", "failureThreshold"):
        value = probe.get(key)
        if value is not None and (not isinstance(value, int) or value < 0):
            causes.append(invalid_value(f"{path}.{key}", value, "must be greater than or equal to 0"))
    for kind in ("httpGet", "tcpSocket"):
        if kind in probe:
            port = (probe[kind] or {}).get("port")
            if port is None:
                causes.append(required_value(f"{path}.{kind}.port"))
            elif isinstance(port, str) and not port.isdigit() and port not in ports:
                causes.append(invalid_value(f"{path}.{kind}.port", port, "must contain at least one port definition"))
    return causes


@dataclass
class PodStrategy(Strategy):
    has_generation: bool = True
    status_subresource: bool = True
    field_selectors: frozenset[str] = field(
        default=BASE_FIELD_SELECTORS
        | {
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.podIPs",
            "status.nominatedNodeName",
        }
    )

    def prepare_create(self, obj, core):
        spec = obj.setdefault("spec", {})
        self._default_spec(spec)
        spec.setdefault(
            "tolerations",
            [
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
                {
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
            ],
        )
        obj["status"] = {"phase": "Pending", "qosClass": _qos(spec)}

    def prepare_update(self, new, old, core):
        super().prepare_update(new, old, core)
        if isinstance(new.get("spec"), dict):
            self._default_spec(new["spec"])  # defaults apply to every write, so a replace equals the stored spec

    @staticmethod
    def _default_spec(spec: dict) -> None:
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("securityContext", {})
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("enableServiceLinks", True)
        spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
        spec.setdefault("priority", 0)
        if spec.get("serviceAccountName") or spec.get("serviceAccount"):
            spec.setdefault("serviceAccountName", spec.get("serviceAccount"))
        else:
            spec["serviceAccountName"] = "default"
        spec["serviceAccount"] = spec["serviceAccountName"]
        for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
            if isinstance(c, dict):
                _default_container(c)

    def validate(self, obj, old, core):
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            return [required_value("spec")]
        causes: list[Cause] = []
        if old is not None:
            return self._validate_update(obj, old)
        containers = spec.get("containers")
        if not containers or not isinstance(containers, list):
            causes.append(required_value("spec.containers"))
            containers = []
        names: set[str] = set()
        for kind, items in (("containers", containers), ("initContainers", spec.get("initContainers") or [])):
            for n, c in enumerate(items):
                path = f"spec.{kind}[{n}]"
                if not isinstance(c, dict):
                    causes.append(invalid_value(path, c, "must be an object"))
                    continue
                if not c.get("name"):
                    causes.append(required_value(f"{path}.name"))
                else:
                    causes += validate_dns_label(f"{path}.name", c["name"])
                    if c["name"] in names:
                        causes.append(Cause(f"{path}.name", "FieldValueDuplicate", f'Duplicate value: "{c["name"]}"'))
                    names.add(c["name"])
                if not c.get("image"):
                    causes.append(required_value(f"{path}.image"))
                port_names = {p.get("name") for p in c.get("ports") or [] if isinstance(p, dict) and p.get("name")}
                for m, port in enumerate(c.get("ports") or []):
                    cp = port.get("containerPort") if isinstance(port, dict) else None
                    if not isinstance(cp, int) or not 0 < cp < 65536:
                        causes.append(
                            invalid_value(
                                f"{path}.ports[{m}].containerPort", cp, "must be between 1 and 65535, inclusive"
                            )
                        )
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    causes += _validate_probe(f"{path}.{probe}", c.get(probe), port_names)
                for m, env in enumerate(c.get("env") or []):
                    if not isinstance(env, dict) or not env.get("name"):
                        causes.append(required_value(f"{path}.env[{m}].name"))
        policy = spec.get("restartPolicy")
        if policy not in ("Always", "OnFailure", "Never"):
            causes.append(not_supported("spec.restartPolicy", policy, ["Always", "OnFailure", "Never"]))
        grace = spec.get("terminationGracePeriodSeconds")
        if not isinstance(grace, int) or grace < 0:
            causes.append(
                invalid_value("spec.terminationGracePeriodSeconds", grace, "must be greater than or equal to 0")
            )
        return causes

    def _validate_update(self, obj, old) -> list[Cause]:
        new_spec = clone(obj.get("spec") or {})
        old_spec = clone(old.get("spec") or {})
        for key in _POD_MUTABLE_SPEC:
            new_spec.pop(key, None)
            old_spec.pop(key, None)
        for spec in (new_spec, old_spec):
            for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
                if isinstance(c, dict):
                    c.pop("image", None)
        if new_spec != old_spec:
            return [
                forbidden(
                    "spec",
                    "pod updates may not change fields other than `spec.containers[*].image`,"
                    "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
                    "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
                    "(allow it to be set to 1 if it was previously negative)",
                )
            ]
        return []

    def grace_period(self, obj, requested):
        spec = obj.get("spec") or {}
        phase = (obj.get("status") or {}).get("phase")
        if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
            return 0
        if requested is not None:
            return max(requested, 0) if requested >= 0 else 1
        return int(spec.get("terminationGracePeriodSeconds", 30))

    def columns(self):
        return [
            NAME_COLUMN,
            Column("Ready", description="The aggregate readiness state of this pod for accepting traffic."),
            Column("Status", description="The aggregate status of the containers in this pod."),
            Column(
                "Restarts",
                description="The number of times the containers in this pod have been restarted and when the last container in this pod has restarted.",
            ),
            AGE_COLUMN,
            Column("IP", priority=1, description="IP address assigned to the pod"),
            Column("Node", priority=1, description="Name of the Node this pod is assigned to"),
            Column("Nominated Node", priority=1, description="Name of the Node where this pod is nominated to run"),
            Column("Readiness Gates", priority=1, description="Readiness gates of this pod"),
        ]

    def cells(self, obj, now):
        status = obj.get("status") or {}
        spec = obj.get("spec") or {}
        statuses = status.get("containerStatuses") or []
        total = len(spec.get("containers") or [])
        ready = sum(1 for s in statuses if s.get("ready"))
        restarts = sum(int(s.get("restartCount") or 0) for s in statuses)
        last_restart = None
        for s in statuses:
            finished = parse_time(((s.get("lastState") or {}).get("terminated") or {}).get("finishedAt"))
            if finished and (last_restart is None or finished > last_restart):
                last_restart = finished
        restarts_text = str(restarts)
        if restarts and last_restart is not None:
            restarts_text = f"{restarts} ({age(rfc3339(last_restart), now)} ago)"
        gates = [g.get("conditionType") for g in spec.get("readinessGates") or []]
        open_gates = sum(
            1 for c in status.get("conditions") or [] if c.get("type") in gates and c.get("status") == "True"
        )
        return [
            obj["metadata"]["name"],
            f"{ready}/{total}",
            pod_status_reason(obj),
            restarts_text,
            age(obj["metadata"].get("creationTimestamp"), now),
            _none(status.get("podIP")),
            _none(spec.get("nodeName")),
            _none(status.get("nominatedNodeName")),
            "<none>" if not gates else f"{open_gates}/{len(gates)}",
        ]


def pod_status_reason(pod: dict) -> str:
    """What ``kubectl get pods`` prints in STATUS (kubectl's printPod logic, without sidecars)."""
    status = pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or "Pending"
    initializing = False
    for n, s in enumerate(status.get("initContainerStatuses") or []):
        state = s.get("state") or {}
        term = state.get("terminated")
        if term and term.get("exitCode") == 0:
            continue
        if term:
            reason = "Init:" + (term.get("reason") or f"ExitCode:{term.get('exitCode')}")
        elif (state.get("waiting") or {}).get("reason") and state["waiting"]["reason"] != "PodInitializing":
            reason = "Init:" + state["waiting"]["reason"]
        else:
            reason = f"Init:{n}/{len((pod.get('spec') or {}).get('initContainers') or [])}"
        initializing = True
        break
    if not initializing:
        has_running = False
        for s in reversed(status.get("containerStatuses") or []):
            state = s.get("state") or {}
            waiting, term = state.get("waiting"), state.get("terminated")
            if waiting and waiting.get("reason"):
                reason = waiting["reason"]
            elif term and term.get("reason"):
                reason = term["reason"]
            elif term:
                reason = f"Signal:{term['signal']}" if term.get("signal") else f"ExitCode:{term.get('exitCode')}"
            elif state.get("running") and s.get("ready"):
                has_running = True
        if reason == "Completed" and has_running:
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
            reason = "Running" if ready else "NotReady"
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        reason = "Terminating"
    return reason


# ------------------------------------------------------------------------------------------------------ service


@dataclass
class ServiceStrategy(Strategy):
    has_generation: bool = True
    status_subresource: bool = True
    field_selectors: frozenset[str] = field(default=BASE_FIELD_SELECTORS | {"spec.clusterIP", "spec.type"})

    def validate_name(self, name: str) -> list[Cause]:
        return validate_dns1035_label("metadata.name", name)

    def prepare_create(self, obj, core):
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        spec.setdefault("internalTrafficPolicy", "Cluster")
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        for port in spec.get("ports") or []:
            if isinstance(port, dict):
                port.setdefault("protocol", "TCP")
                if "port" in port:
                    port.setdefault("targetPort", port["port"])
        if spec["type"] != "ExternalName":
            if not spec.get("clusterIP"):
                spec["clusterIP"] = _allocate_cluster_ip(core)
            spec["clusterIPs"] = [spec["clusterIP"]]
        if spec["type"] in ("NodePort", "LoadBalancer"):
            spec.setdefault("externalTrafficPolicy", "Cluster")
            used = _used_node_ports(core)
            for port in spec.get("ports") or []:
                if isinstance(port, dict) and not port.get("nodePort"):
                    port["nodePort"] = next(p for p in range(30000, 32768) if p not in used)
                    used.add(port["nodePort"])
        obj["status"] = {"loadBalancer": {}}

    def prepare_update(self, new, old, core):
        super().prepare_update(new, old, core)
        spec, old_spec = new.setdefault("spec", {}), old.get("spec") or {}
        for key in (
            "clusterIP",
            "clusterIPs",
            "ipFamilies",
            "ipFamilyPolicy",
            "type",
            "sessionAffinity",
            "internalTrafficPolicy",
        ):
            if key not in spec and key in old_spec:
                spec[key] = clone(old_spec[key])
        old_ports = {p.get("port"): p for p in old_spec.get("ports") or [] if isinstance(p, dict)}
        for port in spec.get("ports") or []:
            if isinstance(port, dict):
                port.setdefault("protocol", "TCP")
                if "port" in port:
                    port.setdefault("targetPort", port["port"])
                    if old_ports.get(port["port"], {}).get("nodePort"):
                        port.setdefault("nodePort", old_ports[port["port"]]["nodePort"])

    def validate(self, obj, old, core):
        spec = obj.get("spec") or {}
        causes = []
        if spec.get("type") not in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"):
            causes.append(
                not_supported("spec.type", spec.get("type"), ["ClusterIP", "ExternalName", "LoadBalancer", "NodePort"])
            )
        ports = spec.get("ports") or []
        if not ports and spec.get("clusterIP") != "None" and spec.get("type") != "ExternalName":
            causes.append(required_value("spec.ports"))
        for n, port in enumerate(ports):
            if not isinstance(port, dict):
                causes.append(invalid_value(f"spec.ports[{n}]", port, "must be an object"))
                continue
            if not isinstance(port.get("port"), int) or not 0 < port["port"] < 65536:
                causes.append(
                    invalid_value(f"spec.ports[{n}].port", port.get("port"), "must be between 1 and 65535, inclusive")
                )
            if len(ports) > 1 and not port.get("name"):
                causes.append(required_value(f"spec.ports[{n}].name"))
        if old is not None:
            old_ip = (old.get("spec") or {}).get("clusterIP")
            if old_ip and spec.get("clusterIP") != old_ip:
                causes.append(invalid_value("spec.clusterIPs[0]", spec.get("clusterIP"), "may not change once set"))
        return causes

    def columns(self):
        return [
            NAME_COLUMN,
            Column("Type"),
            Column("Cluster-IP"),
            Column("External-IP"),
            Column("Port(s)"),
            AGE_COLUMN,
            Column("Selector", priority=1),
        ]

    def cells(self, obj, now):
        spec = obj.get("spec") or {}
        ports = []
        for p in spec.get("ports") or []:
            text = f"{p.get('port')}:{p['nodePort']}" if p.get("nodePort") else str(p.get("port"))
            ports.append(f"{text}/{p.get('protocol', 'TCP')}")
        external = "<none>"
        if spec.get("type") == "LoadBalancer":
            ingress = ((obj.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
            external = ",".join(i.get("ip") or i.get("hostname", "") for i in ingress) or "<pending>"
        elif spec.get("type") == "ExternalName":
            external = spec.get("externalName", "<none>")
        elif spec.get("externalIPs"):
            external = ",".join(spec["externalIPs"])
        selector = ",".join(f"{k}={v}" for k, v in sorted((spec.get("selector") or {}).items()))
        return [
            obj["metadata"]["name"],
            spec.get("type", ""),
            spec.get("clusterIP") or "<none>",
            external,
            ",".join(ports) or "<none>",
            age(obj["metadata"].get("creationTimestamp"), now),
            selector or "<none>",
        ]


def _allocate_cluster_ip(core: StrategyContext) -> str:
    used = {(s.get("spec") or {}).get("clusterIP") for s in core.store.list(("", "services"))}
    for host in SERVICE_CIDR.hosts():
        text = str(host)
        if text != "10.96.0.1" and text not in used:
            return text
    raise RuntimeError("service CIDR exhausted")


def _used_node_ports(core: StrategyContext) -> set[int]:
    return {
        int(p["nodePort"])
        for s in core.store.list(("", "services"))
        for p in (s.get("spec") or {}).get("ports") or []
        if isinstance(p, dict) and p.get("nodePort")
    }


# ----------------------------------------------------------------------------------------- configmap and secret


def _validate_keys(path: str, data) -> list[Cause]:
    causes: list[Cause] = []
    if data is None:
        return causes
    if not isinstance(data, dict):
        return [invalid_value(path, data, "must be a map")]
    for key in data:
        if not _KEY_RE.match(key) or len(key) > 253:
            causes.append(
                invalid_value(
                    path,
                    key,
                    "a valid config key must consist of alphanumeric characters, '-', '_' or '.' "
                    "(e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')",
                )
            )
    return causes


def _immutable_change(obj: dict, old: dict | None, keys: tuple[str, ...]) -> list[Cause]:
    if old is None or not old.get("immutable"):
        return []
    causes = []
    if any(obj.get(k) != old.get(k) for k in keys):
        causes.append(forbidden("data", "field is immutable when `immutable` is set"))
    if not obj.get("immutable"):
        causes.append(forbidden("immutable", "field is immutable when `immutable` is set"))
    return causes


@dataclass
class ConfigMapStrategy(Strategy):
    def validate(self, obj, old, core):
        causes = _validate_keys("data", obj.get("data")) + _validate_keys("binaryData", obj.get("binaryData"))
        for key, value in (obj.get("data") or {}).items():
            if not isinstance(value, str):
                causes.append(invalid_value(f"data[{key}]", value, "must be a string"))
        return causes + _immutable_change(obj, old, ("data", "binaryData"))

    def columns(self):
        return [NAME_COLUMN, Column("Data", type="integer"), AGE_COLUMN]

    def cells(self, obj, now):
        return [
            obj["metadata"]["name"],
            len(obj.get("data") or {}) + len(obj.get("binaryData") or {}),
            age(obj["metadata"].get("creationTimestamp"), now),
        ]


@dataclass
class SecretStrategy(Strategy):
    field_selectors: frozenset[str] = field(default=BASE_FIELD_SELECTORS | {"type"})

    def _fold_string_data(self, obj):
        string_data = obj.pop("stringData", None)
        if isinstance(string_data, dict):
            data = obj.setdefault("data", {})
            for key, value in string_data.items():
                data[key] = base64.b64encode(str(value).encode()).decode()

    def prepare_create(self, obj, core):
        obj.setdefault("type", "Opaque")
        self._fold_string_data(obj)

    def prepare_update(self, new, old, core):
        new.setdefault("type", old.get("type", "Opaque"))
        self._fold_string_data(new)

    def validate(self, obj, old, core):
        causes = _validate_keys("data", obj.get("data"))
        for key, value in (obj.get("data") or {}).items():
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, TypeError, ValueError):
                causes.append(invalid_value(f"data[{key}]", "<secret contents redacted>", "illegal base64 data"))
        if old is not None and old.get("type") != obj.get("type"):
            causes.append(invalid_value("type", obj.get("type"), "field is immutable"))
        return causes + _immutable_change(obj, old, ("data",))

    def columns(self):
        return [NAME_COLUMN, Column("Type"), Column("Data", type="integer"), AGE_COLUMN]

    def cells(self, obj, now):
        return [
            obj["metadata"]["name"],
            obj.get("type", ""),
            len(obj.get("data") or {}),
            age(obj["metadata"].get("creationTimestamp"), now),
        ]


# ----------------------------------------------------------------------------------------- endpoints and slices


@dataclass
class EndpointsStrategy(Strategy):
    def columns(self):
        return [NAME_COLUMN, Column("Endpoints"), AGE_COLUMN]

    def cells(self, obj, now):
        addresses = [
            f"{a.get('ip')}:{p.get('port')}"
            for s in obj.get("subsets") or []
            for p in (s.get("ports") or [{}])
            for a in s.get("addresses") or []
        ]
        text = ",".join(addresses[:3]) + (f" + {len(addresses) - 3} more..." if len(addresses) > 3 else "")
        return [obj["metadata"]["name"], text or "<none>", age(obj["metadata"].get("creationTimestamp"), now)]


@dataclass
class EndpointSliceStrategy(Strategy):
    def validate(self, obj, old, core):
        if obj.get("addressType") not in ("IPv4", "IPv6", "FQDN"):
            return [not_supported("addressType", obj.get("addressType"), ["FQDN", "IPv4", "IPv6"])]
        return []

    def columns(self):
        return [NAME_COLUMN, Column("AddressType"), Column("Ports"), Column("Endpoints"), AGE_COLUMN]

    def cells(self, obj, now):
        ports = ",".join(str(p.get("port")) for p in obj.get("ports") or []) or "<unset>"
        addresses = [a for e in obj.get("endpoints") or [] for a in e.get("addresses") or []]
        text = ",".join(addresses[:3]) + (f" + {len(addresses) - 3} more..." if len(addresses) > 3 else "")
        return [
            obj["metadata"]["name"],
            obj.get("addressType", ""),
            ports,
            text or "<unset>",
            age(obj["metadata"].get("creationTimestamp"), now),
        ]


# ------------------------------------------------------------------------------------------------------- events

_EVENT_SELECTORS = BASE_FIELD_SELECTORS | {
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
}
# events.k8s.io/v1 field <-> core/v1 field
_EVENT_RENAMES = (
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
    ("reportingController", "reportingComponent"),
)


@dataclass
class EventStrategy(Strategy):
    field_selectors: frozenset[str] = field(default=_EVENT_SELECTORS)

    def validate(self, obj, old, core):
        causes = []
        involved = obj.get("involvedObject")
        if not isinstance(involved, dict):
            causes.append(required_value("involvedObject"))
        elif involved.get("namespace") and involved["namespace"] != obj["metadata"].get("namespace"):
            causes.append(
                invalid_value("involvedObject.namespace", involved["namespace"], "does not match event.namespace")
            )
        if obj.get("type") not in (None, "", "Normal", "Warning"):
            causes.append(not_supported("type", obj.get("type"), ["Normal", "Warning"]))
        return causes

    def columns(self):
        return [
            Column("Last Seen"),
            Column("Type"),
            Column("Reason"),
            Column("Object"),
            Column("Subobject", priority=1),
            Column("Source", priority=1),
            Column("Message"),
            Column("First Seen", priority=1),
            Column("Count", priority=1),
            Column("Name", priority=1),
        ]

    def cells(self, obj, now):
        involved = obj.get("involvedObject") or {}
        last = (
            obj.get("lastTimestamp")
            or (obj.get("series") or {}).get("lastObservedTime")
            or obj.get("eventTime")
            or obj["metadata"].get("creationTimestamp")
        )
        first = obj.get("firstTimestamp") or obj.get("eventTime") or obj["metadata"].get("creationTimestamp")
        source = obj.get("source") or {}
        source_text = source.get("component") or obj.get("reportingComponent") or ""
        if source.get("host"):
            source_text += f", {source['host']}"
        return [
            age(last, now),
            obj.get("type", ""),
            obj.get("reason", ""),
            f"{(involved.get('kind') or '').lower()}/{involved.get('name', '')}",
            involved.get("fieldPath", ""),
            source_text,
            obj.get("message", ""),
            age(first, now),
            int(obj.get("count") or 1),
            obj["metadata"]["name"],
        ]


@dataclass
class EventsV1Strategy(EventStrategy):
    """events.k8s.io/v1: the same objects as core v1 events with renamed fields."""

    field_selectors: frozenset[str] = field(
        default=BASE_FIELD_SELECTORS
        | {
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "regarding.apiVersion",
            "regarding.resourceVersion",
            "regarding.fieldPath",
            "reason",
            "reportingController",
            "type",
        }
    )

    def to_external(self, obj, api_version):
        out = dict(obj.items())
        out["apiVersion"] = api_version
        for v1_name, core_name in _EVENT_RENAMES:
            if core_name in out:
                out[v1_name] = out.pop(core_name)
        out.pop("involvedObject", None)
        return out

    def to_internal(self, obj, storage_api_version):
        for v1_name, core_name in _EVENT_RENAMES:
            if v1_name in obj:
                obj[core_name] = obj.pop(v1_name)
        obj["apiVersion"] = storage_api_version
        return obj


# ------------------------------------------------------------------------------------------------------ leases


@dataclass
class LeaseStrategy(Strategy):
    def columns(self):
        return [NAME_COLUMN, Column("Holder"), AGE_COLUMN]

    def cells(self, obj, now):
        return [
            obj["metadata"]["name"],
            (obj.get("spec") or {}).get("holderIdentity", ""),
            age(obj["metadata"].get("creationTimestamp"), now),
        ]


@dataclass
class ServiceAccountStrategy(Strategy):
    def columns(self):
        return [NAME_COLUMN, Column("Secrets", type="integer"), AGE_COLUMN]

    def cells(self, obj, now):
        return [
            obj["metadata"]["name"],
            len(obj.get("secrets") or []),
            age(obj["metadata"].get("creationTimestamp"), now),
        ]


@dataclass
class PodDisruptionBudgetStrategy(Strategy):
    has_generation: bool = True
    status_subresource: bool = True

    def prepare_create(self, obj, core):
        obj["status"] = {"disruptionsAllowed": 0, "currentHealthy": 0, "desiredHealthy": 0, "expectedPods": 0}

    def validate(self, obj, old, core):
        spec = obj.get("spec") or {}
        if "minAvailable" in spec and "maxUnavailable" in spec:
            return [invalid_value("spec", spec, "minAvailable and maxUnavailable cannot be both set")]
        return []

    def columns(self):
        return [
            NAME_COLUMN,
            Column("Min Available"),
            Column("Max Unavailable"),
            Column("Allowed Disruptions", type="integer"),
            AGE_COLUMN,
        ]

    def cells(self, obj, now):
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        return [
            obj["metadata"]["name"],
            _none(spec.get("minAvailable")).replace("<none>", "N/A"),
            _none(spec.get("maxUnavailable")).replace("<none>", "N/A"),
            int(status.get("disruptionsAllowed") or 0),
            age(obj["metadata"].get("creationTimestamp"), now),
        ]


_POLICY_TYPES = ("Ingress", "Egress")
_PROTOCOLS = ("TCP", "UDP", "SCTP")


@dataclass
class NetworkPolicyStrategy(Strategy):
    """networking.k8s.io/v1 NetworkPolicy: the API server's defaults (port protocol TCP; policyTypes from the rules)
    and its basic validation. Storage only: localkube enforces no network policy."""

    has_generation: bool = True

    def prepare_create(self, obj, core):
        self._default(obj)

    def prepare_update(self, new, old, core):
        super().prepare_update(new, old, core)
        self._default(new)

    @staticmethod
    def _default(obj):
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            return
        for direction in ("ingress", "egress"):
            for rule in spec.get(direction) or []:
                for port in (rule.get("ports") or []) if isinstance(rule, dict) else []:
                    if isinstance(port, dict):
                        port.setdefault("protocol", "TCP")
        if not spec.get("policyTypes"):
            spec["policyTypes"] = ["Ingress", "Egress"] if spec.get("egress") else ["Ingress"]

    def validate(self, obj, old, core):
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            return [required_value("spec", "")]
        causes = []
        if not isinstance(spec.get("podSelector"), dict):
            causes.append(required_value("spec.podSelector", ""))
        for i, kind in enumerate(spec.get("policyTypes") or []):
            if kind not in _POLICY_TYPES:
                causes.append(not_supported(f"spec.policyTypes[{i}]", kind, list(_POLICY_TYPES)))
        for direction in ("ingress", "egress"):
            for i, rule in enumerate(spec.get(direction) or []):
                for j, port in enumerate((rule or {}).get("ports") or []):
                    where = f"spec.{direction}[{i}].ports[{j}]"
                    if (port or {}).get("protocol") not in _PROTOCOLS:
                        causes.append(
                            not_supported(f"{where}.protocol", (port or {}).get("protocol"), list(_PROTOCOLS))
                        )
                    number = (port or {}).get("port")
                    if isinstance(number, int) and not 1 <= number <= 65535:
                        causes.append(invalid_value(f"{where}.port", number, "must be between 1 and 65535, inclusive"))
        return causes

    def columns(self):
        return [NAME_COLUMN, Column("Pod-Selector"), AGE_COLUMN]

    def cells(self, obj, now):
        labels = ((obj.get("spec") or {}).get("podSelector") or {}).get("matchLabels") or {}
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        return [obj["metadata"]["name"], selector or "<none>", age(obj["metadata"].get("creationTimestamp"), now)]


@dataclass
class AccessReviewStrategy(Strategy):
    """SelfSubjectAccessReview / SubjectAccessReview: localkube has no authorization, so everything is allowed."""

    virtual: bool = True

    def respond(self, obj):
        out = clone(obj)
        out.setdefault("metadata", {})
        out["status"] = {"allowed": True, "reason": "localkube does not authorize requests: everything is allowed"}
        return out


# ----------------------------------------------------------------------------------------------------- catalog


def builtin_types(crd_strategy: Strategy) -> list[ResourceType]:
    """Every built-in type, in the order discovery lists their groups."""
    core = [
        ResourceType(
            "",
            "v1",
            "namespaces",
            "namespace",
            "Namespace",
            False,
            NamespaceStrategy(),
            ("ns",),
            subresources={"status": ("get", "patch", "update"), "finalize": ("update",)},
            verbs=("create", "delete", "get", "list", "patch", "update", "watch"),
        ),
        ResourceType(
            "",
            "v1",
            "nodes",
            "node",
            "Node",
            False,
            NodeStrategy(),
            ("no",),
            subresources={"status": ("get", "patch", "update")},
        ),
        ResourceType(
            "",
            "v1",
            "pods",
            "pod",
            "Pod",
            True,
            PodStrategy(),
            ("po",),
            ("all",),
            subresources={
                "status": ("get", "patch", "update"),
                "log": ("get",),
                "binding": ("create",),
                "eviction": ("create",),
            },
        ),
        ResourceType(
            "",
            "v1",
            "services",
            "service",
            "Service",
            True,
            ServiceStrategy(),
            ("svc",),
            ("all",),
            subresources={"status": ("get", "patch", "update")},
            verbs=("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"),
        ),
        ResourceType("", "v1", "endpoints", "endpoints", "Endpoints", True, EndpointsStrategy(), ("ep",)),
        ResourceType("", "v1", "configmaps", "configmap", "ConfigMap", True, ConfigMapStrategy(), ("cm",)),
        ResourceType("", "v1", "secrets", "secret", "Secret", True, SecretStrategy()),
        ResourceType(
            "", "v1", "serviceaccounts", "serviceaccount", "ServiceAccount", True, ServiceAccountStrategy(), ("sa",)
        ),
        ResourceType("", "v1", "events", "event", "Event", True, EventStrategy(), ("ev",)),
    ]
    others = [
        ResourceType(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "customresourcedefinition",
            "CustomResourceDefinition",
            False,
            crd_strategy,
            ("crd", "crds"),
            ("api-extensions",),
            subresources={"status": ("get", "patch", "update")},
        ),
        ResourceType("coordination.k8s.io", "v1", "leases", "lease", "Lease", True, LeaseStrategy()),
        ResourceType(
            "policy",
            "v1",
            "poddisruptionbudgets",
            "poddisruptionbudget",
            "PodDisruptionBudget",
            True,
            PodDisruptionBudgetStrategy(),
            ("pdb",),
            subresources={"status": ("get", "patch", "update")},
        ),
        ResourceType(
            "networking.k8s.io",
            "v1",
            "networkpolicies",
            "networkpolicy",
            "NetworkPolicy",
            True,
            NetworkPolicyStrategy(),
            ("netpol",),
        ),
        ResourceType(
            "events.k8s.io",
            "v1",
            "events",
            "event",
            "Event",
            True,
            EventsV1Strategy(),
            ("ev",),
            storage=("", "events"),
            storage_version="v1",
        ),
        ResourceType(
            "discovery.k8s.io", "v1", "endpointslices", "endpointslice", "EndpointSlice", True, EndpointSliceStrategy()
        ),
        ResourceType(
            "authorization.k8s.io",
            "v1",
            "selfsubjectaccessreviews",
            "",
            "SelfSubjectAccessReview",
            False,
            AccessReviewStrategy(),
            verbs=("create",),
        ),
        ResourceType(
            "authorization.k8s.io",
            "v1",
            "subjectaccessreviews",
            "",
            "SubjectAccessReview",
            False,
            AccessReviewStrategy(),
            verbs=("create",),
        ),
    ]
    return core + others
