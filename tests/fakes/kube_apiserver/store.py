"""Versioned object storage: one global resourceVersion counter and a full change history, like etcd's MVCC."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, Callable

from .errors import expired
from .meta import format_time, metadata, new_uid, now

StoreKey = tuple[str, str]  # (storage resource, "namespace/name" or "name")


@dataclass(frozen=True)
class Change:
    """One committed write; `obj` is the state after it (for DELETED, the last state at the delete's rv)."""

    rv: int
    type: str
    resource: str
    key: str
    obj: dict[str, Any]
    prev: dict[str, Any] | None


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata", {})
    namespace = meta.get("namespace")
    return f"{namespace}/{meta['name']}" if namespace else meta["name"]


class Store:
    """Thread-safe objects keyed like etcd (`ns/name`), with watchable history and compaction."""

    def __init__(self, start_rv: int = 1000):
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        self._rv = start_rv
        self._objects: dict[StoreKey, dict[str, Any]] = {}
        self._history: list[Change] = []
        self._compacted_rv = 0
        self._epoch = 0

    @property
    def rv(self) -> int:
        with self.lock:
            return self._rv

    @property
    def compacted_rv(self) -> int:
        with self.lock:
            return self._compacted_rv

    def get(self, resource: str, key: str) -> dict[str, Any] | None:
        with self.lock:
            found = self._objects.get((resource, key))
            return copy.deepcopy(found) if found is not None else None

    def list(self, resource: str, at_rv: int | None = None) -> list[tuple[str, dict[str, Any]]]:
        """All objects of `resource` sorted by key, now or as of `at_rv` (410 if compacted)."""
        with self.lock:
            if at_rv is None or at_rv >= self._rv:
                items = [(k[1], copy.deepcopy(o)) for k, o in self._objects.items() if k[0] == resource]
            else:
                items = list(self._snapshot(resource, at_rv).items())
            return sorted(items, key=lambda item: item[0])

    def _snapshot(self, resource: str, at_rv: int) -> dict[str, dict[str, Any]]:
        if at_rv < self._compacted_rv:
            raise expired(f"too old resource version: {at_rv} ({self._compacted_rv})")
        state: dict[str, dict[str, Any]] = {}
        for change in self._history:
            if change.rv > at_rv:
                break
            if change.resource != resource:
                continue
            if change.type == "DELETED":
                state.pop(change.key, None)
            else:
                state[change.key] = copy.deepcopy(change.obj)
        return state

    def create(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Insert a new object, filling uid/creationTimestamp/resourceVersion like the registry does."""
        with self.lock:
            obj = copy.deepcopy(obj)
            meta = metadata(obj)
            meta.setdefault("uid", new_uid())
            meta.setdefault("creationTimestamp", format_time(now()))
            return self._commit("ADDED", resource, obj, None)

    def update(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace an existing object; a byte-identical result is a no-op (no new rv, no event)."""
        with self.lock:
            key = object_key(obj)
            prev = self._objects[(resource, key)]
            if _without_rv(obj) == _without_rv(prev):
                return copy.deepcopy(prev)
            return self._commit("MODIFIED", resource, copy.deepcopy(obj), prev)

    def delete(self, resource: str, key: str) -> dict[str, Any]:
        with self.lock:
            prev = self._objects[(resource, key)]
            return self._commit("DELETED", resource, copy.deepcopy(prev), prev)

    def mutate(self, resource: str, key: str, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply `edit` to a copy of the current object under the lock and commit it."""
        with self.lock:
            obj = self.get(resource, key)
            if obj is None:
                raise KeyError(key)
            edit(obj)
            return self.update(resource, obj)

    def _commit(self, kind: str, resource: str, obj: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any]:
        self._rv += 1
        metadata(obj)["resourceVersion"] = str(self._rv)
        key = object_key(obj)
        if kind == "DELETED":
            del self._objects[(resource, key)]
        else:
            self._objects[(resource, key)] = obj
        self._history.append(Change(self._rv, kind, resource, key, copy.deepcopy(obj), copy.deepcopy(prev)))
        self._changed.notify_all()
        return copy.deepcopy(obj)

    def changes_after(self, rv: int, resource: str) -> tuple[list[Change], int]:
        """Changes to `resource` newer than `rv`, and the global rv they were read at."""
        with self.lock:
            if rv < self._compacted_rv:
                raise expired(f"too old resource version: {rv} ({self._compacted_rv})")
            return [c for c in self._history if c.rv > rv and c.resource == resource], self._rv

    def wait(self, after_rv: int, epoch: int, timeout: float) -> None:
        """Block until a write newer than `after_rv`, an epoch bump (shutdown), or `timeout`."""
        with self.lock:
            self._changed.wait_for(lambda: self._rv > after_rv or self._epoch != epoch, timeout=timeout)

    @property
    def epoch(self) -> int:
        with self.lock:
            return self._epoch

    def wake_all(self) -> None:
        """End every open watch (server stopping or going down)."""
        with self.lock:
            self._epoch += 1
            self._changed.notify_all()

    def compact(self) -> int:
        """Forget history: watches and continue tokens older than now get 410 Expired."""
        with self.lock:
            self._compacted_rv = self._rv
            return self._rv


def _without_rv(obj: dict[str, Any]) -> dict[str, Any]:
    clone = dict(obj)
    clone["metadata"] = {k: v for k, v in obj.get("metadata", {}).items() if k != "resourceVersion"}
    return clone
