"""Pure parts of the Kubernetes backend: label values and the diff from the node to the desired state."""

from __future__ import annotations

import json

import pytest

from nodemedic.actions.kubernetes import Desired, KubernetesBackend, KubernetesConfig, Owned, label_value
from nodemedic.model import Health

KEY = "nodemedic.io/node-health-status"


@pytest.mark.parametrize("items,want", [
    (["XID_79"], "XID_79"),
    (["XID_79", "GPU_LOST", "XID_79"], "GPU_LOST.XID_79"),
    (["gpu:0000:3b:00.0"], "gpu-0000-3b-00.0"),
    ([], ""),
    (["--x--"], "x"),
])
def test_label_values(items, want):
    assert label_value(items) == want


def test_long_label_values_are_cut_deterministically_and_valid():
    codes = [f"SOME_LONG_FAULT_CODE_{i}" for i in range(10)]
    v = label_value(codes)
    assert len(v) <= 63 and v == label_value(list(reversed(codes)))
    assert v.endswith("more") and v.split(".")[0] == "SOME_LONG_FAULT_CODE_0"
    assert label_value(["X" * 100]) == "1more"


def backend(**cfg) -> KubernetesBackend:
    return KubernetesBackend("node-1", KubernetesConfig(**cfg), api=object())


def node(labels=None, annotations=None, taints=None, unschedulable=False, rv="7"):
    return {"metadata": {"name": "node-1", "resourceVersion": rv, "labels": labels or {},
                         "annotations": annotations or {}},
            "spec": {"taints": taints or [], "unschedulable": unschedulable}}


def want(health=Health.PENDING_REBOOT, taint=True, cordon=False, labels=None, annotations=None):
    return Desired(health, labels if labels is not None else {KEY: health.value}, annotations or {}, taint, cordon)


def test_diff_places_label_taint_and_records_ownership():
    foreign = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
    patch, owned = backend()._diff(node(taints=[foreign]), want())
    assert patch["metadata"]["resourceVersion"] == "7"
    assert patch["metadata"]["labels"] == {KEY: "UnschedulablePendingReboot"}
    assert patch["spec"]["taints"] == [foreign, {"key": KEY, "value": "Unschedulable", "effect": "NoSchedule"}]
    assert json.loads(patch["metadata"]["annotations"]["nodemedic.io/owned"]) == {
        "labels": [KEY], "annotations": [], "taints": [KEY], "cordon": False, "health": "UnschedulablePendingReboot"}
    assert "unschedulable" not in patch["spec"]


def test_no_patch_when_nothing_changes():
    b = backend()
    first, owned = b._diff(node(), want())
    applied = node(labels={KEY: "UnschedulablePendingReboot"},
                   annotations={"nodemedic.io/owned": owned.dump()},
                   taints=[{"key": KEY, "value": "Unschedulable", "effect": "NoSchedule"}])
    assert b._diff(applied, want())[0] is None


def test_recovery_removes_only_what_the_agent_owns():
    b = backend(cordon=True)
    owned = Owned(labels=[KEY, "nodemedic.io/fault-types"], taints=[KEY], cordon=True, health="Unschedulable")
    current = node(labels={KEY: "Unschedulable", "nodemedic.io/fault-types": "GpuEcc", "team": "a"},
                   annotations={"nodemedic.io/owned": owned.dump(), "other": "x"},
                   taints=[{"key": KEY, "value": "Unschedulable", "effect": "NoSchedule"},
                           {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}], unschedulable=True)
    patch, _ = b._diff(current, want(Health.SCHEDULABLE, taint=False, cordon=False))
    assert patch["metadata"]["labels"] == {KEY: "Schedulable", "nodemedic.io/fault-types": None}
    assert patch["spec"]["taints"] == [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]
    assert patch["spec"]["unschedulable"] is False
    assert "other" not in patch["metadata"]["annotations"]


def test_never_lifts_a_cordon_or_taint_someone_else_placed():
    b = backend(cordon=True)
    mine = {"key": KEY, "value": "Unschedulable", "effect": "NoSchedule"}
    current = node(taints=[mine], unschedulable=True, annotations={"nodemedic.io/owned": Owned().dump()})
    patch, owned = b._diff(current, want(Health.SCHEDULABLE, taint=False, cordon=False))
    assert "spec" not in patch  # neither the admin's cordon nor the taint they set with our key is removed
    assert owned.cordon is False and owned.taints == []
    # and wanting them does not make them ours
    patch, owned = b._diff(current, want(cordon=True))
    assert owned.cordon is False and owned.taints == []


def test_hyperpod_prefix():
    b = KubernetesBackend("n", KubernetesConfig(), profile="hyperpod", api=object())
    assert b.health_key == "sagemaker.amazonaws.com/node-health-status"
    assert KubernetesBackend("n", KubernetesConfig(prefix="example.com/"), api=object()).health_key == \
        "example.com/node-health-status"


def test_no_cluster_credentials_is_an_action_error_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    b = KubernetesBackend("node-1", KubernetesConfig(kubeconfig=str(tmp_path / "missing")))  # constructing is fine
    from nodemedic.model import NodeVerdict
    with pytest.raises(Exception):
        b.apply(NodeVerdict())  # the dispatcher logs it, counts it and retries with backoff
