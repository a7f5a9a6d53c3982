"""The resource types the fake serves, with the per-type rules the real registry applies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from . import validation
from .patch import PRIMITIVE, SmpSchema

_METADATA_SMP: dict[tuple[str, ...], str] = {
    ("metadata", "finalizers"): PRIMITIVE,
    ("metadata", "ownerReferences"): "uid",
}
# NodeSpec.Taints has no patchStrategy tag (it is +listType=atomic), so a strategic merge replaces the whole list.
NODE_SMP: SmpSchema = {
    **_METADATA_SMP,
    ("spec", "podCIDRs"): PRIMITIVE,
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
}
_CONTAINER_SMP = {
    ("env",): "name", ("ports",): "containerPort", ("volumeMounts",): "mountPath", ("volumeDevices",): "devicePath",
}
POD_SMP: SmpSchema = {
    **_METADATA_SMP,
    ("spec", "containers"): "name",
    ("spec", "initContainers"): "name",
    ("spec", "ephemeralContainers"): "name",
    **{("spec", c) + k: v for c in ("containers", "initContainers") for k, v in _CONTAINER_SMP.items()},
    ("spec", "volumes"): "name",
    ("spec", "imagePullSecrets"): "name",
    ("spec", "hostAliases"): "ip",
    ("status", "conditions"): "type",
    ("status", "podIPs"): "ip",
}


@dataclass(frozen=True)
class ResourceType:
    """One REST resource: where it lives, what it is called, and how its writes are checked."""

    plural: str
    kind: str
    group: str
    version: str
    namespaced: bool
    selectable: Callable[[dict[str, Any]], dict[str, str]]
    validate: Callable[[dict[str, Any]], list[validation.Cause]]
    smp_schema: SmpSchema = field(default_factory=dict)
    subresources: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ("create", "delete", "get", "list", "patch", "update", "watch")
    short_names: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage(self) -> str:
        return f"{self.group}/{self.plural}" if self.group else self.plural

    @property
    def selectable_fields(self) -> frozenset[str]:
        return frozenset(self.selectable(_EMPTY[self.kind]))


def _meta_fields(obj: dict[str, Any], namespaced: bool) -> dict[str, str]:
    meta = obj.get("metadata") or {}
    fields = {"metadata.name": meta.get("name", "")}
    if namespaced:
        fields["metadata.namespace"] = meta.get("namespace", "")
    return fields


def _node_fields(node: dict[str, Any]) -> dict[str, str]:
    spec = node.get("spec") or {}
    return {**_meta_fields(node, False), "spec.unschedulable": str(bool(spec.get("unschedulable"))).lower()}


def _pod_fields(pod: dict[str, Any]) -> dict[str, str]:
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    return {
        **_meta_fields(pod, True),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.restartPolicy": spec.get("restartPolicy", ""),
        "spec.schedulerName": spec.get("schedulerName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "spec.hostNetwork": str(bool(spec.get("hostNetwork"))).lower(),
        "status.phase": status.get("phase", ""),
        "status.podIP": status.get("podIP", ""),
        "status.nominatedNodeName": status.get("nominatedNodeName", ""),
    }


def _core_event_fields(event: dict[str, Any]) -> dict[str, str]:
    involved, source = event.get("involvedObject") or {}, event.get("source") or {}
    fields = {f"involvedObject.{k}": str(involved.get(k, "")) for k in
              ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")}
    return {**_meta_fields(event, True), **fields, "reason": event.get("reason", ""), "type": event.get("type", ""),
            "source": source.get("component", ""), "reportingComponent": event.get("reportingComponent", "")}


def _events_v1_fields(event: dict[str, Any]) -> dict[str, str]:
    regarding = event.get("regarding") or {}
    fields = {f"regarding.{k}": str(regarding.get(k, "")) for k in ("kind", "namespace", "name", "uid")}
    return {**_meta_fields(event, True), **fields, "reason": event.get("reason", ""), "type": event.get("type", ""),
            "reportingController": event.get("reportingController", "")}


_EMPTY: dict[str, dict[str, Any]] = {"Node": {}, "Pod": {}, "Event": {}}

NODES = ResourceType("nodes", "Node", "", "v1", False, _node_fields, validation.node_errors, NODE_SMP,
                     subresources=("status",), short_names=("no",))
PODS = ResourceType("pods", "Pod", "", "v1", True, _pod_fields, validation.pod_errors, POD_SMP,
                    subresources=("status", "eviction"), short_names=("po",))
CORE_EVENTS = ResourceType("events", "Event", "", "v1", True, _core_event_fields, validation.core_event_errors,
                           short_names=("ev",))
EVENTS_V1 = ResourceType("events", "Event", "events.k8s.io", "v1", True, _events_v1_fields,
                         validation.events_v1_errors, short_names=("ev",))

RESOURCES: dict[tuple[str, str, str], ResourceType] = {
    (r.group, r.version, r.plural): r for r in (NODES, PODS, CORE_EVENTS, EVENTS_V1)
}
GROUPS: dict[str, tuple[str, ...]] = {"events.k8s.io": ("v1",), "policy": ("v1",)}


def lookup(group: str, version: str, plural: str) -> ResourceType | None:
    return RESOURCES.get((group, version, plural))


def reset_on_update(resource: ResourceType, subresource: str, new: dict[str, Any], old: dict[str, Any]) -> None:
    """PrepareForUpdate: the main resource cannot change status; the status subresource cannot change spec."""
    if resource.kind not in ("Node", "Pod"):
        return
    if subresource == "status":
        new["spec"] = old.get("spec", {})
    else:
        new["status"] = old.get("status", {})
