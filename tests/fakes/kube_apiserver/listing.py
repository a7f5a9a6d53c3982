"""LIST with limit/continue/remainingItemCount, and WATCH streams, following the etcd3 store and watch cache."""

from __future__ import annotations

import base64
import binascii
import json
import time
from typing import Any, Iterator

from .errors import ApiError, bad_request, expired
from .resources import ResourceType
from .selectors import FieldSelector, LabelSelector
from .store import Change, Store

_CONTINUE_VERSION = "meta.k8s.io/v1"
_CONTINUE_EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter, or use the continue token in this response to retrieve the remainder of the "
    "results. Continuing with the provided token results in an inconsistent list - objects that were created, "
    "modified, or deleted between the time the first chunk was returned and now may show up in the list."
)


class Filter:
    """Namespace + label selector + field selector, as the registry's SelectionPredicate."""

    def __init__(self, resource: ResourceType, namespace: str | None, query: dict[str, str]):
        self.resource = resource
        self.namespace = namespace
        self.labels = LabelSelector.parse(query.get("labelSelector"))
        self.fields = FieldSelector.parse(query.get("fieldSelector"), resource.selectable_fields)

    @property
    def empty(self) -> bool:
        return self.labels.empty and self.fields.empty

    def in_scope(self, obj: dict[str, Any]) -> bool:
        return self.namespace is None or obj.get("metadata", {}).get("namespace") == self.namespace

    def matches(self, obj: dict[str, Any]) -> bool:
        return (self.in_scope(obj) and self.labels.matches(obj.get("metadata", {}).get("labels"))
                and self.fields.matches(self.resource.selectable(obj)))


def encode_continue(rv: int, start: str) -> str:
    raw = json.dumps({"v": _CONTINUE_VERSION, "rv": rv, "start": start}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, str]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"continue key is not valid: {exc}") from None
    if not isinstance(data, dict) or data.get("v") != _CONTINUE_VERSION:
        version = data.get("v") if isinstance(data, dict) else None
        raise bad_request(f"continue key is not valid: server does not recognize this encoded version {version}")
    if not data.get("rv"):
        raise bad_request("continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)")
    if not data.get("start"):
        raise bad_request("continue key is not valid: encoded start key empty (version meta.k8s.io/v1)")
    return int(data["rv"]), str(data["start"])


def list_objects(store: Store, resource: ResourceType, namespace: str | None,
                 query: dict[str, str]) -> dict[str, Any]:
    """One page of a LIST, keyed and paginated the way the etcd3 storage layer does it."""
    selection = Filter(resource, namespace, query)
    limit = _int_param(query, "limit")
    token, rv_param = query.get("continue", ""), query.get("resourceVersion", "")
    start = ""
    at_rv: int | None = None
    if token:
        if rv_param:
            raise bad_request("specifying resource version is not allowed when using continue")
        at_rv, start = decode_continue(token)
    elif rv_param and query.get("resourceVersionMatch") == "Exact":
        at_rv = _int_value(rv_param, "resourceVersion")
    with store.lock:
        try:
            rows = store.list(resource.storage, at_rv)
        except ApiError:
            raise expired(_CONTINUE_EXPIRED if token else f"too old resource version: {at_rv} ({store.compacted_rv})")
        list_rv = at_rv if at_rv is not None else store.rv
    prefix = f"{namespace}/" if namespace else ""
    # Keys are relative to the etcd range prefix, e.g. "node-7" for nodes or "name" within one namespace.
    candidates = [(key[len(prefix):], obj) for key, obj in rows if key.startswith(prefix) and key[len(prefix):] >= start]
    page: list[dict[str, Any]] = []
    last_key, has_more = "", False
    for key, obj in candidates:
        if limit and len(page) >= limit:
            has_more = True
            break
        last_key = key
        if selection.matches(obj):
            page.append(obj)
    meta: dict[str, Any] = {"resourceVersion": str(list_rv)}
    if has_more:
        meta["continue"] = encode_continue(list_rv, last_key + "\x00")
        if selection.empty:
            meta["remainingItemCount"] = len(candidates) - len(page)
    return {"kind": f"{resource.kind}List", "apiVersion": resource.api_version, "metadata": meta,
            "items": [_as_list_item(obj) for obj in page]}


def _as_list_item(obj: dict[str, Any]) -> dict[str, Any]:
    # Items of a typed list carry no TypeMeta in the server's JSON.
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _int_param(query: dict[str, str], name: str) -> int:
    return _int_value(query[name], name) if query.get(name) else 0


def _int_value(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise bad_request(f'invalid value "{text}" for {name}') from None


def open_watch(store: Store, resource: ResourceType, namespace: str | None,
               query: dict[str, str]) -> Iterator[dict[str, Any] | None]:
    """Validate a WATCH and return its event stream; `None` items are idle ticks, not events."""
    selection = Filter(resource, namespace, query)
    timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
    bookmarks = query.get("allowWatchBookmarks") in ("1", "true", "True")
    rv_param = query.get("resourceVersion", "")
    with store.lock:
        epoch = store.epoch
        if rv_param in ("", "0"):
            cursor = store.rv
            initial = [_event("ADDED", obj) for _, obj in store.list(resource.storage) if selection.matches(obj)]
        else:
            cursor = _int_value(rv_param, "resourceVersion")
            initial = []
    return _stream(store, selection, cursor, epoch, initial, timeout, bookmarks)


def _stream(store: Store, selection: Filter, cursor: int, epoch: int, initial: list[dict[str, Any]],
            timeout: float | None, bookmarks: bool) -> Iterator[dict[str, Any] | None]:
    deadline = time.monotonic() + timeout if timeout is not None else None
    yield from initial
    while True:
        try:
            changes, cursor_now = store.changes_after(cursor, selection.resource.storage)
        except ApiError as err:
            # An expired resourceVersion is reported in-stream as an ERROR event, as the watch cache does.
            yield {"type": "ERROR", "object": err.body()}
            return
        for change in changes:
            event = _convert(change, selection)
            if event is not None:
                yield event
        cursor = cursor_now
        remaining = deadline - time.monotonic() if deadline is not None else 0.5
        if store.epoch != epoch or remaining <= 0:
            if bookmarks and store.epoch == epoch:
                yield {"type": "BOOKMARK", "object": {"kind": selection.resource.kind,
                                                      "apiVersion": selection.resource.api_version,
                                                      "metadata": {"resourceVersion": str(cursor)}}}
            return
        store.wait(cursor, epoch, min(remaining, 0.5))
        yield None  # lets the HTTP layer notice a client that hung up


def _convert(change: Change, selection: Filter) -> dict[str, Any] | None:
    """Turn a storage change into what a filtered watcher sees (cacheWatcher.convertToWatchEvent)."""
    now_passes = change.type != "DELETED" and selection.matches(change.obj)
    before_passes = change.prev is not None and selection.matches(change.prev)
    if now_passes and not before_passes:
        return _event("ADDED", change.obj)
    if now_passes and before_passes:
        return _event("MODIFIED", change.obj)
    if before_passes:
        gone = dict(change.prev or {})
        gone["metadata"] = {**gone.get("metadata", {}), "resourceVersion": str(change.rv)}
        return _event("DELETED", gone)
    return None


def _event(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}
