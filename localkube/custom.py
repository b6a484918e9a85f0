"""CustomResourceDefinitions and the custom resources they define.

``CRDStrategy`` validates and defaults apiextensions.k8s.io/v1 CRDs and fills their status (``NamesAccepted``,
``Established``, ``acceptedNames``, ``storedVersions``). ``crd_resource_types`` turns a stored CRD into one
``ResourceType`` per served version, each with a ``CustomResourceStrategy`` that prunes, defaults and validates
objects against that version's structural schema and renders its ``additionalPrinterColumns``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from localkube import structural
from localkube.errors import Cause, invalid_value, not_supported, required_value
from localkube.jsonpath import JSONPathError, compile_path, find, simple_path
from localkube.meta import age, clone, parse_time, rfc3339, validate_dns_label, validate_dns_subdomain
from localkube.registry import ResourceType, version_priority
from localkube.strategy import BASE_FIELD_SELECTORS, NAME_COLUMN, Column, Strategy

CLEANUP_FINALIZER = "customresourcecleanup.apiextensions.k8s.io"
_COLUMN_TYPES = ("integer", "number", "string", "boolean", "date")
_DEFAULT_AGE = {
    "name": "Age",
    "type": "date",
    "jsonPath": ".metadata.creationTimestamp",
    "description": "CreationTimestamp is a timestamp representing the server time when this object was created.",
}


def _names_with_defaults(names: dict) -> dict:
    out = clone(names)
    if out.get("kind"):
        out.setdefault("singular", out["kind"].lower())
        out.setdefault("listKind", out["kind"] + "List")
    return out


@dataclass
class CRDStrategy(Strategy):
    has_generation: bool = True
    status_subresource: bool = True

    def prepare_create(self, obj, core):
        super().prepare_create(obj, core)
        self._defaults(obj)
        finalizers = obj["metadata"].setdefault("finalizers", [])
        if CLEANUP_FINALIZER not in finalizers:
            finalizers.append(CLEANUP_FINALIZER)
        obj["status"] = self._status(obj, {})

    def prepare_update(self, new, old, core):
        super().prepare_update(new, old, core)
        self._defaults(new)
        new["status"] = self._status(new, old.get("status") or {})

    def prepare_status_update(self, new, old, core):
        result = super().prepare_status_update(new, old, core)
        result["status"] = self._status(result, old.get("status") or {})
        return result

    def begin_deletion(self, obj):
        obj["status"] = self._status(obj, obj.get("status") or {})

    @staticmethod
    def _defaults(obj: dict) -> None:
        spec = obj.setdefault("spec", {})
        if isinstance(spec.get("names"), dict):
            spec["names"] = _names_with_defaults(spec["names"])
        spec.setdefault("conversion", {"strategy": "None"})

    @staticmethod
    def _status(obj: dict, old_status: dict) -> dict:
        spec = obj.get("spec") or {}
        now = rfc3339()
        old_conditions = {c.get("type"): c for c in old_status.get("conditions") or []}

        def condition(kind: str, reason: str, message: str) -> dict:
            previous = old_conditions.get(kind)
            since = previous["lastTransitionTime"] if previous and previous.get("status") == "True" else now
            return {"type": kind, "status": "True", "lastTransitionTime": since, "reason": reason, "message": message}

        conditions = [
            condition("NamesAccepted", "NoConflicts", "no conflicts found"),
            condition("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        ]
        if obj["metadata"].get("deletionTimestamp"):
            conditions.append(
                {
                    "type": "Terminating",
                    "status": "True",
                    "lastTransitionTime": now,
                    "reason": "InstanceDeletionInProgress",
                    "message": "CustomResource deletion is in progress",
                }
            )
        stored = list(old_status.get("storedVersions") or [])
        for version in spec.get("versions") or []:
            if isinstance(version, dict) and version.get("storage") and version.get("name") not in stored:
                stored.append(version["name"])
        return {"conditions": conditions, "acceptedNames": clone(spec.get("names") or {}), "storedVersions": stored}

    def validate(self, obj, old, core):
        return validate_crd(obj, old)

    def columns(self):
        return [
            NAME_COLUMN,
            Column(
                "Created At",
                type="date",
                description="CreationTimestamp is a timestamp representing the server time when this object was created.",
            ),
        ]

    def cells(self, obj, now):
        return [obj["metadata"]["name"], obj["metadata"].get("creationTimestamp", "")]


def validate_crd(obj: dict, old: dict | None) -> list[Cause]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [required_value("spec")]
    causes: list[Cause] = []
    group = spec.get("group") or ""
    names = spec.get("names") or {}
    if not group:
        causes.append(required_value("spec.group"))
    elif "." not in group:
        causes.append(invalid_value("spec.group", group, "should be a domain with at least one dot"))
    else:
        causes += validate_dns_subdomain("spec.group", group)
    plural = names.get("plural") or ""
    if not plural:
        causes.append(required_value("spec.names.plural"))
    else:
        causes += validate_dns_label("spec.names.plural", plural)
    if not names.get("kind"):
        causes.append(required_value("spec.names.kind"))
    if names.get("singular"):
        causes += validate_dns_label("spec.names.singular", names["singular"])
    for n, short in enumerate(names.get("shortNames") or []):
        causes += validate_dns_label(f"spec.names.shortNames[{n}]", short)
    if plural and group and obj["metadata"]["name"] != f"{plural}.{group}":
        causes.append(
            invalid_value("metadata.name", obj["metadata"]["name"], 'must be spec.names.plural+"."+spec.group')
        )
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        causes.append(not_supported("spec.scope", spec.get("scope"), ["Cluster", "Namespaced"]))
    versions = spec.get("versions")
    if not isinstance(versions, list) or not versions:
        causes.append(
            invalid_value("spec.versions", versions, "must have exactly one version marked as storage version")
        )
        versions = []
    storage = [v for v in versions if isinstance(v, dict) and v.get("storage")]
    if versions and len(storage) != 1:
        causes.append(
            invalid_value("spec.versions", versions, "must have exactly one version marked as storage version")
        )
    seen: set[str] = set()
    for n, version in enumerate(versions):
        path = f"spec.versions[{n}]"
        if not isinstance(version, dict):
            causes.append(invalid_value(path, version, "must be an object"))
            continue
        vname = version.get("name") or ""
        if not vname:
            causes.append(required_value(f"{path}.name"))
        elif not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", vname):
            causes.append(invalid_value(f"{path}.name", vname, "must be a valid DNS-1035 label"))
        if vname in seen:
            causes.append(Cause(f"{path}.name", "FieldValueDuplicate", f'Duplicate value: "{vname}"'))
        seen.add(vname)
        for key in ("served", "storage"):
            if not isinstance(version.get(key), bool):
                causes.append(required_value(f"{path}.{key}"))
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            causes.append(required_value(f"{path}.schema.openAPIV3Schema", "schemas are required"))
        else:
            causes += structural.check_structural(schema, f"{path}.schema.openAPIV3Schema")
        causes += _validate_subresources(path, version.get("subresources"))
        for m, col in enumerate(version.get("additionalPrinterColumns") or []):
            cpath = f"{path}.additionalPrinterColumns[{m}]"
            if not isinstance(col, dict):
                causes.append(invalid_value(cpath, col, "must be an object"))
                continue
            if not col.get("name"):
                causes.append(required_value(f"{cpath}.name"))
            if col.get("type") not in _COLUMN_TYPES:
                causes.append(not_supported(f"{cpath}.type", col.get("type"), list(_COLUMN_TYPES)))
            if not col.get("jsonPath"):
                causes.append(required_value(f"{cpath}.jsonPath"))
            else:
                try:
                    compile_path(col["jsonPath"])
                except JSONPathError as exc:
                    causes.append(
                        invalid_value(f"{cpath}.jsonPath", col["jsonPath"], f"must be a simple json path: {exc}")
                    )
        for m, sel in enumerate(version.get("selectableFields") or []):
            try:
                simple_path(sel.get("jsonPath", ""))
            except (JSONPathError, AttributeError):
                causes.append(invalid_value(f"{path}.selectableFields[{m}].jsonPath", sel, "must be a simple path"))
    if old is not None:
        old_spec = old.get("spec") or {}
        if old_spec.get("scope") and spec.get("scope") != old_spec.get("scope"):
            causes.append(invalid_value("spec.scope", spec.get("scope"), "field is immutable"))
        if old_spec.get("group") and group != old_spec.get("group"):
            causes.append(invalid_value("spec.group", group, "field is immutable"))
    return causes


def _validate_subresources(path: str, subresources) -> list[Cause]:
    if subresources is None:
        return []
    if not isinstance(subresources, dict):
        return [invalid_value(f"{path}.subresources", subresources, "must be an object")]
    scale = subresources.get("scale")
    if scale is None:
        return []
    causes = []
    for key, prefix in (("specReplicasPath", ".spec."), ("statusReplicasPath", ".status.")):
        value = scale.get(key) if isinstance(scale, dict) else None
        if not value:
            causes.append(required_value(f"{path}.subresources.scale.{key}"))
        elif not value.startswith(prefix):
            causes.append(
                invalid_value(
                    f"{path}.subresources.scale.{key}", value, f"should be a json path under {prefix.rstrip('.')}"
                )
            )
    selector = scale.get("labelSelectorPath") if isinstance(scale, dict) else None
    if selector and not (selector.startswith((".spec.", ".status."))):
        causes.append(
            invalid_value(
                f"{path}.subresources.scale.labelSelectorPath",
                selector,
                "should be a json path under either .spec or .status",
            )
        )
    return causes


@dataclass
class CustomResourceStrategy(Strategy):
    """One served version of a custom resource."""

    has_generation: bool = True
    strategic_merge: bool = False
    schema: dict | None = None
    storage_api_version: str = ""
    printer_columns: list[dict] = field(default_factory=list)
    scale_paths: dict | None = None
    _compiled_columns: list = field(default_factory=list)

    def __post_init__(self):
        self._compiled_columns = []
        for col in self.printer_columns:
            try:
                self._compiled_columns.append(compile_path(col["jsonPath"]))
            except (JSONPathError, KeyError):
                self._compiled_columns.append([])

    def prune_and_default(self, obj, api_version):
        if self.schema is None:
            return []
        pruned = structural.prune(obj, self.schema, root=True)
        structural.apply_defaults(obj, self.schema)
        return pruned

    def validate_schema(self, obj, api_version):
        return structural.validate(obj, self.schema, root=True)

    def to_internal(self, obj, storage_api_version):
        obj["apiVersion"] = storage_api_version
        return obj

    def columns(self):
        cols = [NAME_COLUMN]
        for col in self.printer_columns:
            cols.append(
                Column(
                    col.get("name", ""),
                    type=col.get("type", "string"),
                    format=col.get("format", ""),
                    description=col.get("description", ""),
                    priority=int(col.get("priority") or 0),
                )
            )
        return cols

    def cells(self, obj, now):
        cells: list = [obj["metadata"]["name"]]
        for col, steps in zip(self.printer_columns, self._compiled_columns):
            values = find(obj, steps) if steps else []
            cells.append(_cell(col.get("type", "string"), values[0]) if values else None)
        return cells


def _cell(kind: str, value):
    if value is None:
        return None
    if kind == "integer":
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if kind == "boolean":
        return value if isinstance(value, bool) else None
    if kind == "date":
        if not isinstance(value, str):
            return None
        return age(value) if parse_time(value) is not None else "<invalid>"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def crd_resource_types(crd: dict) -> list[ResourceType]:
    """The served versions of a stored CRD as resource types (empty when the CRD is unusable)."""
    spec = crd.get("spec") or {}
    names = _names_with_defaults(spec.get("names") or {})
    group = spec.get("group", "")
    versions = [v for v in spec.get("versions") or [] if isinstance(v, dict)]
    storage = next((v["name"] for v in versions if v.get("storage")), None)
    if not group or not names.get("plural") or storage is None:
        return []
    storage_api_version = f"{group}/{storage}"
    served = [v for v in versions if v.get("served")]
    preferred = sorted(served, key=lambda v: version_priority(v["name"]))[0]["name"] if served else None
    types = []
    for version in served:
        subresources = version.get("subresources") or {}
        columns = version.get("additionalPrinterColumns") or [_DEFAULT_AGE]
        scale = subresources.get("scale")
        strategy = CustomResourceStrategy(
            status_subresource="status" in subresources,
            schema=(version.get("schema") or {}).get("openAPIV3Schema"),
            storage_api_version=storage_api_version,
            printer_columns=columns,
            scale_paths={
                "spec": scale["specReplicasPath"],
                "status": scale["statusReplicasPath"],
                "selector": scale.get("labelSelectorPath"),
            }
            if isinstance(scale, dict)
            else None,
            field_selectors=BASE_FIELD_SELECTORS
            | {
                sel["jsonPath"].lstrip(".")
                for sel in version.get("selectableFields") or []
                if isinstance(sel, dict) and sel.get("jsonPath")
            },
        )
        subs: dict[str, tuple[str, ...]] = {}
        if "status" in subresources:
            subs["status"] = ("get", "patch", "update")
        if scale is not None:
            subs["scale"] = ("get", "patch", "update")
        types.append(
            ResourceType(
                group,
                version["name"],
                names["plural"],
                names.get("singular", ""),
                names["kind"],
                spec.get("scope") == "Namespaced",
                strategy,
                tuple(names.get("shortNames") or ()),
                tuple(names.get("categories") or ()),
                subresources=subs,
                storage=(group, names["plural"]),
                storage_version=storage_api_version,
                list_kind=names.get("listKind", ""),
                preferred=version["name"] == preferred,
            )
        )
    return types
