"""The API server's semantics, independent of HTTP: create, get, list, update, patch, delete, deletecollection.

Implements what clients rely on: uid, a global resourceVersion, creationTimestamp, generation that moves on spec
changes only, 409 on stale writes, no-op updates that do not bump anything, status and scale subresources,
``generateName``, finalizers with deletionTimestamp, graceful pod deletion, preconditions, propagation policies
(the garbage collector in ``controllers`` finishes them) and dry runs. Every method is synchronous and runs on the
event loop thread, so each operation is atomic.
"""

from __future__ import annotations

import base64
import builtins
import datetime as dt
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from localkube import errors
from localkube.errors import ApiError, Cause, invalid_value, required_value
from localkube.jsonpath import JSONPathError, simple_path
from localkube.meta import (
    clone,
    generate_suffix,
    rfc3339,
    utcnow,
    validate_annotations,
    validate_dns_subdomain,
    validate_labels,
)
from localkube.patches import json_patch, merge_patch, strategic_merge_patch
from localkube.registry import Registry, ResourceType
from localkube.selectors import FieldSelector, LabelSelector
from localkube.store import ADDED, MODIFIED, Store

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH, APPLY_PATCH)
_SYSTEM_META = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)


@dataclass
class WriteOptions:
    dry_run: bool = False
    field_validation: str = "Warn"  # Ignore | Warn | Strict
    warnings: list[str] = field(default_factory=list)


@dataclass
class DeleteOptions:
    grace_period: int | None = None
    propagation: str | None = None  # Foreground | Background | Orphan
    precondition_uid: str | None = None
    precondition_rv: str | None = None
    dry_run: bool = False

    @classmethod
    def from_body(cls, body: dict | None, query: Mapping[str, str]) -> DeleteOptions:
        body = body or {}
        opts = cls()
        grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
        if grace is not None and grace != "":
            try:
                opts.grace_period = int(grace)
            except (TypeError, ValueError) as exc:
                raise errors.bad_request(f"invalid gracePeriodSeconds {grace!r}") from exc
        opts.propagation = body.get("propagationPolicy") or query.get("propagationPolicy") or None
        orphan = body.get("orphanDependents", query.get("orphanDependents"))
        if opts.propagation is None and orphan is not None:
            opts.propagation = "Orphan" if str(orphan).lower() == "true" else "Background"
        if opts.propagation not in (None, "Foreground", "Background", "Orphan"):
            raise ApiError(
                422,
                "Invalid",
                f'propagationPolicy: Unsupported value: "{opts.propagation}": supported values: "Foreground", "Background", "Orphan"',
            )
        pre = body.get("preconditions") or {}
        opts.precondition_uid = pre.get("uid")
        opts.precondition_rv = pre.get("resourceVersion")
        dry = body.get("dryRun") or query.get("dryRun")
        opts.dry_run = bool(dry) and dry != [] and "All" in (dry if isinstance(dry, list) else [dry])
        return opts


@dataclass
class ListResult:
    items: list[dict]
    resource_version: str
    continue_token: str = ""
    remaining: int | None = None


class ApiCore:
    """Generic object semantics over a ``Store``; per-kind behaviour comes from each type's ``Strategy``."""

    def __init__(self, store: Store, registry: Registry) -> None:
        self.store = store
        self.registry = registry

    # ------------------------------------------------------------------------------------------------- reads

    def get(self, rt: ResourceType, namespace: str, name: str) -> dict:
        obj = self.store.get(rt.storage, self._ns(rt, namespace), name)
        if obj is None:
            raise errors.not_found(rt.plural, rt.group, name)
        return rt.strategy.to_external(obj, rt.api_version)

    def try_get(self, rt: ResourceType, namespace: str, name: str) -> dict | None:
        obj = self.store.get(rt.storage, self._ns(rt, namespace), name)
        return None if obj is None else rt.strategy.to_external(obj, rt.api_version)

    def list(
        self,
        rt: ResourceType,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        limit: int = 0,
        continue_token: str = "",
    ) -> ListResult:
        ns = self._ns(rt, namespace) if namespace else None
        pinned_ns = fields.value_of("metadata.namespace")
        if ns is None and pinned_ns is not None and rt.namespaced:
            ns = pinned_ns
        pinned_name = fields.value_of("metadata.name")
        if pinned_name is not None and ns is not None:
            found = self.store.get(rt.storage, ns, pinned_name)
            candidates = [found] if found is not None else []
        else:
            candidates = self.store.list(rt.storage, ns)
        items = [o for o in candidates if labels.matches(o["metadata"].get("labels")) and fields.matches(o)]
        rv = str(self.store.rv)
        start = 0
        if continue_token:
            try:
                token = json.loads(base64.urlsafe_b64decode(continue_token.encode()).decode())
                after = (token["ns"], token["name"])
            except (ValueError, KeyError, TypeError) as exc:
                raise errors.bad_request(f"invalid continue token: {exc}") from exc
            start = next(
                (n for n, o in enumerate(items) if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > after),
                len(items),
            )
            rv = str(token.get("rv", rv))
        items = items[start:]
        token_out, remaining = "", None
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            token_out = base64.urlsafe_b64encode(
                json.dumps({"ns": last.get("namespace", ""), "name": last["name"], "rv": rv}).encode()
            ).decode()
            remaining = len(items) - limit
            items = items[:limit]
        return ListResult([rt.strategy.to_external(o, rt.api_version) for o in items], rv, token_out, remaining)

    # ------------------------------------------------------------------------------------------------ create

    def create(self, rt: ResourceType, namespace: str, body: object, opts: WriteOptions | None = None) -> dict:
        opts = opts or WriteOptions()
        obj = self._check_body(rt, body)
        meta = obj["metadata"]
        if rt.namespaced:
            ns = namespace or meta.get("namespace") or "default"
            if meta.get("namespace") and meta["namespace"] != ns:
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        for key in _SYSTEM_META + ("managedFields", "selfLink"):
            meta.pop(key, None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise errors.invalid(
                    rt.kind, rt.group, "", [required_value("metadata.name", "name or generateName is required")]
                )
            meta["name"] = meta["generateName"] + generate_suffix()
        pruned = rt.strategy.prune_and_default(obj, rt.api_version)
        self._field_validation(rt, pruned, opts)
        rt.strategy.prepare_create(obj, self)
        obj = rt.strategy.to_internal(obj, rt.storage_version)
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = rfc3339()
        if rt.strategy.has_generation:
            meta["generation"] = 1
        causes = self._validate_meta(rt, obj, None) + rt.strategy.validate_schema(obj, rt.api_version)
        causes += rt.strategy.validate(obj, None, self)
        if causes:
            raise errors.invalid(rt.kind, rt.group, meta["name"], causes)
        if rt.namespaced:
            self._check_namespace(rt, meta["namespace"], meta["name"])
        tries = 0
        while self.store.get(rt.storage, meta.get("namespace", ""), meta["name"]) is not None:
            if not meta.get("generateName") or tries >= 5:
                raise errors.already_exists(rt.plural, rt.group, meta["name"])
            meta["name"] = meta["generateName"] + generate_suffix()
            tries += 1
        _order_meta(obj)
        if opts.dry_run:
            return rt.strategy.to_external(obj, rt.api_version)
        stored = self.store.put(rt.storage, obj, ADDED)
        return rt.strategy.to_external(stored, rt.api_version)

    # ------------------------------------------------------------------------------------------------ update

    def update(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        body: object,
        subresource: str = "",
        opts: WriteOptions | None = None,
    ) -> dict:
        opts = opts or WriteOptions()
        ns = self._ns(rt, namespace)
        current = self.store.get(rt.storage, ns, name)
        if current is None:
            raise errors.not_found(rt.plural, rt.group, name)
        new = self._check_body(rt, body)
        meta = new["metadata"]
        if meta.get("name") and meta["name"] != name:
            raise errors.bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
            )
        if rt.namespaced and meta.get("namespace") and meta["namespace"] != ns:
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        requested_rv = meta.get("resourceVersion")
        if requested_rv and requested_rv != current["metadata"]["resourceVersion"]:
            raise errors.stale(rt.plural, rt.group, name)
        return self._write_update(rt, current, new, subresource, opts)

    def _write_update(self, rt: ResourceType, current: dict, new: dict, subresource: str, opts: WriteOptions) -> dict:
        name = current["metadata"]["name"]
        pruned = rt.strategy.prune_and_default(new, rt.api_version)  # status writes are pruned too
        if subresource == "status":
            pruned = [p for p in pruned if p == "status" or p.startswith(("status.", "status["))]
        self._field_validation(rt, pruned, opts)
        new = rt.strategy.to_internal(new, rt.storage_version)
        old_meta = current["metadata"]
        meta = new.setdefault("metadata", {})
        meta["name"] = name
        if rt.namespaced:
            meta["namespace"] = old_meta["namespace"]
        else:
            meta.pop("namespace", None)
        for key in _SYSTEM_META:
            if key in old_meta:
                meta[key] = old_meta[key]
            else:
                meta.pop(key, None)
        meta.pop("managedFields", None)
        meta.pop("selfLink", None)
        if subresource == "status":
            new = rt.strategy.prepare_status_update(new, current, self)
        elif subresource:
            new = rt.strategy.prepare_subresource_update(subresource, new, current)
        else:
            rt.strategy.prepare_update(new, current, self)
        meta = new["metadata"]
        if rt.strategy.has_generation and rt.strategy.generation_changed(new, current):
            meta["generation"] = int(old_meta.get("generation") or 0) + 1
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise errors.invalid(
                    rt.kind,
                    rt.group,
                    name,
                    [
                        Cause(
                            "metadata.finalizers",
                            "FieldValueForbidden",
                            f"Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {json.dumps(sorted(added))}",
                        )
                    ],
                )
        causes = self._validate_meta(rt, new, current) + rt.strategy.validate_schema(new, rt.api_version)
        causes += rt.strategy.validate(new, current, self)
        if causes:
            raise errors.invalid(rt.kind, rt.group, name, causes)
        _order_meta(new)
        if _same(new, current):
            return rt.strategy.to_external(current, rt.api_version)
        if opts.dry_run:
            return rt.strategy.to_external(new, rt.api_version)
        if self._finished_deleting(rt, new):
            return rt.strategy.to_external(self.store.remove(rt.storage, new), rt.api_version)
        stored = self.store.put(rt.storage, new, MODIFIED)
        return rt.strategy.to_external(stored, rt.api_version)

    # ------------------------------------------------------------------------------------------------- patch

    def patch(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        patch_type: str,
        patch: object,
        subresource: str = "",
        opts: WriteOptions | None = None,
    ) -> dict:
        opts = opts or WriteOptions()
        ns = self._ns(rt, namespace)
        current = self.store.get(rt.storage, ns, name)
        if current is None:
            if patch_type == APPLY_PATCH and not subresource:
                body = clone(patch) if isinstance(patch, dict) else patch
                if isinstance(body, dict):
                    body.setdefault("metadata", {})["name"] = name
                return self.create(rt, namespace, body, opts)
            raise errors.not_found(rt.plural, rt.group, name)
        if patch_type == STRATEGIC_PATCH and not rt.strategy.strategic_merge:
            raise errors.unsupported_media_type(patch_type, [JSON_PATCH, MERGE_PATCH, APPLY_PATCH])
        external = rt.strategy.to_external(current, rt.api_version)
        if subresource == "scale":
            return self._patch_scale(rt, current, patch_type, patch, opts)
        patched = self._apply_patch(external, patch_type, patch)
        if not isinstance(patched, dict):
            raise errors.bad_request("the patch did not produce an object")
        patched_meta = patched.get("metadata")
        if not isinstance(patched_meta, dict):
            raise errors.bad_request("metadata must be an object")
        if patched_meta.get("name", name) != name:
            raise errors.bad_request(
                f"the name of the object ({patched_meta.get('name')}) does not match the name on the URL ({name})"
            )
        if patched_meta.get("uid", current["metadata"]["uid"]) != current["metadata"]["uid"]:
            raise errors.conflict(
                rt.plural,
                rt.group,
                name,
                f"Precondition failed: UID in precondition: {patched_meta.get('uid')}, UID in object meta: {current['metadata']['uid']}",
            )
        if (
            patched_meta.get("resourceVersion")
            and patched_meta["resourceVersion"] != current["metadata"]["resourceVersion"]
        ):
            raise errors.stale(rt.plural, rt.group, name)
        patched.setdefault("apiVersion", rt.api_version)
        patched.setdefault("kind", rt.kind)
        return self._write_update(rt, current, patched, subresource, opts)

    @staticmethod
    def _apply_patch(target: dict, patch_type: str, patch: object) -> object:
        if patch_type == JSON_PATCH:
            return json_patch(target, patch)
        if not isinstance(patch, dict):
            raise errors.bad_request(f"the body of a {patch_type} PATCH must be a JSON object")
        if patch_type in (MERGE_PATCH, APPLY_PATCH):
            return merge_patch(target, patch)
        if patch_type == STRATEGIC_PATCH:
            return strategic_merge_patch(target, patch)
        raise errors.unsupported_media_type(patch_type, list(PATCH_TYPES))

    # ------------------------------------------------------------------------------------------------- scale

    def _scale_paths(self, rt: ResourceType) -> dict:
        paths = getattr(rt.strategy, "scale_paths", None)
        if not paths:
            raise errors.not_found(f"{rt.plural}/scale", rt.group, "")
        return paths

    def get_scale(self, rt: ResourceType, namespace: str, name: str) -> dict:
        current = self.store.get(rt.storage, self._ns(rt, namespace), name)
        if current is None:
            raise errors.not_found(rt.plural, rt.group, name)
        return self._scale_of(rt, current)

    def _scale_of(self, rt: ResourceType, obj: dict) -> dict:
        paths = self._scale_paths(rt)
        meta = obj["metadata"]
        spec = _read_path(obj, paths["spec"])
        status = _read_path(obj, paths["status"])
        scale: dict[str, Any] = {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta
            },
            "spec": {"replicas": int(spec) if isinstance(spec, (int, float)) and not isinstance(spec, bool) else 0},
            "status": {
                "replicas": int(status) if isinstance(status, (int, float)) and not isinstance(status, bool) else 0
            },
        }
        if paths.get("selector"):
            selector = _read_path(obj, paths["selector"])
            if isinstance(selector, str):
                scale["status"]["selector"] = selector
        return scale

    def update_scale(
        self, rt: ResourceType, namespace: str, name: str, body: object, opts: WriteOptions | None = None
    ) -> dict:
        current = self.store.get(rt.storage, self._ns(rt, namespace), name)
        if current is None:
            raise errors.not_found(rt.plural, rt.group, name)
        return self._write_scale(rt, current, body, opts or WriteOptions())

    def _patch_scale(self, rt: ResourceType, current: dict, patch_type: str, patch: object, opts: WriteOptions) -> dict:
        patched = self._apply_patch(self._scale_of(rt, current), patch_type, patch)
        return self._write_scale(rt, current, patched, opts)

    def _write_scale(self, rt: ResourceType, current: dict, scale: object, opts: WriteOptions) -> dict:
        if not isinstance(scale, dict):
            raise errors.bad_request("a Scale object is required")
        meta = scale.get("metadata") or {}
        if meta.get("resourceVersion") and meta["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise errors.stale(rt.plural, rt.group, current["metadata"]["name"])
        replicas = (scale.get("spec") or {}).get("replicas", 0)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise errors.invalid(
                "Scale",
                "autoscaling",
                current["metadata"]["name"],
                [invalid_value("spec.replicas", replicas, "must be greater than or equal to 0")],
            )
        new = clone(rt.strategy.to_external(current, rt.api_version))
        _write_path(new, self._scale_paths(rt)["spec"], replicas)
        stored = self._write_update(rt, current, new, "", opts)
        return self._scale_of(rt, stored)

    # ------------------------------------------------------------------------------------------------ delete

    def delete(
        self, rt: ResourceType, namespace: str, name: str, opts: DeleteOptions | None = None
    ) -> tuple[dict, bool]:
        """Delete (or start deleting) one object; returns (object, removed_now)."""
        opts = opts or DeleteOptions()
        ns = self._ns(rt, namespace)
        current = self.store.get(rt.storage, ns, name)
        if current is None:
            raise errors.not_found(rt.plural, rt.group, name)
        meta = current["metadata"]
        if opts.precondition_uid and opts.precondition_uid != meta["uid"]:
            raise errors.conflict(
                rt.plural,
                rt.group,
                name,
                f"Precondition failed: UID in precondition: {opts.precondition_uid}, UID in object meta: {meta['uid']}",
            )
        if opts.precondition_rv and opts.precondition_rv != meta["resourceVersion"]:
            raise errors.conflict(
                rt.plural,
                rt.group,
                name,
                f"Precondition failed: ResourceVersion in precondition: {opts.precondition_rv}, ResourceVersion in object meta: {meta['resourceVersion']}",
            )
        grace = rt.strategy.grace_period(current, opts.grace_period)
        finalizers = list(meta.get("finalizers") or [])
        if opts.propagation == "Orphan" and "orphan" not in finalizers:
            finalizers.append("orphan")
        elif opts.propagation == "Foreground" and "foregroundDeletion" not in finalizers:
            finalizers.append("foregroundDeletion")
        if meta.get("deletionTimestamp"):
            return self._shorten_deletion(rt, current, grace, opts)
        if opts.dry_run:
            return rt.strategy.to_external(current, rt.api_version), False
        if not finalizers and grace == 0 and not rt.strategy.holds_deletion(current):
            return rt.strategy.to_external(self.store.remove(rt.storage, current), rt.api_version), True
        new = clone(current)
        new_meta = new["metadata"]
        new_meta["deletionTimestamp"] = rfc3339(utcnow() + dt.timedelta(seconds=grace))
        new_meta["deletionGracePeriodSeconds"] = grace
        if finalizers:
            new_meta["finalizers"] = finalizers
        rt.strategy.begin_deletion(new)
        _order_meta(new)
        stored = self.store.put(rt.storage, new, MODIFIED)
        return rt.strategy.to_external(stored, rt.api_version), False

    def _shorten_deletion(self, rt: ResourceType, current: dict, grace: int, opts: DeleteOptions) -> tuple[dict, bool]:
        meta = current["metadata"]
        remaining = int(meta.get("deletionGracePeriodSeconds") or 0)
        if grace >= remaining or opts.dry_run:
            return rt.strategy.to_external(current, rt.api_version), False
        if grace == 0 and not meta.get("finalizers") and not rt.strategy.holds_deletion(current):
            return rt.strategy.to_external(self.store.remove(rt.storage, current), rt.api_version), True
        new = clone(current)
        new["metadata"]["deletionGracePeriodSeconds"] = grace
        new["metadata"]["deletionTimestamp"] = rfc3339(utcnow() + dt.timedelta(seconds=grace))
        stored = self.store.put(rt.storage, new, MODIFIED)
        return rt.strategy.to_external(stored, rt.api_version), False

    def delete_collection(
        self, rt: ResourceType, namespace: str | None, labels: LabelSelector, fields: FieldSelector, opts: DeleteOptions
    ) -> builtins.list[dict]:
        result = self.list(rt, namespace, labels, fields)
        deleted = []
        for item in result.items:
            try:
                obj, _ = self.delete(rt, item["metadata"].get("namespace", ""), item["metadata"]["name"], opts)
                deleted.append(obj)
            except ApiError as exc:
                if exc.code != 404:
                    raise
        return deleted

    # ---------------------------------------------------------------------------------------------- helpers

    def remove_finalizer(self, rt: ResourceType, obj: dict, finalizer: str) -> None:
        """Drop one finalizer from a stored object (used by the built-in controllers)."""
        current = self.store.get(rt.storage, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if current is None or finalizer not in (current["metadata"].get("finalizers") or []):
            return
        new = clone(current)
        new["metadata"]["finalizers"] = [f for f in new["metadata"]["finalizers"] if f != finalizer]
        if not new["metadata"]["finalizers"]:
            del new["metadata"]["finalizers"]
        if self._finished_deleting(rt, new):
            self.store.remove(rt.storage, new)
        else:
            self.store.put(rt.storage, new, MODIFIED)

    def put_system(self, rt: ResourceType, obj: dict) -> dict:
        """Write an object as a system component does: no validation, resourceVersion bumped, no-ops skipped."""
        meta = obj["metadata"]
        current = self.store.get(rt.storage, meta.get("namespace", ""), meta["name"])
        if current is not None:
            for key in ("uid", "creationTimestamp", "generation"):
                if key in current["metadata"]:
                    meta.setdefault(key, current["metadata"][key])
            if _same(obj, current):
                return current
        else:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", rfc3339())
            if rt.strategy.has_generation:
                meta.setdefault("generation", 1)
        _order_meta(obj)
        return self.store.put(rt.storage, obj, MODIFIED if current is not None else ADDED)

    @staticmethod
    def _finished_deleting(rt: ResourceType, obj: dict) -> bool:
        meta = obj["metadata"]
        return (
            bool(meta.get("deletionTimestamp"))
            and not meta.get("finalizers")
            and not meta.get("deletionGracePeriodSeconds")
            and not rt.strategy.holds_deletion(obj)
        )

    def _ns(self, rt: ResourceType, namespace: str | None) -> str:
        return (namespace or "") if rt.namespaced else ""

    def _check_body(self, rt: ResourceType, body: object) -> dict:
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request must be a JSON object")
        obj = clone(body)
        api_version = obj.get("apiVersion")
        if api_version and api_version != rt.api_version:
            raise errors.bad_request(
                f"the API version in the data ({api_version}) does not match the expected API version ({rt.api_version})"
            )
        if obj.get("kind") and obj["kind"] != rt.kind:
            raise errors.bad_request(
                f"the kind in the data ({obj['kind']}) does not match the expected kind ({rt.kind})"
            )
        obj["apiVersion"] = rt.api_version
        obj["kind"] = rt.kind
        meta = obj.get("metadata")
        if meta is None:
            obj["metadata"] = {}
        elif not isinstance(meta, dict):
            raise errors.bad_request("metadata must be an object")
        return obj

    def _validate_meta(self, rt: ResourceType, obj: dict, old: dict | None) -> builtins.list[Cause]:
        meta = obj["metadata"]
        causes: list[Cause] = []
        if old is None:
            name_check = getattr(rt.strategy, "validate_name", None)
            causes += name_check(meta["name"]) if name_check else validate_dns_subdomain("metadata.name", meta["name"])
        causes += validate_labels("metadata.labels", meta.get("labels"))
        causes += validate_annotations("metadata.annotations", meta.get("annotations"))
        for n, ref in enumerate(meta.get("ownerReferences") or []):
            if not isinstance(ref, dict):
                causes.append(invalid_value(f"metadata.ownerReferences[{n}]", ref, "must be an object"))
                continue
            for key in ("apiVersion", "kind", "name", "uid"):
                if not ref.get(key):
                    causes.append(
                        invalid_value(
                            f"metadata.ownerReferences[{n}].{key}", ref.get(key, ""), f"{key} must not be empty"
                        )
                    )
        controllers = [r for r in meta.get("ownerReferences") or [] if isinstance(r, dict) and r.get("controller")]
        if len(controllers) > 1:
            causes.append(
                invalid_value(
                    "metadata.ownerReferences",
                    meta["ownerReferences"],
                    "Only one reference can have Controller set to true",
                )
            )
        finalizers = meta.get("finalizers")
        if finalizers is not None:
            if not isinstance(finalizers, list) or not all(isinstance(f, str) for f in finalizers):
                causes.append(invalid_value("metadata.finalizers", finalizers, "must be a list of strings"))
            elif len(set(finalizers)) != len(finalizers):
                meta["finalizers"] = list(dict.fromkeys(finalizers))
        return causes

    def _check_namespace(self, rt: ResourceType, namespace: str, name: str) -> None:
        ns_obj = self.store.get(("", "namespaces"), "", namespace)
        if ns_obj is None:
            raise errors.not_found("namespaces", "", namespace)
        if ns_obj["metadata"].get("deletionTimestamp"):
            raise errors.forbidden_error(
                rt.plural,
                rt.group,
                name,
                f'{errors.qualified(rt.plural, rt.group)} "{name}" is forbidden: unable to create new content in '
                f"namespace {namespace} because it is being terminated",
            )

    @staticmethod
    def _field_validation(rt: ResourceType, pruned: builtins.list[str], opts: WriteOptions) -> None:
        if not pruned or opts.field_validation == "Ignore":
            return
        if opts.field_validation == "Strict":
            detail = ", ".join(f'unknown field "{p}"' for p in pruned)
            raise errors.bad_request(
                f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: strict decoding error: {detail}'
            )
        opts.warnings.extend(f'unknown field "{p}"' for p in pruned)


def _same(a: dict, b: dict) -> bool:
    """Equal objects apart from resourceVersion (a no-op write keeps the old resourceVersion)."""
    meta_a = {k: v for k, v in a.get("metadata", {}).items() if k != "resourceVersion"}
    meta_b = {k: v for k, v in b.get("metadata", {}).items() if k != "resourceVersion"}
    if meta_a != meta_b:
        return False
    rest_a = {k: v for k, v in a.items() if k != "metadata"}
    rest_b = {k: v for k, v in b.items() if k != "metadata"}
    return rest_a == rest_b


_META_ORDER = (
    "name",
    "generateName",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
)


def _order_meta(obj: dict) -> None:
    """Put metadata keys and the top-level keys in the order a real server answers with (nicer ``-o yaml``)."""
    meta = obj["metadata"]
    ordered = {k: meta[k] for k in _META_ORDER if k in meta}
    ordered.update({k: v for k, v in meta.items() if k not in ordered})
    obj["metadata"] = ordered
    top = {k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}
    top.update({k: v for k, v in obj.items() if k not in top})
    obj.clear()
    obj.update(top)


def _read_path(obj: dict, path: str) -> Any:
    try:
        keys = simple_path(path)
    except JSONPathError:
        return None
    node: Any = obj
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _write_path(obj: dict, path: str, value) -> None:
    keys = simple_path(path)
    node = obj
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
