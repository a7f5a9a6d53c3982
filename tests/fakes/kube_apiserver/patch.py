"""The three PATCH flavours the API server accepts for built-in types: JSON patch, merge patch, strategic merge."""

from __future__ import annotations

import copy
from typing import Any, Mapping

from .errors import ApiError, bad_request, unprocessable

# Value for a strategic-merge schema entry: merge a list of scalars as a set (patchStrategy "merge", no key).
PRIMITIVE = ""
SmpSchema = Mapping[tuple[str, ...], str]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null deletes, anything else (lists included) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: dict[str, Any], patch: dict[str, Any], schema: SmpSchema) -> dict[str, Any]:
    """Strategic merge: like merge patch, but lists declared in `schema` merge by key (or as sets)."""
    if not isinstance(patch, dict):
        raise bad_request("strategic merge patch body must be a JSON object")
    merged = _merge_map(target, patch, schema, ())
    return merged if merged is not None else {}


def _merge_map(original: Any, patch: dict[str, Any], schema: SmpSchema, path: tuple[str, ...]) -> dict | None:
    patch = dict(patch)
    directive = patch.pop("$patch", None)
    if directive == "delete":
        return None
    if directive == "replace":
        return _strip(patch)
    if directive not in (None, "merge"):
        raise bad_request(f"Unknown patch type: {directive} in map: {patch}")
    prim_deletes: dict[str, list[Any]] = {}
    for key in [k for k in patch if k.startswith("$")]:
        value = patch.pop(key)
        if key.startswith("$deleteFromPrimitiveList/"):
            prim_deletes[key.split("/", 1)[1]] = value if isinstance(value, list) else []
        # $setElementOrder/ and $retainKeys only affect ordering/pruning; the fake ignores them.
    result = copy.deepcopy(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        sub = path + (key,)
        current = result.get(key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = _merge_map(current if isinstance(current, dict) else {}, value, schema, sub)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and sub in schema:
            result[key] = _merge_list(current if isinstance(current, list) else [], value, schema, sub)
        else:
            # Atomic lists and scalars are replaced verbatim; stray `$patch` keys inside an atomic list
            # survive here and are dropped later as unknown fields, exactly as the real decoder does.
            result[key] = copy.deepcopy(value)
    for key, doomed in prim_deletes.items():
        if isinstance(result.get(key), list):
            result[key] = [v for v in result[key] if v not in doomed]
    return result


def _merge_list(original: list[Any], patch: list[Any], schema: SmpSchema, path: tuple[str, ...]) -> list[Any]:
    merge_key = schema[path]
    if merge_key == PRIMITIVE:
        return copy.deepcopy(original) + [v for v in patch if v not in original]
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [_strip(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    result = copy.deepcopy(original)
    for item in patch:
        if not isinstance(item, dict):
            raise bad_request(f"unable to find api field in struct for the list {path[-1]}: expected a map")
        if merge_key not in item:
            raise ApiError(500, f"map: {item} does not contain declared merge key: {merge_key}")
        index = next((n for n, o in enumerate(result) if isinstance(o, dict) and o.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            result = [o for o in result if not (isinstance(o, dict) and o.get(merge_key) == item[merge_key])]
        elif index is None:
            result.append(_strip(item))
        else:
            merged = _merge_map(result[index], item, schema, path)
            result[index] = merged if merged is not None else result[index]
    return result


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 add/remove/replace/move/copy/test; a malformed patch is 400, a failing one 422."""
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"invalid JSON patch operation: {op}")
        doc = _apply_op(doc, op)
    return doc


def _apply_op(doc: Any, op: dict[str, Any]) -> Any:
    kind, path = op["op"], op["path"]
    if kind in ("add", "replace", "test") and "value" not in op:
        raise bad_request(f"missing value for op {kind}")
    if kind == "add":
        return _add(doc, path, copy.deepcopy(op["value"]))
    if kind == "remove":
        doc, _ = _remove(doc, path)
        return doc
    if kind == "replace":
        _get(doc, path)
        doc, _ = _remove(doc, path) if path else (doc, None)
        return _add(doc, path, copy.deepcopy(op["value"]))
    if kind in ("move", "copy"):
        if "from" not in op:
            raise bad_request(f"missing from for op {kind}")
        value = copy.deepcopy(_get(doc, op["from"]))
        if kind == "move":
            doc, _ = _remove(doc, op["from"])
        return _add(doc, path, value)
    if kind == "test":
        if _get(doc, path) != op["value"]:
            raise unprocessable(f"testing value {path} failed: test failed")
        return doc
    raise bad_request(f"Unexpected kind: {kind}")


def _tokens(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise unprocessable(f"JSON pointer must start with '/': {path}")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _container(doc: Any, path: str) -> tuple[Any, str]:
    tokens = _tokens(path)
    if not tokens:
        raise unprocessable(f"unable to operate on the document root: {path}")
    node = doc
    for token in tokens[:-1]:
        node = _child(node, token, path)
    return node, tokens[-1]


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict) and token in node:
        return node[token]
    if isinstance(node, list) and token.isdigit() and int(token) < len(node):
        return node[int(token)]
    raise unprocessable(f"doc is missing path: \"{path}\": missing value")


def _get(doc: Any, path: str) -> Any:
    node = doc
    for token in _tokens(path):
        node = _child(node, token, path)
    return node


def _add(doc: Any, path: str, value: Any) -> Any:
    if path == "":
        return value
    parent, last = _container(doc, path)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise unprocessable(f"add operation does not apply: doc is missing path: \"{path}\": missing value")
    else:
        raise unprocessable(f"add operation does not apply: doc is missing path: \"{path}\": missing value")
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    parent, last = _container(doc, path)
    if isinstance(parent, dict) and last in parent:
        return doc, parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return doc, parent.pop(int(last))
    raise unprocessable(f"remove operation does not apply: doc is missing path: \"{path}\": missing value")
