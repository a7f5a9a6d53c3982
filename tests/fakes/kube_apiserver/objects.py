"""Builders for Node and Pod objects shaped like a kubelet-registered node and a scheduled pod."""

from __future__ import annotations

from typing import Any

from .meta import format_time, new_uid, now

DEFAULT_CONDITIONS: tuple[tuple[str, str, str, str], ...] = (
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
)


def condition(type_: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
    stamp = format_time(now())
    out: dict[str, Any] = {"type": type_, "status": status, "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
    if reason:
        out["reason"] = reason
    if message:
        out["message"] = message
    return out


def node_object(name: str, labels: dict[str, str] | None, annotations: dict[str, str] | None,
                taints: list[dict[str, Any]] | None, unschedulable: bool,
                conditions: list[dict[str, Any]] | None, capacity: dict[str, str] | None) -> dict[str, Any]:
    """A Node as the kubelet registers it, with the given overrides."""
    resources = {"cpu": "96", "memory": "1056000000Ki", "pods": "110", **(capacity or {})}
    base_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    spec: dict[str, Any] = {"providerID": f"aws:///us-east-1a/i-{abs(hash(name)) % 16**17:017x}"}
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    if unschedulable:
        spec["unschedulable"] = True
    conds = [condition(*c) for c in DEFAULT_CONDITIONS] if conditions is None else [
        {**condition(c["type"], c.get("status", "True")), **c} for c in conditions]
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": name, "labels": {**base_labels, **(labels or {})}, "annotations": dict(annotations or {})},
        "spec": spec,
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": conds,
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": new_uid().replace("-", ""), "systemUUID": new_uid(), "bootID": new_uid(),
                "kernelVersion": "6.8.0-1015-aws", "osImage": "Ubuntu 22.04.4 LTS",
                "containerRuntimeVersion": "containerd://1.7.12", "kubeletVersion": "v1.31.0",
                "kubeProxyVersion": "v1.31.0", "operatingSystem": "linux", "architecture": "amd64",
            },
        },
    }


def pod_object(name: str, namespace: str, node_name: str | None, phase: str, labels: dict[str, str] | None,
               containers: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A Pod as the scheduler and kubelet leave it, with defaulted fields filled in."""
    specs = [_container(i, c) for i, c in enumerate(containers or [{}])]
    spec: dict[str, Any] = {
        "containers": specs, "restartPolicy": "Always", "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst", "serviceAccountName": "default", "schedulerName": "default-scheduler",
        "enableServiceLinks": True, "preemptionPolicy": "PreemptLowerPriority", "priority": 0,
    }
    status: dict[str, Any] = {"phase": phase, "qosClass": "BestEffort"}
    if node_name:
        spec["nodeName"] = node_name
        status.update({"hostIP": "10.0.0.1", "podIP": "10.1.0.1", "startTime": format_time(now())})
        status["conditions"] = [condition("PodScheduled", "True")]
    for c in status.get("conditions", []):
        c.pop("lastHeartbeatTime", None)
    return {"kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
            "spec": spec, "status": status}


def _container(index: int, given: dict[str, Any]) -> dict[str, Any]:
    container = {"name": f"container-{index}", "image": "busybox:1.36", "imagePullPolicy": "IfNotPresent",
                 "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File", **given}
    resources = dict(container.get("resources") or {})
    limits = resources.get("limits") or {}
    if limits:
        # Defaulting copies limits into requests for any resource whose request is unset.
        resources["requests"] = {**limits, **(resources.get("requests") or {})}
    container["resources"] = resources
    return container
