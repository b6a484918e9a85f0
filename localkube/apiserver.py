"""The HTTP face of localkube: Kubernetes REST paths, content negotiation, watch streams and Status errors.

Routes ``/api``, ``/apis``, ``/version``, ``/openapi/*`` and every resource path
(``/api/v1/namespaces/{ns}/pods/{name}/status``, ``/apis/{group}/{version}/...``) onto ``ApiCore``; renders lists,
Tables (``Accept: application/json;as=Table;g=meta.k8s.io;v=v1``), PartialObjectMetadata and watch streams
(``application/json`` lines with bookmarks, resume, ``sendInitialEvents`` and 410 Gone as an ERROR event).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

import yaml
from aiohttp import web

from localkube import errors, openapi, protobuf
from localkube.api import APPLY_PATCH, PATCH_TYPES, DeleteOptions, WriteOptions
from localkube.errors import ApiError
from localkube.meta import utcnow
from localkube.registry import ResourceType
from localkube.selectors import parse_field_selector, parse_label_selector
from localkube.services import PodSubresources
from localkube.store import Watch

log = logging.getLogger("localkube.apiserver")

SERVER_VERSION = {
    "major": "1",
    "minor": "37",
    "emulationMajor": "1",
    "emulationMinor": "37",
    "minCompatibilityMajor": "1",
    "minCompatibilityMinor": "36",
    "gitVersion": "v1.37.0+localkube",
    "gitCommit": "localkube",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.25.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_JSON = "application/json"
_BOOKMARK_INTERVAL = 10.0
_DEFAULT_WATCH_SECONDS = (1800, 3600)


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _truthy(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


@dataclass
class Route:
    group: str
    version: str
    plural: str
    namespace: str | None = None
    name: str | None = None
    subresource: str = ""
    watch_path: bool = False


def parse_route(parts: list[str]) -> Route | None:
    """Split a resource URL (after ``/api`` or ``/apis``) into its parts."""
    if not parts:
        return None
    if parts[0] == "api":
        if len(parts) < 3 or parts[1] != "v1":
            return None
        group, version, rest = "", "v1", parts[2:]
    elif parts[0] == "apis":
        if len(parts) < 4:
            return None
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    watch_path = False
    if rest and rest[0] == "watch":
        watch_path, rest = True, rest[1:]
    if not rest:
        return None
    if (
        rest[0] == "namespaces"
        and len(rest) >= 3
        and not (group == "" and len(rest) == 3 and rest[2] in ("status", "finalize"))
    ):
        namespace, rest = rest[1], rest[2:]
        route = Route(group, version, rest[0], namespace=namespace)
    else:
        route = Route(group, version, rest[0])
    if len(rest) > 1:
        route.name = rest[1]
    if len(rest) > 2:
        route.subresource = "/".join(rest[2:])
    route.watch_path = watch_path
    return route


def _accept_parts(request: web.Request) -> list[dict[str, str]]:
    clauses = []
    for clause in request.headers.get("Accept", "").split(","):
        pieces = [p.strip() for p in clause.split(";")]
        params = {"type": pieces[0]}
        for piece in pieces[1:]:
            if "=" in piece:
                k, v = piece.split("=", 1)
                params[k.strip()] = v.strip()
        clauses.append(params)
    return clauses


def _wants(request: web.Request, as_kind: str) -> bool:
    for clause in _accept_parts(request):
        if clause.get("as") == as_kind and clause.get("g") == "meta.k8s.io" and clause.get("v") in ("v1", "v1beta1"):
            return True
    return False


class ApiServer:
    """Builds the aiohttp application for one ``LocalKube`` (seen as the API machinery plus pod subresources)."""

    def __init__(self, kube: PodSubresources) -> None:
        self.kube = kube
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self.dispatch)
        self.server_address = "127.0.0.1:0"

    # --------------------------------------------------------------------------------------------- plumbing

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._dispatch(request)
        except ApiError as exc:
            return self._status(exc)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # an API server answers 500 with a Status and keeps serving
            log.exception("internal error serving %s %s", request.method, request.path)
            return self._status(ApiError(500, "InternalError", f"Internal error occurred: {exc!r}"))

    def _status(self, exc: ApiError) -> web.Response:
        headers = {}
        if exc.retry_after:
            headers["Retry-After"] = str(exc.retry_after)
        return web.Response(status=exc.code, body=_dumps(exc.status()), content_type=_JSON, headers=headers)

    def _json(self, obj, status: int = 200, warnings: list[str] | None = None) -> web.Response:
        response = web.Response(status=status, body=_dumps(obj), content_type=_JSON)
        for warning in warnings or []:
            response.headers.add("Warning", "299 - " + json.dumps(warning))
        return response

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        parts = [p for p in path.split("/") if p]
        registry = self.kube.registry
        if request.method == "GET":
            if path == "/version":
                return self._json(SERVER_VERSION)
            if path in ("/healthz", "/livez", "/readyz"):
                return web.Response(text="ok")
            if path == "/api":
                return self._json(registry.api_versions(self.server_address))
            if path == "/apis":
                return self._json(registry.api_group_list())
            if path == "/api/v1":
                return self._json(registry.api_resource_list("", "v1"))
            if parts and parts[0] == "openapi":
                return self._openapi(request, parts)
            if len(parts) == 2 and parts[0] == "apis":
                group = registry.api_group(parts[1])
                if group is None:
                    raise errors.not_found_path()
                return self._json(group)
            if len(parts) == 3 and parts[0] == "apis":
                listing = registry.api_resource_list(parts[1], parts[2])
                if listing is None:
                    raise errors.not_found_path()
                return self._json(listing)
        route = parse_route(parts)
        if route is None:
            raise errors.not_found_path()
        rt = registry.lookup(route.group, route.version, route.plural)
        if rt is None:
            raise errors.not_found_path()
        if route.namespace is not None and not rt.namespaced:
            raise errors.not_found_path()
        if route.subresource and route.subresource not in rt.subresources:
            raise errors.not_found_path()
        return await self._resource(request, rt, route)

    def _openapi(self, request: web.Request, parts: list[str]) -> web.Response:
        if (
            parts[1:] == ["v2"]
            and "protobuf" in request.headers.get("Accept", "")
            and "json" not in request.headers.get("Accept", "")
        ):
            return web.Response(body=openapi.V2_PROTOBUF, content_type=openapi.V2_PROTOBUF_TYPE)
        doc = openapi.document(self.kube.registry, parts[1:])
        if doc is None:
            raise errors.not_found_path()
        return self._json(doc)

    # ------------------------------------------------------------------------------------------- resources

    async def _resource(self, request: web.Request, rt: ResourceType, route: Route) -> web.StreamResponse:
        method = request.method
        query = request.query
        core = self.kube.core
        ns = route.namespace or ""
        if route.name is None:
            if method == "GET":
                if route.watch_path or _truthy(query.get("watch")):
                    self._verb(rt, "watch")
                    return await self._watch(request, rt, route.namespace)
                self._verb(rt, "list")
                return self._list(request, rt, route.namespace)
            if method == "POST":
                self._verb(rt, "create")
                if rt.namespaced and route.namespace is None:
                    raise errors.not_found_path()
                body = await self._body(request)
                if rt.strategy.virtual:
                    if not isinstance(body, dict):
                        raise errors.bad_request("the body of the request must be a JSON object")
                    return self._json(rt.strategy.respond(body), 201)
                opts = self._write_options(query)
                obj = core.create(rt, ns, body, opts)
                return self._json(obj, 201, opts.warnings)
            if method == "DELETE":
                self._verb(rt, "deletecollection")
                body = await self._body(request, optional=True)
                labels = parse_label_selector(query.get("labelSelector"))
                fields = parse_field_selector(query.get("fieldSelector"), rt.strategy.field_selectors)
                deleted = core.delete_collection(
                    rt, route.namespace, labels, fields, DeleteOptions.from_body(body, query)
                )
                return self._json(
                    {
                        "kind": rt.list_kind,
                        "apiVersion": rt.api_version,
                        "metadata": {"resourceVersion": str(self.kube.store.rv)},
                        "items": deleted,
                    }
                )
            raise errors.method_not_allowed()
        name = route.name
        sub = route.subresource
        if route.watch_path:
            raise errors.method_not_allowed()
        if sub == "log":
            return await self._log(request, rt, ns, name)
        if sub == "scale":
            return await self._scale(request, rt, ns, name)
        if sub in ("binding", "eviction"):
            if method != "POST":
                raise errors.method_not_allowed()
            body = await self._body(request)
            if sub == "binding":
                return self._json(self.kube.bind_pod(ns, name, body), 201)
            return self._json(self.kube.evict_pod(ns, name, body, query), 201)
        if method == "GET":
            self._verb(rt, "get")
            obj = core.get(rt, ns, name)
            return self._render_object(request, rt, obj)
        if method == "PUT":
            self._verb(rt, "update")
            body = await self._body(request)
            opts = self._write_options(query)
            obj = core.update(rt, ns, name, body, sub, opts)
            return self._json(obj, 200, opts.warnings)
        if method == "PATCH":
            self._verb(rt, "patch")
            content_type = request.content_type
            if content_type not in PATCH_TYPES:
                raise errors.unsupported_media_type(content_type, list(PATCH_TYPES))
            raw = await request.read()
            patch = self._decode(raw, APPLY_PATCH if content_type == APPLY_PATCH else _JSON)
            opts = self._write_options(query)
            created_before = core.try_get(rt, ns, name) is None
            obj = core.patch(rt, ns, name, content_type, patch, sub, opts)
            return self._json(obj, 201 if created_before and content_type == APPLY_PATCH else 200, opts.warnings)
        if method == "DELETE":
            if sub:
                raise errors.method_not_allowed()
            self._verb(rt, "delete")
            body = await self._body(request, optional=True)
            delete_opts = DeleteOptions.from_body(body, query)
            obj, removed = core.delete(rt, ns, name, delete_opts)
            code = 202 if not removed and delete_opts.propagation == "Foreground" else 200
            return self._json(obj, code)
        raise errors.method_not_allowed()

    def _verb(self, rt: ResourceType, verb: str) -> None:
        if verb not in rt.verbs:
            raise errors.method_not_allowed()

    def _write_options(self, query) -> WriteOptions:
        dry = query.getall("dryRun", [])
        validation = query.get("fieldValidation") or "Warn"
        if validation not in ("Ignore", "Warn", "Strict"):
            raise errors.bad_request(
                f'fieldValidation: Unsupported value: "{validation}": supported values: "Ignore", "Strict", "Warn"'
            )
        return WriteOptions(dry_run="All" in dry, field_validation=validation)

    async def _body(self, request: web.Request, optional: bool = False):
        raw = await request.read()
        if not raw:
            if optional:
                return None
            raise errors.bad_request("the body of the request is empty")
        content_type = request.content_type or _JSON
        if content_type == protobuf.PROTOBUF:
            return protobuf.decode(raw, content_type)
        if "protobuf" in content_type or "cbor" in content_type:
            raise errors.unsupported_media_type(content_type, [_JSON, "application/yaml"])
        return self._decode(raw, content_type)

    @staticmethod
    def _decode(raw: bytes, content_type: str):
        try:
            if "yaml" in content_type:
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise errors.bad_request(f"error decoding request body: {exc}") from exc

    # --------------------------------------------------------------------------------------------- reading

    def _render_object(self, request: web.Request, rt: ResourceType, obj: dict) -> web.Response:
        if _wants(request, "Table"):
            return self._json(self._table(request, rt, [obj], str(self.kube.store.rv)))
        if _wants(request, "PartialObjectMetadata"):
            return self._json(_partial(obj))
        return self._json(obj)

    def _list(self, request: web.Request, rt: ResourceType, namespace: str | None) -> web.Response:
        query = request.query
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"), rt.strategy.field_selectors)
        try:
            limit = int(query.get("limit") or 0)
        except ValueError as exc:
            raise errors.bad_request(f"invalid limit: {query.get('limit')}") from exc
        rv = query.get("resourceVersion") or ""
        if query.get("resourceVersionMatch") == "Exact" and rv and rv != str(self.kube.store.rv):
            raise errors.gone(f"too old resource version: {rv} ({self.kube.store.rv})")
        result = self.kube.core.list(rt, namespace, labels, fields, limit, query.get("continue") or "")
        meta: dict[str, Any] = {"resourceVersion": result.resource_version}
        if result.continue_token:
            meta["continue"] = result.continue_token
            meta["remainingItemCount"] = result.remaining
        if _wants(request, "Table"):
            table = self._table(request, rt, result.items, result.resource_version)
            table["metadata"] = meta
            return self._json(table)
        if _wants(request, "PartialObjectMetadataList"):
            return self._json(
                {
                    "kind": "PartialObjectMetadataList",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": meta,
                    "items": [_partial(o) for o in result.items],
                }
            )
        return self._json({"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta, "items": result.items})

    def _table(self, request: web.Request, rt: ResourceType, items: list[dict], rv: str, headers: bool = True) -> dict:
        include = request.query.get("includeObject") or "Metadata"
        now = utcnow()
        rows = []
        for obj in items:
            row: dict[str, Any] = {"cells": rt.strategy.cells(obj, now)}
            if include == "Object":
                row["object"] = obj
            elif include == "Metadata":
                row["object"] = _partial(obj)
            rows.append(row)
        table: dict[str, Any] = {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": rv},
            "rows": rows,
        }
        if headers:
            table["columnDefinitions"] = [c.to_dict() for c in rt.strategy.columns()]
        else:
            table["columnDefinitions"] = None
        return table

    async def _watch(self, request: web.Request, rt: ResourceType, namespace: str | None) -> web.StreamResponse:
        query = request.query
        store = self.kube.store
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"), rt.strategy.field_selectors)
        bookmarks = _truthy(query.get("allowWatchBookmarks"))
        initial_events = _truthy(query.get("sendInitialEvents"))
        try:
            timeout = float(query.get("timeoutSeconds") or random.uniform(*_DEFAULT_WATCH_SECONDS))
        except ValueError as exc:
            raise errors.bad_request(f"invalid timeoutSeconds: {query.get('timeoutSeconds')}") from exc
        rv_text = query.get("resourceVersion") or ""
        table = _wants(request, "Table")
        watch = Watch(rt.storage, (namespace or None) if rt.namespaced else None, labels, fields)
        pending: list[tuple[str, dict, int]] = []
        gone: ApiError | None = None
        if initial_events or rv_text in ("", "0"):
            if initial_events and not bookmarks:
                raise errors.invalid(
                    "ListOptions",
                    "meta.k8s.io",
                    "",
                    [
                        errors.forbidden(
                            "allowWatchBookmarks", "allowWatchBookmarks required when sendInitialEvents is set"
                        )
                    ],
                )
            for obj in self.kube.core.store.list(rt.storage, watch.namespace):
                if watch.matches(obj):
                    pending.append(("ADDED", obj, int(obj["metadata"]["resourceVersion"])))
        else:
            try:
                since = int(rv_text)
            except ValueError as exc:
                raise errors.bad_request(f"invalid resource version: {rv_text}") from exc
            if store.too_old(since):
                gone = errors.gone(f"too old resource version: {since} ({store.compacted_rv})")
            else:
                for event in store.events_since(rt.storage, since):
                    seen = watch.translate(event)
                    if seen is not None:
                        pending.append((seen[0], seen[1], event.rv))
        start_rv = store.rv
        if gone is None:
            store.subscribe(watch)
        response = web.StreamResponse(status=200, headers={"Content-Type": _JSON, "Cache-Control": "no-cache, private"})
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            if gone is not None:
                await response.write(_dumps({"type": "ERROR", "object": gone.status()}) + b"\n")
                return response
            first = [True]

            async def send(kind: str, obj: dict) -> None:
                out = rt.strategy.to_external(obj, rt.api_version)
                if table:
                    out = self._table(request, rt, [out], out["metadata"]["resourceVersion"], headers=first[0])
                    first[0] = False
                await response.write(_dumps({"type": kind, "object": out}) + b"\n")

            for kind, obj, _rv in pending:
                await send(kind, obj)
            if initial_events:
                await response.write(
                    _dumps({"type": "BOOKMARK", "object": self._bookmark(rt, start_rv, initial_end=True)}) + b"\n"
                )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(watch.queue.get(), min(remaining, _BOOKMARK_INTERVAL))
                except TimeoutError:
                    if bookmarks and loop.time() < deadline:
                        # the queue is empty, so every change up to the store's version has been delivered
                        await response.write(
                            _dumps({"type": "BOOKMARK", "object": self._bookmark(rt, store.rv)}) + b"\n"
                        )
                    continue
                if item is None:
                    break
                kind, obj, _rv = item
                await send(kind, obj)
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        finally:
            store.unsubscribe(watch)

    def _bookmark(self, rt: ResourceType, rv: int, initial_end: bool = False) -> dict:
        meta: dict = {"resourceVersion": str(rv)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}

    # --------------------------------------------------------------------------------------- subresources

    async def _scale(self, request: web.Request, rt: ResourceType, ns: str, name: str) -> web.Response:
        core = self.kube.core
        if request.method == "GET":
            return self._json(core.get_scale(rt, ns, name))
        if request.method == "PUT":
            opts = self._write_options(request.query)
            return self._json(core.update_scale(rt, ns, name, await self._body(request), opts), 200, opts.warnings)
        if request.method == "PATCH":
            content_type = request.content_type
            if content_type not in PATCH_TYPES:
                raise errors.unsupported_media_type(content_type, list(PATCH_TYPES))
            patch = self._decode(await request.read(), _JSON)
            opts = self._write_options(request.query)
            return self._json(core.patch(rt, ns, name, content_type, patch, "scale", opts), 200, opts.warnings)
        raise errors.method_not_allowed()

    async def _log(self, request: web.Request, rt: ResourceType, ns: str, name: str) -> web.StreamResponse:
        if request.method != "GET":
            raise errors.method_not_allowed()
        pod = self.kube.core.get(rt, ns, name)
        return await self.kube.stream_log(pod, request)


def _partial(obj: dict) -> dict:
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
