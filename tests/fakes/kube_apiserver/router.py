"""Maps a parsed HTTP request onto discovery or a resource verb, turning ApiErrors into Status replies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from . import discovery, errors
from .errors import ApiError
from .handlers import ResourceHandlers
from .listing import list_objects, open_watch
from .resources import PODS, ResourceType, lookup

_TRUE = ("1", "true", "True", "t", "T", "TRUE")


@dataclass
class Request:
    """What the HTTP layer hands the router; `body` is parsed JSON (None when absent)."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any


@dataclass
class Response:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    stream: Iterator[dict[str, Any] | None] | None = None


@dataclass(frozen=True)
class Target:
    resource: ResourceType
    namespace: str | None
    name: str | None
    subresource: str
    watch: bool


class Router:
    """Stateless dispatch over a ResourceHandlers instance."""

    def __init__(self, handlers: ResourceHandlers, address: str):
        self.handlers = handlers
        self.address = address

    def handle(self, request: Request) -> Response:
        try:
            return self._dispatch(request)
        except ApiError as err:
            return Response(err.code, err.body(), dict(err.headers))

    @staticmethod
    def error(code: int, message: str) -> Response:
        err = ApiError(code, message)
        return Response(code, err.body(), dict(err.headers))

    def _dispatch(self, request: Request) -> Response:
        parts = [p for p in request.path.split("/") if p]
        static = self._static(parts)
        if static is not None:
            if request.method != "GET":
                raise ApiError(405, f"the server does not allow this method on the requested resource")
            return static
        target = _resolve(parts)
        return self._verb(request, target)

    def _static(self, parts: list[str]) -> Response | None:
        if parts in (["healthz"], ["livez"], ["readyz"]):
            return Response(200, "ok", {"Content-Type": "text/plain; charset=utf-8"})
        if parts == ["version"]:
            return Response(200, discovery.VERSION_INFO)
        if parts == ["api"]:
            return Response(200, discovery.core_versions(self.address))
        if parts == ["apis"]:
            return Response(200, discovery.group_list())
        if len(parts) == 2 and parts[0] == "apis":
            body = discovery.group(parts[1])
            return Response(200, body) if body else None
        if (len(parts) == 2 and parts[0] == "api") or (len(parts) == 3 and parts[0] == "apis"):
            body = discovery.resource_list("" if parts[0] == "api" else parts[1], parts[-1])
            if body is None:
                raise errors.path_not_found()
            return Response(200, body)
        return None

    def _verb(self, request: Request, t: Target) -> Response:
        h, method, q = self.handlers, request.method, request.query
        collection = t.name is None
        if method == "GET" and collection:
            if t.watch or q.get("watch") in _TRUE:
                return Response(200, None, stream=open_watch(h.store, t.resource, t.namespace, q))
            return Response(200, list_objects(h.store, t.resource, t.namespace, q))
        if t.resource.namespaced and t.namespace is None:
            raise _method_not_allowed()
        if method == "POST" and collection:
            return Response(201, h.create(t.resource, t.namespace, request.body))
        if collection:
            raise _method_not_allowed()
        if t.subresource == "eviction":
            if method != "POST":
                raise _method_not_allowed()
            return Response(201, h.evict(t.namespace or "", t.name, request.body))
        if method == "GET":
            return Response(200, h.get(t.resource, t.namespace, t.name))
        if method == "PUT":
            return Response(200, h.update(t.resource, t.namespace, t.name, t.subresource, request.body))
        if method == "PATCH":
            return Response(200, h.patch(t.resource, t.namespace, t.name, t.subresource, request.content_type,
                                         request.body))
        if method == "DELETE" and not t.subresource:
            status, body = h.delete(t.resource, t.namespace, t.name, request.body, q.get("gracePeriodSeconds"))
            return Response(status, body)
        raise _method_not_allowed()


def _resolve(parts: list[str]) -> Target:
    """Split /api/v1/... or /apis/G/V/... into resource, namespace, name and subresource."""
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        raise errors.path_not_found()
    watch = rest[0] == "watch"
    if watch:
        rest = rest[1:]
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        raise errors.path_not_found()
    resource = lookup(group, version, rest[0])
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else ""
    if resource is None or (subresource and subresource not in resource.subresources):
        raise errors.path_not_found()
    if namespace is not None and not resource.namespaced:
        raise errors.path_not_found()
    if resource.namespaced and namespace is None and name is not None:
        raise errors.path_not_found()
    if subresource == "eviction" and resource is not PODS:
        raise errors.path_not_found()
    return Target(resource, namespace, name, subresource, watch)


def _method_not_allowed() -> ApiError:
    return ApiError(405, "the server does not allow this method on the requested resource")
