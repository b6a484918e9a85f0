"""Minimal OpenAPI documents (v2 and v3) so ``kubectl apply`` and ``kubectl explain`` work.

Custom resources get their real schemas (kubectl explain shows them); built-in kinds get open object schemas with
their group-version-kind, which is enough for kubectl to find them. The v3 documents declare the
``fieldValidation`` query parameter, so kubectl leaves unknown-field checks to the server (as with a real one).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from localkube.meta import clone
from localkube.registry import Registry, ResourceType

_INFO = {"title": "Kubernetes", "version": "v1.37.0"}


def _proto_string(field: int, text: str) -> bytes:
    data = text.encode()
    return bytes([(field << 3) | 2, len(data)]) + data


# kubectl asks for /openapi/v2 in protobuf (gnostic openapi_v2.Document) when it validates a kind the v3 documents
# do not list; this is ``{swagger: "2.0", info: {title, version}}`` with no definitions, so such objects pass
# client-side validation and kubectl reports the real problem (an unknown kind) as with a real server.
V2_PROTOBUF_TYPE = "application/octet-stream"
_INFO_PROTO = _proto_string(1, _INFO["title"]) + _proto_string(2, _INFO["version"])
V2_PROTOBUF = _proto_string(1, "2.0") + bytes([(2 << 3) | 2, len(_INFO_PROTO)]) + _INFO_PROTO
_FIELD_VALIDATION = {
    "name": "fieldValidation",
    "in": "query",
    "schema": {"type": "string", "uniqueItems": True},
    "description": "fieldValidation instructs the server on how to handle objects in the request containing unknown or duplicate fields.",
}


def _definition_name(rt: ResourceType) -> str:
    """``io.k8s.api.core.v1.Pod`` style names (reversed group for custom resources, as the real server does)."""
    if rt.group == "":
        return f"io.k8s.api.core.{rt.version}.{rt.kind}"
    if rt.group.endswith(".k8s.io"):
        prefix = (
            "io.k8s.apiextensions-apiserver.pkg.apis." + rt.group.split(".")[0]
            if rt.group == "apiextensions.k8s.io"
            else "io.k8s.api." + rt.group.split(".")[0]
        )
        return f"{prefix}.{rt.version}.{rt.kind}"
    if "." not in rt.group:
        return f"io.k8s.api.{rt.group}.{rt.version}.{rt.kind}"
    return ".".join(reversed(rt.group.split("."))) + f".{rt.version}.{rt.kind}"


def _gvk(rt: ResourceType) -> list[dict]:
    return [{"group": rt.group, "version": rt.version, "kind": rt.kind}]


def _schema_for(rt: ResourceType) -> dict:
    schema = getattr(rt.strategy, "schema", None)
    if isinstance(schema, dict):
        out = clone(schema)
        props = out.setdefault("properties", {})
        props.setdefault(
            "apiVersion",
            {
                "type": "string",
                "description": "APIVersion defines the versioned schema of this representation of an object.",
            },
        )
        props.setdefault(
            "kind",
            {
                "type": "string",
                "description": "Kind is a string value representing the REST resource this object represents.",
            },
        )
        props["metadata"] = {
            "type": "object",
            "description": "Standard object's metadata.",
            "x-kubernetes-preserve-unknown-fields": True,
        }
    else:
        out = {
            "type": "object",
            "description": f"{rt.kind} ({rt.api_version}), served by localkube.",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "metadata": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        }
    out["x-kubernetes-group-version-kind"] = _gvk(rt)
    return out


def _prefix(group: str, version: str) -> str:
    return f"/api/{version}" if group == "" else f"/apis/{group}/{version}"


def _paths(rt: ResourceType, ref: str) -> dict:
    base = _prefix(rt.group, rt.version)
    item = f"{base}/namespaces/{{namespace}}/{rt.plural}/{{name}}" if rt.namespaced else f"{base}/{rt.plural}/{{name}}"
    collection = item.rsplit("/", 1)[0]
    response = {"200": {"description": "OK", "content": {"application/json": {"schema": {"$ref": ref}}}}}
    gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}

    def op(action: str, with_validation: bool) -> dict:
        body: dict[str, Any] = {
            "operationId": f"{action}{rt.kind}",
            "responses": response,
            "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": gvk,
        }
        if with_validation:
            body["parameters"] = [_FIELD_VALIDATION]
        return body

    paths = {
        collection: {"get": op("list", False), "post": op("post", True)},
        item: {
            "get": op("get", False),
            "put": op("put", True),
            "patch": op("patch", True),
            "delete": op("delete", False),
        },
    }
    for sub in rt.subresources:
        if sub in ("status", "scale"):
            paths[f"{item}/{sub}"] = {"get": op("get", False), "put": op("put", True), "patch": op("patch", True)}
    return paths


def group_version_document(registry: Registry, group: str, version: str) -> dict | None:
    types = registry.types_in(group, version)
    if not types:
        return None
    schemas, paths = {}, {}
    for rt in types:
        name = _definition_name(rt)
        schemas[name] = _schema_for(rt)
        paths.update(_paths(rt, f"#/components/schemas/{name}"))
    return {"openapi": "3.0.0", "info": _INFO, "paths": paths, "components": {"schemas": schemas}}


def v3_index(registry: Registry) -> dict:
    paths = {}
    for group, versions in registry.group_versions().items():
        for version in versions:
            doc = group_version_document(registry, group, version)
            digest = hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest().upper()[:128]
            rel = _prefix(group, version).lstrip("/")
            paths[rel] = {"serverRelativeURL": f"/openapi/v3/{rel}?hash={digest}"}
    return {"paths": paths}


def v2_document(registry: Registry) -> dict:
    definitions = {}
    for rt in registry.all():
        schema = _schema_for(rt)
        definitions[_definition_name(rt)] = _v2_compatible(schema)
    return {"swagger": "2.0", "info": _INFO, "paths": {}, "definitions": definitions}


def _v2_compatible(schema):
    """OpenAPI v2 has no ``nullable``/``anyOf`` in the places v3 allows them; drop what v2 cannot say."""
    if isinstance(schema, dict):
        return {
            k: _v2_compatible(v) for k, v in schema.items() if k not in ("nullable", "anyOf", "oneOf", "not", "allOf")
        }
    if isinstance(schema, list):
        return [_v2_compatible(v) for v in schema]
    return schema


def document(registry: Registry, parts: list[str]) -> dict | None:
    """The document at ``/openapi/<parts...>``."""
    if parts == ["v2"]:
        return v2_document(registry)
    if parts == ["v3"]:
        return v3_index(registry)
    if len(parts) >= 3 and parts[0] == "v3":
        if parts[1] == "api" and len(parts) == 3:
            return group_version_document(registry, "", parts[2])
        if parts[1] == "apis" and len(parts) == 4:
            return group_version_document(registry, parts[2], parts[3])
    return None
