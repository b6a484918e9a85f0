"""Decoding the few protobuf request bodies kubectl's typed commands send.

``kubectl create configmap|secret|namespace|serviceaccount`` and ``kubectl auth can-i`` encode their object as
Kubernetes protobuf (``k8s\\x00`` + ``runtime.Unknown``). localkube answers in JSON, which kubectl accepts, but it
has to read these bodies; other kinds stay 415 Unsupported Media Type. Field numbers follow k8s.io/api's
``generated.proto``.
"""

from __future__ import annotations

import base64
import datetime as dt

from localkube.errors import ApiError, unsupported_media_type
from localkube.meta import rfc3339

MAGIC = b"k8s\x00"
PROTOBUF = "application/vnd.kubernetes.protobuf"

_TIME = {1: ("seconds", "int"), 2: ("nanos", "int")}
_OWNER_REF = {
    1: ("kind", "string"),
    3: ("name", "string"),
    4: ("uid", "string"),
    5: ("apiVersion", "string"),
    6: ("controller", "bool"),
    7: ("blockOwnerDeletion", "bool"),
}
_OBJECT_META = {
    1: ("name", "string"),
    2: ("generateName", "string"),
    3: ("namespace", "string"),
    5: ("uid", "string"),
    6: ("resourceVersion", "string"),
    7: ("generation", "int"),
    8: ("creationTimestamp", "time"),
    11: ("labels", "map_ss"),
    12: ("annotations", "map_ss"),
    13: ("ownerReferences", "messages", _OWNER_REF),
    14: ("finalizers", "strings"),
}
_META = (1, ("metadata", "message", _OBJECT_META))
_RESOURCE_ATTRIBUTES = {
    1: ("namespace", "string"),
    2: ("verb", "string"),
    3: ("group", "string"),
    4: ("version", "string"),
    5: ("resource", "string"),
    6: ("subresource", "string"),
    7: ("name", "string"),
}
_NON_RESOURCE_ATTRIBUTES = {1: ("path", "string"), 2: ("verb", "string")}

_INT_OR_STRING = {1: ("type", "int"), 2: ("intVal", "int"), 3: ("strVal", "string")}
_SERVICE_PORT = {
    1: ("name", "string"),
    2: ("protocol", "string"),
    3: ("port", "int"),
    4: ("targetPort", "intorstr"),
    5: ("nodePort", "int"),
    6: ("appProtocol", "string"),
}
_SERVICE_SPEC = {
    1: ("ports", "messages", _SERVICE_PORT),
    2: ("selector", "map_ss"),
    3: ("clusterIP", "string"),
    4: ("type", "string"),
    5: ("externalIPs", "strings"),
    7: ("sessionAffinity", "string"),
    10: ("externalName", "string"),
}

SCHEMAS: dict[tuple[str, str], dict] = {
    ("v1", "Service"): dict([_META, (2, ("spec", "message", _SERVICE_SPEC))]),
    ("v1", "ConfigMap"): dict(
        [_META, (2, ("data", "map_ss")), (3, ("binaryData", "map_sb")), (4, ("immutable", "bool"))]
    ),
    ("v1", "Secret"): dict(
        [
            _META,
            (2, ("data", "map_sb")),
            (3, ("type", "string")),
            (4, ("stringData", "map_ss")),
            (5, ("immutable", "bool")),
        ]
    ),
    ("v1", "Namespace"): dict([_META, (2, ("spec", "message", {1: ("finalizers", "strings")}))]),
    ("v1", "ServiceAccount"): dict(
        [
            _META,
            (3, ("imagePullSecrets", "messages", {1: ("name", "string")})),
            (4, ("automountServiceAccountToken", "bool")),
        ]
    ),
    ("authorization.k8s.io/v1", "SelfSubjectAccessReview"): dict(
        [
            _META,
            (
                2,
                (
                    "spec",
                    "message",
                    {
                        1: ("resourceAttributes", "message", _RESOURCE_ATTRIBUTES),
                        2: ("nonResourceAttributes", "message", _NON_RESOURCE_ATTRIBUTES),
                    },
                ),
            ),
        ]
    ),
}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def varint(self) -> int:
        shift = result = 0
        while True:
            if self.pos >= len(self.data):
                raise ValueError("truncated varint")
            byte = self.data[self.pos]
            self.pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7

    def fields(self):
        while self.pos < len(self.data):
            key = self.varint()
            number, wire = key >> 3, key & 7
            if wire == 0:
                yield number, self.varint()
            elif wire == 2:
                size = self.varint()
                value = self.data[self.pos : self.pos + size]
                if len(value) != size:
                    raise ValueError("truncated field")
                self.pos += size
                yield number, value
            elif wire == 1:
                self.pos += 8
            elif wire == 5:
                self.pos += 4
            else:
                raise ValueError(f"unsupported wire type {wire}")


def _decode(data: bytes, schema: dict) -> dict:
    out: dict = {}
    for number, value in _Reader(data).fields():
        if number not in schema:
            continue
        name, kind, *sub = schema[number]
        if kind == "string":
            if value:  # Go's JSON omits empty strings; protobuf sends them
                out[name] = value.decode()
        elif kind == "int":
            if value:
                out[name] = value
        elif kind == "intorstr":
            union = _decode(value, _INT_OR_STRING)
            out[name] = union.get("strVal", "") if union.get("type") == 1 else union.get("intVal", 0)
        elif kind == "bool":
            out[name] = bool(value)
        elif kind == "message":
            out[name] = _decode(value, sub[0])
        elif kind == "messages":
            out.setdefault(name, []).append(_decode(value, sub[0]))
        elif kind == "strings":
            out.setdefault(name, []).append(value.decode())
        elif kind in ("map_ss", "map_sb"):
            entry = dict(_Reader(value).fields())
            raw = entry.get(2, b"")
            out.setdefault(name, {})[entry.get(1, b"").decode()] = (
                raw.decode() if kind == "map_ss" else base64.b64encode(raw).decode()
            )
        elif kind == "time":
            stamp = _decode(value, _TIME)
            out[name] = rfc3339(dt.datetime.fromtimestamp(stamp.get("seconds", 0), dt.UTC))
    return out


def decode(body: bytes, content_type: str) -> dict:
    """A protobuf request body as the JSON object it stands for; 415 for kinds localkube cannot read."""
    if not body.startswith(MAGIC):
        raise ApiError(400, "BadRequest", "protobuf body without the k8s envelope")
    try:
        envelope = dict(_Reader(body[len(MAGIC) :]).fields())
        type_meta = dict(_Reader(envelope.get(1, b"")).fields())
        api_version, kind = type_meta.get(1, b"").decode(), type_meta.get(2, b"").decode()
        schema = SCHEMAS.get((api_version, kind))
        if schema is None:
            raise unsupported_media_type(content_type, ["application/json", "application/yaml"])
        obj = _decode(envelope.get(2, b""), schema)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "BadRequest", f"could not decode the protobuf body: {exc}") from exc
    obj["apiVersion"] = api_version
    obj["kind"] = kind
    return obj
