"""The Kubernetes backend, driven by the agent, against the fake API server through the official client."""

from __future__ import annotations

import json
import time

import pytest

from nodemedic.config import load_config
from nodemedic.daemon import Agent, write_command
from nodemedic.model import Health

from conftest import finding
from fakes.agent import QueueWatcher, running, wait_for
from fakes.kube_apiserver import FakeKubeApiServer

pytestmark = pytest.mark.integration
NODE = "node-1"
KEY = "nodemedic.io/node-health-status"
TAINT = {"key": KEY, "value": "Unschedulable", "effect": "NoSchedule"}
FOREIGN_TAINT = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}



@pytest.fixture(autouse=True)
def no_host_config(monkeypatch):
    monkeypatch.setattr("nodemedic.config.DEFAULT_CONFIG_PATH", "/nonexistent/nodemedic.yaml")


@pytest.fixture
def api():
    with FakeKubeApiServer() as server:
        server.add_node(NODE, labels={"team": "ml", "nvidia.com/gpu.present": "true"}, taints=[FOREIGN_TAINT])
        for i in range(9):
            server.add_node(f"other-{i}")
        yield server


def make_agent(tmp_path, api, boot_id="b1", **cfg):
    overrides = {"state_dir": str(tmp_path / "state"), "node_name": NODE, "metrics.enabled": False,
                 "imds.enabled": False, "recovery.enabled": False, "actions.backend": "kubernetes", "actions.kubernetes.api_url": api.url,
                 "actions.kubernetes.drain.poll_s": 0.2, "actions.kubernetes.circuit_breaker.retry_s": 0.3,
                 **cfg}
    w = QueueWatcher()
    agent = Agent(load_config(env={}, path=None, overrides=overrides), checks=[w], boot_id=boot_id)
    agent.dispatcher._max_backoff_s = 0.3
    return agent, w




def labels(api) -> dict:
    return api.node(NODE)["metadata"].get("labels") or {}


def condition(api) -> dict | None:
    for c in api.node(NODE).get("status", {}).get("conditions") or []:
        if c["type"] == "AcceleratedHardwareReady":
            return c
    return None


def test_fault_is_written_exactly_and_recovery_removes_only_ours(tmp_path, api):
    agent, w = make_agent(tmp_path, api)
    with running(agent):
        wait_for(lambda: labels(api).get(KEY) == "Schedulable", what="reconcile on start")
        agent.dispatcher.wait_idle(5)
        api.reset_requests()
        w.q.put(finding("XID_79", "gpu:0000:3b:00.0", message="Xid 79: GPU has fallen off the bus."))
        wait_for(lambda: labels(api).get(KEY) == "UnschedulablePendingReboot", what="fault applied")
        agent.dispatcher.wait_idle(5)
        n = api.node(NODE)
        assert n["metadata"]["labels"]["nodemedic.io/fault-types"] == "GpuFallenOffBus"
        assert n["metadata"]["labels"]["nodemedic.io/fault-reasons"] == "XID_79"
        assert n["metadata"]["labels"]["team"] == "ml"
        assert n["spec"]["taints"] == [FOREIGN_TAINT, TAINT]
        details = json.loads(n["metadata"]["annotations"]["nodemedic.io/fault-details"])
        assert details[0]["code"] == "XID_79" and details[0]["component"] == "gpu:0000:3b:00.0"
        assert details[0]["action"] == "reboot" and set(details[0]) == {"time", "component", "code", "message",
                                                                         "action"}
        c = condition(api)
        assert c["status"] == "False" and c["reason"] == "UnschedulablePendingReboot"
        events = [e for e in api.events if e.get("reason") == "UnschedulablePendingReboot"]
        assert len(events) == 1 and events[0]["type"] == "Warning"
        assert events[0]["involvedObject"]["name"] == NODE and events[0]["involvedObject"]["kind"] == "Node"
        writes = api.writes()
        assert len(writes) <= 3, writes  # one node patch, one status patch, one event

        # repeats of the same fault change nothing: no writes
        api.reset_requests()
        for _ in range(20):
            w.q.put(finding("XID_79", "gpu:0000:3b:00.0"))
        time.sleep(0.5)
        assert api.writes() == []

        write_command(tmp_path / "state", {"command": "clear", "code": "XID_79"})
        wait_for(lambda: labels(api).get(KEY) == "Schedulable", what="recovery applied")
        agent.dispatcher.wait_idle(5)
        n = api.node(NODE)
        assert n["spec"]["taints"] == [FOREIGN_TAINT]
        assert "nodemedic.io/fault-types" not in n["metadata"]["labels"]
        assert "nodemedic.io/fault-details" not in n["metadata"]["annotations"]
        assert n["metadata"]["labels"]["team"] == "ml"
        assert condition(api)["status"] == "True"


def test_manual_label_is_an_operator_request(tmp_path, api):
    agent, w = make_agent(tmp_path, api)
    with running(agent):
        wait_for(lambda: labels(api).get(KEY) == "Schedulable")
        agent.dispatcher.wait_idle(5)
        api.set_node_labels(NODE, {KEY: "UnschedulablePendingReplacement"})
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REPLACEMENT, what="request honoured")
        assert "OPERATOR_REQUEST|node" in agent.state.active
        agent.dispatcher.wait_idle(5)
        assert any(t["key"] == KEY for t in api.node(NODE)["spec"]["taints"])


def test_reconcile_after_restart_repairs_drift_both_ways(tmp_path, api):
    agent, w = make_agent(tmp_path, api)
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: labels(api).get(KEY) == "UnschedulablePendingReboot")
        agent.dispatcher.wait_idle(5)
    # while the agent is down, someone strips its taint and label
    n = api.node(NODE)
    api.set_node_labels(NODE, {k: None for k in n["metadata"]["labels"] if k.startswith("nodemedic")})
    api.set_node_taints(NODE, [FOREIGN_TAINT])
    again, _ = make_agent(tmp_path, api)
    with running(again):
        wait_for(lambda: labels(api).get(KEY) == "UnschedulablePendingReboot", what="drift repaired")
        wait_for(lambda: TAINT in api.node(NODE)["spec"]["taints"])
    # and the other way: the node rebooted (new boot id): the agent lifts what it placed
    rebooted, _ = make_agent(tmp_path, api, boot_id="b2")
    with running(rebooted):
        wait_for(lambda: labels(api).get(KEY) == "Schedulable", what="stale quarantine lifted")
        wait_for(lambda: api.node(NODE)["spec"]["taints"] == [FOREIGN_TAINT])


def test_circuit_breaker_with_100_nodes(tmp_path):
    with FakeKubeApiServer() as api:
        api.add_node(NODE)
        for i in range(99):
            held = {KEY: "UnschedulablePendingReboot"} if i < 10 else {}
            api.add_node(f"n-{i:03d}", labels=held)
        agent, w = make_agent(tmp_path, api)
        with running(agent):
            w.q.put(finding("XID_79"))
            wait_for(lambda: agent.metrics.quarantine_refused._value.get() >= 1, what="refusal")
            assert labels(api).get(KEY) == "Schedulable"  # refused: not quarantined
            assert agent.state.verdict.health is Health.PENDING_REBOOT  # but the decision is kept
            lists = [r for r in api.requests if r.path == "/api/v1/nodes" and r.method == "GET"
                     and r.query.get("limit") == "1"]
            assert lists, "breaker counts with limit=1 lists"
            api.set_node_labels("n-000", {KEY: None})  # one held node is healed: room for one more
            wait_for(lambda: labels(api).get(KEY) == "UnschedulablePendingReboot", what="retried and applied")


def test_api_outage_during_a_fault_then_recovery(tmp_path, api):
    agent, w = make_agent(tmp_path, api)
    with running(agent):
        wait_for(lambda: labels(api).get(KEY) == "Schedulable")
        agent.dispatcher.wait_idle(5)
        api.down()
        w.q.put(finding("XID_48"))
        wait_for(lambda: agent.state.verdict.health is Health.UNSCHEDULABLE, what="detection during outage")
        w.q.put(finding("XID_79", "gpu:0000:5d:00.0"))
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)
        time.sleep(0.5)
        api.up()
        # only the latest desired state is applied, not a backlog of stale ones
        wait_for(lambda: labels(api).get(KEY) == "UnschedulablePendingReboot", what="applied after outage")
        node_patches = [r for r in api.writes() if r.path == f"/api/v1/nodes/{NODE}"]
        healths = [r.body["metadata"].get("labels", {}).get(KEY) for r in node_patches
                   if isinstance(r.body, dict)]
        assert "Unschedulable" not in healths


@pytest.mark.parametrize("status", [409, 429, 500])
def test_transient_api_errors_are_retried(tmp_path, api, status):
    agent, w = make_agent(tmp_path, api)
    with running(agent):
        wait_for(lambda: labels(api).get(KEY) == "Schedulable")
        agent.dispatcher.wait_idle(5)
        api.fail_next(status, count=2, methods=["PATCH"])
        w.q.put(finding("XID_79"))
        wait_for(lambda: labels(api).get(KEY) == "UnschedulablePendingReboot", what=f"applied despite {status}")


def test_dry_run_sends_nothing(tmp_path, api, caplog):
    agent, w = make_agent(tmp_path, api, **{"actions.dry_run": True})
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)
        time.sleep(0.5)
    assert api.writes() == []
    assert "dry run: would PATCH node node-1" in caplog.text and '"UnschedulablePendingReboot"' in caplog.text


def test_reboot_waits_for_accelerator_pods(tmp_path, api):
    api.add_pod("trainer-0", "ml", NODE, containers=[{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "8"}}}])
    api.add_pod("logger", "kube-system", NODE, containers=[{"name": "l"}])
    agent, w = make_agent(tmp_path, api)
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: labels(api).get(KEY) == "Unschedulable", what="held out while the job runs")
        assert TAINT in api.node(NODE)["spec"]["taints"]
        time.sleep(0.5)
        assert labels(api).get(KEY) == "Unschedulable"  # not handed on while the GPU pod runs
        api.set_pod_phase("ml", "trainer-0", "Succeeded")  # the job finished
        wait_for(lambda: labels(api).get(KEY) == "UnschedulablePendingReboot", what="handed on after the job")


def test_evict_mode_evicts_after_the_timeout(tmp_path, api):
    api.add_pod("trainer-0", "ml", NODE, containers=[{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "8"}}}])
    agent, w = make_agent(tmp_path, api, **{"actions.kubernetes.drain.mode": "evict",
                                            "actions.kubernetes.drain.timeout_s": 0.5})
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: any(r.path.endswith("/pods/trainer-0/eviction") for r in api.writes()), what="eviction")
        wait_for(lambda: labels(api).get(KEY) == "UnschedulablePendingReboot", what="handed on after eviction")
