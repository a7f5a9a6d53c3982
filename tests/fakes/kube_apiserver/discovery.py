"""Minimal but valid discovery documents: /version, /api, /apis, and per-group-version resource lists."""

from __future__ import annotations

from typing import Any

from .resources import GROUPS, RESOURCES

VERSION_INFO = {
    "major": "1", "minor": "31", "gitVersion": "v1.31.0", "gitCommit": "9edcffcde5595e8a5b1a35f88c421764e575afce",
    "gitTreeState": "clean", "buildDate": "2024-08-13T07:28:49Z", "goVersion": "go1.22.5", "compiler": "gc",
    "platform": "linux/amd64",
}


def core_versions(address: str) -> dict[str, Any]:
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}]}


def group_list() -> dict[str, Any]:
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group(name) for name in GROUPS]}


def group(name: str) -> dict[str, Any] | None:
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name)} if name in GROUPS else None


def _group(name: str) -> dict[str, Any]:
    versions = [{"groupVersion": f"{name}/{v}", "version": v} for v in GROUPS[name]]
    return {"name": name, "versions": versions, "preferredVersion": versions[0]}


def resource_list(group_name: str, version: str) -> dict[str, Any] | None:
    """The APIResourceList for one group/version, or None if the fake does not serve it."""
    group_version = f"{group_name}/{version}" if group_name else version
    if group_name and version not in GROUPS.get(group_name, ()):
        return None
    if not group_name and version != "v1":
        return None
    entries: list[dict[str, Any]] = []
    for (g, v, _), resource in RESOURCES.items():
        if (g, v) != (group_name, version):
            continue
        entries.append({"name": resource.plural, "singularName": resource.kind.lower(),
                        "namespaced": resource.namespaced, "kind": resource.kind, "verbs": list(resource.verbs),
                        "shortNames": list(resource.short_names)})
        for sub in resource.subresources:
            entry = {"name": f"{resource.plural}/{sub}", "singularName": "", "namespaced": resource.namespaced,
                     "kind": resource.kind, "verbs": ["get", "patch", "update"]}
            if sub == "eviction":
                entry.update({"group": "policy", "version": "v1", "kind": "Eviction", "verbs": ["create"]})
            entries.append(entry)
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": entries}
