"""The three PATCH dialects an API server speaks: JSON merge patch, JSON patch and strategic merge patch.

Strategic merge patch is implemented for the built-in types well enough for ``kubectl apply``, ``annotate``,
``label``, ``scale`` and ``patch``: lists of containers, env, ports, volumes, conditions... merge by their Go
``patchMergeKey``; other lists are replaced; ``$patch``, ``$retainKeys``, ``$deleteFromPrimitiveList`` and
``$setElementOrder`` directives are honoured.
"""

from __future__ import annotations

import jsonpatch

from localkube.errors import ApiError, bad_request
from localkube.meta import clone

# Field name -> merge key of list items (from the Go types' patchMergeKey tags). "" marks a primitive list merged as a set.
_MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "volumes": "name",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "finalizers": "",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
    "secrets": "name",
    "addresses": "type",
    "taints": "key",
    "podIPs": "ip",
    "hostIPs": "ip",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "readinessGates": "conditionType",
    "ephemeralContainerStatuses": "name",
}


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return clone(patch)
    result = clone(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: dict, operations: object) -> dict:
    """RFC 6902 JSON patch; a failed operation (including ``test``) is a 422 like the real server's."""
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    try:
        patch = jsonpatch.JsonPatch(operations)
    except (jsonpatch.InvalidJsonPatch, TypeError, KeyError) as exc:
        raise bad_request(str(exc)) from exc
    try:
        return patch.apply(clone(target))
    except jsonpatch.JsonPatchTestFailed as exc:
        raise ApiError(
            422, "Invalid", f"the server rejected our request due to an error in our request: {exc}"
        ) from exc
    except (
        jsonpatch.JsonPatchConflict,
        jsonpatch.JsonPatchException,
        jsonpatch.JsonPointerException,
        IndexError,
        KeyError,
        TypeError,
    ) as exc:
        raise ApiError(
            422, "Invalid", f"the server rejected our request due to an error in our request: {exc}"
        ) from exc


def _merge_key_for(field: str, items: list) -> str | None:
    if field == "ports":
        sample = next((i for i in items if isinstance(i, dict)), None)
        if sample is None:
            return None
        return "containerPort" if "containerPort" in sample else "port"
    return _MERGE_KEYS.get(field)


def strategic_merge_patch(target: object, patch: object) -> object:
    if not isinstance(patch, dict):
        return clone(patch)
    return _smp_map(target if isinstance(target, dict) else {}, patch)


def _smp_map(original: dict, patch: dict) -> dict:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: clone(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return {}
    result = clone(original)
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list) and isinstance(value, list):
                result[field] = [v for v in result[field] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
            continue
        current = result.get(key)
        if isinstance(value, dict):
            if value.get("$patch") == "delete":
                result.pop(key, None)
            else:
                result[key] = _smp_map(current if isinstance(current, dict) else {}, value)
        elif isinstance(value, list):
            result[key] = _smp_list(key, current if isinstance(current, list) else [], value)
        else:
            result[key] = clone(value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list) and isinstance(value, list):
                result[field] = _reorder(field, result[field], value)
    return result


def _smp_list(field: str, original: list, patch: list) -> list:
    merge_key = _merge_key_for(field, patch + original)
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [clone(i) for i in patch if not (isinstance(i, dict) and i.get("$patch") == "replace")]
    if merge_key is None:
        return [clone(i) for i in patch]
    if merge_key == "":
        result = [clone(i) for i in original]
        for item in patch:
            if item not in result:
                result.append(clone(item))
        return result
    result = [clone(i) for i in original]
    for item in patch:
        if not isinstance(item, dict):
            continue
        key = item.get(merge_key)
        index = next((n for n, o in enumerate(result) if isinstance(o, dict) and o.get(merge_key) == key), None)
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
            continue
        if index is None:
            result.append({k: clone(v) for k, v in item.items() if k != "$patch"})
        else:
            result[index] = _smp_map(result[index], item)
    return result


def _reorder(field: str, items: list, order: list) -> list:
    merge_key = _merge_key_for(field, items)
    if merge_key is None:
        return items

    def key_of(item):
        return item.get(merge_key) if merge_key and isinstance(item, dict) else item

    wanted = [key_of(o) if isinstance(o, dict) else o for o in order]
    position = {k: n for n, k in enumerate(wanted) if isinstance(k, (str, int, float))}
    indexed = list(enumerate(items))
    indexed.sort(key=lambda pair: position.get(key_of(pair[1]), len(position) + pair[0]))
    return [item for _, item in indexed]
