"""GET/POST/PUT/PATCH/DELETE and pod eviction against the store, with the registry's checks in order."""

from __future__ import annotations

import secrets
import string
import threading
from datetime import timedelta
from typing import Any

from . import errors
from .errors import ApiError, bad_request
from .meta import format_time, metadata, normalize, now
from .patch import json_patch, merge_patch, strategic_merge_patch
from .resources import EVENTS_V1, CORE_EVENTS, PODS, ResourceType, reset_on_update
from .store import Store

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH)
_ACCEPTED_PATCH_MESSAGE = (
    "the body of the request was in an unknown format - accepted media types include: "
    "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, "
    "application/strategic-merge-patch+json, application/apply-patch+cbor"
)
_TERMINAL_PHASES = ("Succeeded", "Failed")


class ResourceHandlers:
    """The verbs on one store; `eviction_blocked` and `kubelet_finalizes_deletions` model other actors."""

    def __init__(self, store: Store):
        self.store = store
        self.created_events: list[dict[str, Any]] = []
        self.eviction_blocked: set[tuple[str, str]] = set()
        self.kubelet_finalizes_deletions = True
        self._events_lock = threading.Lock()

    def get(self, resource: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        return self._current(resource, namespace, name)

    def create(self, resource: ResourceType, namespace: str | None, body: Any) -> dict[str, Any]:
        obj = self._decode(resource, body)
        meta = metadata(obj)
        if namespace is not None:
            if meta.get("namespace") not in (None, "", namespace):
                raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
            meta["namespace"] = namespace
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise errors.invalid(resource.kind, "", [("metadata.name", "FieldValueRequired",
                                                          "Required value: name or generateName is required")])
            suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
            meta["name"] = meta["generateName"] + suffix
        if meta.get("resourceVersion"):
            raise ApiError(500, "resourceVersion should not be set on objects to be created")
        for system_field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(system_field, None)
        self._validate(resource, obj)
        with self.store.lock:
            if self.store.get(resource.storage, _key(namespace, meta["name"])) is not None:
                raise errors.already_exists(resource.plural, meta["name"], resource.group)
            created = self.store.create(resource.storage, obj)
        if resource in (CORE_EVENTS, EVENTS_V1):
            with self._events_lock:
                self.created_events.append(created)
        return created

    def update(self, resource: ResourceType, namespace: str | None, name: str, subresource: str,
               body: Any) -> dict[str, Any]:
        obj = self._decode(resource, body)
        with self.store.lock:
            current = self._current(resource, namespace, name)
            self._check_identity(obj, namespace, name)
            return self._commit_update(resource, subresource, current, obj)

    def patch(self, resource: ResourceType, namespace: str | None, name: str, subresource: str,
              content_type: str, body: Any) -> dict[str, Any]:
        if content_type not in PATCH_TYPES:
            raise ApiError(415, _ACCEPTED_PATCH_MESSAGE)
        with self.store.lock:
            current = self._current(resource, namespace, name)
            if content_type == JSON_PATCH:
                patched = json_patch(current, body)
            elif not isinstance(body, dict):
                raise bad_request("json: cannot unmarshal array into Go value of type map[string]interface {}")
            elif content_type == MERGE_PATCH:
                patched = merge_patch(current, body)
            else:
                patched = strategic_merge_patch(current, body, resource.smp_schema)
            if not isinstance(patched, dict):
                raise errors.unprocessable("patched object is not a JSON object")
            patched = normalize(patched)
            patched["kind"], patched["apiVersion"] = resource.kind, resource.api_version
            self._check_identity(patched, namespace, name)
            return self._commit_update(resource, subresource, current, patched)

    def delete(self, resource: ResourceType, namespace: str | None, name: str, options: Any,
               grace_param: str | None) -> tuple[int, dict[str, Any]]:
        options = options if isinstance(options, dict) else {}
        with self.store.lock:
            current = self._current(resource, namespace, name)
            _check_preconditions(resource, current, options.get("preconditions") or {})
            grace = options.get("gracePeriodSeconds")
            if grace is None and grace_param:
                grace = int(grace_param)
            if resource is PODS:
                return 200, self._delete_pod(current, grace)
            self.store.delete(resource.storage, _key(namespace, name))
        details = {"name": name, "kind": resource.plural, "uid": current["metadata"].get("uid")}
        if resource.group:
            details["group"] = resource.group
        return 200, errors.success_status(200, details)

    def evict(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        """policy/v1 Eviction: deletes the pod unless a (simulated) PodDisruptionBudget forbids it."""
        if not isinstance(body, dict) or body.get("kind") not in (None, "Eviction"):
            raise bad_request("the body of the request must be a policy/v1 Eviction")
        if (body.get("metadata") or {}).get("name") != name:
            raise bad_request("name in URL does not match name in Eviction object")
        with self.store.lock:
            pod = self._current(PODS, namespace, name)
            phase = (pod.get("status") or {}).get("phase")
            ignore_pdb = phase in (*_TERMINAL_PHASES, "Pending") or pod["metadata"].get("deletionTimestamp")
            if (namespace, name) in self.eviction_blocked and not ignore_pdb:
                raise ApiError(429, "Cannot evict pod as it would violate the pod's disruption budget.", details={
                    "causes": [{"reason": "DisruptionBudget",
                                "message": "The disruption budget fake-pdb needs 1 healthy pods and has 1 currently"}]})
            options = body.get("deleteOptions") or {}
            _check_preconditions(PODS, pod, options.get("preconditions") or {})
            self._delete_pod(pod, options.get("gracePeriodSeconds"))
        return errors.success_status(201)

    def _delete_pod(self, pod: dict[str, Any], grace: int | None) -> dict[str, Any]:
        """Graceful deletion: mark terminating, then (standing in for the kubelet) remove the pod."""
        meta, spec = pod["metadata"], pod.get("spec") or {}
        key = _key(meta["namespace"], meta["name"])
        if grace is None:
            grace = int(spec.get("terminationGracePeriodSeconds", 30))
        immediate = grace == 0 or not spec.get("nodeName") or (pod.get("status") or {}).get("phase") in _TERMINAL_PHASES
        if immediate:
            return self.store.delete(PODS.storage, key)
        if not meta.get("deletionTimestamp"):
            meta["deletionTimestamp"] = format_time(now() + timedelta(seconds=grace))
            meta["deletionGracePeriodSeconds"] = grace
            pod = self.store.update(PODS.storage, pod)
        if self.kubelet_finalizes_deletions:
            self.store.delete(PODS.storage, key)
        return pod

    def _commit_update(self, resource: ResourceType, subresource: str, current: dict[str, Any],
                       new: dict[str, Any]) -> dict[str, Any]:
        meta, old_meta = metadata(new), current["metadata"]
        wanted_rv = meta.get("resourceVersion")
        if wanted_rv and wanted_rv != old_meta["resourceVersion"]:
            raise errors.conflict(resource.plural, old_meta["name"], resource.group)
        if meta.get("uid") and meta["uid"] != old_meta.get("uid"):
            raise ApiError(409, f"Precondition failed: UID in precondition: {meta['uid']}, "
                                f"UID in object meta: {old_meta.get('uid')}", reason="Conflict")
        for system_field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds"):
            if system_field in old_meta:
                meta[system_field] = old_meta[system_field]
            else:
                meta.pop(system_field, None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        reset_on_update(resource, subresource, new, current)
        new = normalize(new)
        self._validate(resource, new)
        return self.store.update(resource.storage, new)

    def _decode(self, resource: ResourceType, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request(f"json: cannot unmarshal into Go value of type {resource.kind}")
        kind, api_version = body.get("kind") or resource.kind, body.get("apiVersion") or resource.api_version
        if kind != resource.kind or api_version != resource.api_version:
            raise bad_request(f'{kind} in version "{api_version.rpartition("/")[2]}" cannot be handled as a '
                              f"{resource.kind}: no kind \"{kind}\" is registered for version \"{api_version}\"")
        obj = normalize(body)
        obj["kind"], obj["apiVersion"] = resource.kind, resource.api_version
        return obj

    def _validate(self, resource: ResourceType, obj: dict[str, Any]) -> None:
        causes = resource.validate(obj)
        if causes:
            raise errors.invalid(resource.kind, obj["metadata"].get("name", ""), causes, resource.group)

    def _current(self, resource: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        found = self.store.get(resource.storage, _key(namespace, name))
        if found is None:
            raise errors.not_found(resource.plural, name, resource.group)
        return found

    @staticmethod
    def _check_identity(obj: dict[str, Any], namespace: str | None, name: str) -> None:
        meta = metadata(obj)
        if meta.get("name") != name:
            raise bad_request(f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        if namespace is not None and meta.get("namespace", namespace) != namespace:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")


def _check_preconditions(resource: ResourceType, current: dict[str, Any], preconditions: dict[str, Any]) -> None:
    meta = current["metadata"]
    for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
        wanted = preconditions.get(field)
        if wanted and wanted != meta.get(field):
            raise ApiError(409, f"Precondition failed: {label} in precondition: {wanted}, "
                                f"{label} in object meta: {meta.get(field)}", reason="Conflict",
                           details={"name": meta["name"], "kind": resource.plural})


def _key(namespace: str | None, name: str) -> str:
    return f"{namespace}/{name}" if namespace else name
