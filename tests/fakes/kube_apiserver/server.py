"""FakeKubeApiServer: lifecycle, fault knobs, request log and "someone else edits the cluster" helpers."""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable, Iterable

from .faults import Fault, FaultQueue
from .handlers import ResourceHandlers
from .meta import normalize
from .objects import condition, node_object, pod_object
from .resources import NODES, PODS
from .router import Router
from .store import Store
from .transport import HttpServer, RequestRecord


class FakeKubeApiServer:
    """An in-process Kubernetes API server (nodes, pods, events) on 127.0.0.1 for the official client."""

    def __init__(self) -> None:
        self._store = Store()
        self._handlers = ResourceHandlers(self._store)
        self._faults = FaultQueue()
        self._router: Router | None = None
        self._requests: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._httpd: HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._port = 0
        self._down = False
        self.latency_s = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> FakeKubeApiServer:
        self._listen()
        return self

    def stop(self) -> None:
        self._close_listener()
        self._drop_connections()
        self._store.wake_all()

    def __enter__(self) -> FakeKubeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if not self._port:
            raise RuntimeError("FakeKubeApiServer is not started")
        return f"http://127.0.0.1:{self._port}"

    def down(self) -> None:
        """Stop accepting connections and cut open ones (watches included) without a response."""
        self._down = True
        self._close_listener()
        self._drop_connections()
        self._store.wake_all()

    def up(self) -> None:
        """Listen again on the same port, with all objects intact."""
        self._down = False
        self._listen()

    @property
    def is_down(self) -> bool:
        return self._down

    def _listen(self) -> None:
        if self._httpd is not None:
            return
        self._httpd = HttpServer(self._port, self)
        self._port = self._httpd.server_port
        self._router = Router(self._handlers, f"127.0.0.1:{self._port}")
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fake-kube-apiserver-{self._port}", daemon=True)
        self._thread.start()

    def _close_listener(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

    def _drop_connections(self) -> None:
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _track(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)

    def _untrack(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)

    # -- fault injection and request log -----------------------------------------------------------------------

    def fail_next(self, status: int, count: int = 1, methods: Iterable[str] | None = None,
                  path_contains: str | None = None, retry_after: float | None = None,
                  message: str | None = None) -> None:
        """Answer the next `count` matching requests with a `Status` error of `status`."""
        allowed = frozenset(m.upper() for m in methods) if methods is not None else None
        self._faults.arm(Fault(status, count, allowed, path_contains, retry_after, message))

    def clear_faults(self) -> None:
        self._faults.clear()

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self._requests.append(record)

    @property
    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._requests)

    def writes(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.method != "GET"]

    def reset_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    # -- cluster state ----------------------------------------------------------------------------------------

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every Event created through the API (core/v1 and events.k8s.io/v1), oldest first."""
        with self._handlers._events_lock:
            return [dict(e) for e in self._handlers.created_events]

    @property
    def resource_version(self) -> str:
        return str(self._store.rv)

    @property
    def kubelet_finalizes_deletions(self) -> bool:
        return self._handlers.kubelet_finalizes_deletions

    @kubelet_finalizes_deletions.setter
    def kubelet_finalizes_deletions(self, value: bool) -> None:
        """When False, gracefully deleted pods stay with a deletionTimestamp until `remove_pod`."""
        self._handlers.kubelet_finalizes_deletions = value

    def compact(self) -> str:
        """Compact history: older watch resourceVersions and continue tokens now get 410 Expired."""
        return str(self._store.compact())

    def add_node(self, name: str, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
                 taints: list[dict[str, Any]] | None = None, unschedulable: bool = False,
                 conditions: list[dict[str, Any]] | None = None,
                 capacity: dict[str, str] | None = None) -> dict[str, Any]:
        obj = node_object(name, labels, annotations, taints, unschedulable, conditions, capacity)
        return self._store.create(NODES.storage, normalize(obj))

    def node(self, name: str) -> dict[str, Any]:
        found = self._store.get(NODES.storage, name)
        if found is None:
            raise KeyError(f"node {name!r} not found")
        return found

    def nodes(self) -> list[dict[str, Any]]:
        return [obj for _, obj in self._store.list(NODES.storage)]

    def edit_node(self, name: str, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Mutate the stored node in place via `edit`, as another controller would (new rv, watch event)."""
        return self._store.mutate(NODES.storage, name, lambda obj: _edit_normalized(obj, edit))

    def set_node_labels(self, name: str, labels: dict[str, str | None]) -> dict[str, Any]:
        """Merge `labels` into the node's labels; a None value removes that label."""
        return self.edit_node(name, lambda n: _merge_strings(n["metadata"], "labels", labels))

    def set_node_annotations(self, name: str, annotations: dict[str, str | None]) -> dict[str, Any]:
        """Merge `annotations` into the node's annotations; a None value removes that annotation."""
        return self.edit_node(name, lambda n: _merge_strings(n["metadata"], "annotations", annotations))

    def set_node_taints(self, name: str, taints: list[dict[str, Any]]) -> dict[str, Any]:
        """Replace the node's taint list."""
        return self.edit_node(name, lambda n: n.setdefault("spec", {}).__setitem__("taints", list(taints)))

    def set_node_unschedulable(self, name: str, unschedulable: bool = True) -> dict[str, Any]:
        return self.edit_node(name, lambda n: n.setdefault("spec", {}).__setitem__("unschedulable", unschedulable))

    def set_node_condition(self, name: str, type_: str, status: str, reason: str = "",
                           message: str = "") -> dict[str, Any]:
        """Upsert one status condition by type, as the kubelet or node-problem-detector would."""
        def edit(node: dict[str, Any]) -> None:
            conditions = node.setdefault("status", {}).setdefault("conditions", [])
            fresh = condition(type_, status, reason, message)
            for i, existing in enumerate(conditions):
                if existing.get("type") == type_:
                    if existing.get("status") == status:
                        fresh["lastTransitionTime"] = existing.get("lastTransitionTime", fresh["lastTransitionTime"])
                    conditions[i] = fresh
                    return
            conditions.append(fresh)
        return self.edit_node(name, edit)

    def delete_node(self, name: str) -> dict[str, Any]:
        return self._store.delete(NODES.storage, name)

    def add_pod(self, name: str, namespace: str, node_name: str | None, phase: str = "Running",
                labels: dict[str, str] | None = None, containers: list[dict[str, Any]] | None = None,
                eviction_blocked: bool = False) -> dict[str, Any]:
        obj = pod_object(name, namespace, node_name, phase, labels, containers)
        created = self._store.create(PODS.storage, normalize(obj))
        self.set_eviction_blocked(namespace, name, eviction_blocked)
        return created

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        found = self._store.get(PODS.storage, f"{namespace}/{name}")
        if found is None:
            raise KeyError(f"pod {namespace}/{name} not found")
        return found

    def pods(self) -> list[dict[str, Any]]:
        return [obj for _, obj in self._store.list(PODS.storage)]

    def has_pod(self, namespace: str, name: str) -> bool:
        return self._store.get(PODS.storage, f"{namespace}/{name}") is not None

    def set_pod_phase(self, namespace: str, name: str, phase: str) -> dict[str, Any]:
        return self._store.mutate(PODS.storage, f"{namespace}/{name}",
                                  lambda p: p.setdefault("status", {}).__setitem__("phase", phase))

    def remove_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """Finish a pod's deletion, as the kubelet does once containers have stopped."""
        return self._store.delete(PODS.storage, f"{namespace}/{name}")

    def set_eviction_blocked(self, namespace: str, name: str, blocked: bool = True) -> None:
        """Make evictions of this pod fail with 429, as a PodDisruptionBudget with no budget left would."""
        if blocked:
            self._handlers.eviction_blocked.add((namespace, name))
        else:
            self._handlers.eviction_blocked.discard((namespace, name))


def _merge_strings(meta: dict[str, Any], field: str, values: dict[str, str | None]) -> None:
    merged = dict(meta.get(field) or {})
    for key, value in values.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    meta[field] = merged


def _edit_normalized(obj: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> None:
    edit(obj)
    cleaned = normalize(obj)
    obj.clear()
    obj.update(cleaned)
