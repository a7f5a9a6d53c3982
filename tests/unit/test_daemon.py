"""The agent in-process: findings in, decisions logged, state persisted, verdicts handed to actions."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import pytest

from nodemedic.actions import ActionBackend
from nodemedic.config import load_config
from nodemedic.daemon import Agent, AgentAlreadyRunning, write_command
from nodemedic.model import Health, NodeVerdict
from nodemedic.state import StateStore

from conftest import finding
from fakes.agent import QueueWatcher, running, wait_for



class Recorder(ActionBackend):
    name = "recorder"

    def __init__(self, fail_times: int = 0):
        self.applied: list[NodeVerdict] = []
        self.fail_times = fail_times

    def apply(self, verdict):
        if self.fail_times:
            self.fail_times -= 1
            raise ConnectionError("platform down")
        self.applied.append(verdict)


def make_agent(tmp_path, boot_id="boot-1", backends=None, checks=(), **cfg) -> tuple[Agent, QueueWatcher]:
    config = load_config(env={}, path=None, overrides={
        "state_dir": str(tmp_path / "state"), "metrics.host": "127.0.0.1", "metrics.port": 0,
        "imds.enabled": False, "recovery.enabled": False, **cfg})
    w = QueueWatcher()
    return Agent(config, checks=[w, *checks], backends=backends, boot_id=boot_id), w




@pytest.fixture(autouse=True)
def no_host_config(monkeypatch):
    monkeypatch.setattr("nodemedic.config.DEFAULT_CONFIG_PATH", "/nonexistent/nodemedic.yaml")


def test_fault_flows_to_verdict_state_metrics_and_actions(tmp_path):
    rec = Recorder()
    agent, w = make_agent(tmp_path, backends=[rec])
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)
        assert agent.dispatcher.wait_idle(5)
        assert rec.applied[-1].health is Health.PENDING_REBOOT
        assert StateStore(tmp_path / "state").load().verdict.health is Health.PENDING_REBOOT
        body = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5).read().decode()
        assert 'nodemedic_node_health{status="UnschedulablePendingReboot"} 1.0' in body


def test_restart_resumes_and_new_boot_remedies(tmp_path):
    agent, w = make_agent(tmp_path)
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)

    same_boot, _ = make_agent(tmp_path, boot_id="boot-1")
    with running(same_boot):
        assert same_boot.state.verdict.health is Health.PENDING_REBOOT
        assert same_boot.state.active["XID_79|gpu:0000:3b:00.0"].count == 1

    rebooted, w3 = make_agent(tmp_path, boot_id="boot-2")
    with running(rebooted):
        assert rebooted.state.verdict.health is Health.SCHEDULABLE
        w3.q.put(finding("XID_79"))  # back after the reboot: replace
        wait_for(lambda: rebooted.state.verdict.health is Health.PENDING_REPLACEMENT)


def test_local_backend_records_what_it_would_apply(tmp_path):
    agent, w = make_agent(tmp_path)
    with running(agent):
        w.q.put(finding("XID_48"))
        wait_for(lambda: agent.state.verdict.health is Health.UNSCHEDULABLE)
        assert agent.dispatcher.wait_idle(5)
        records = [json.loads(x) for x in (tmp_path / "state" / "local-actions.jsonl").read_text().splitlines()]
        assert records[0]["health"] == "Schedulable"  # reconcile on start
        assert records[-1]["health"] == "Unschedulable" and records[-1]["fault_reasons"] == ["XID_48"]


def test_failing_backend_is_retried_without_blocking_detection(tmp_path):
    rec = Recorder(fail_times=2)
    agent, w = make_agent(tmp_path, backends=[rec])
    agent.dispatcher._max_backoff_s = 0.2
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)  # detection did not wait
        wait_for(lambda: rec.applied and rec.applied[-1].health is Health.PENDING_REBOOT)


def test_operator_clear_through_inbox(tmp_path):
    agent, w = make_agent(tmp_path)
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)
        path = write_command(tmp_path / "state", {"command": "clear", "code": "XID_79"})
        (tmp_path / "state" / "inbox" / "junk.json").write_text("{nope")
        wait_for(lambda: not path.exists())
        assert agent.state.verdict.health is Health.SCHEDULABLE
        wait_for(lambda: not (tmp_path / "state" / "inbox" / "junk.json").exists())


def test_second_agent_on_same_state_dir_refuses(tmp_path):
    a, _ = make_agent(tmp_path)
    with running(a):
        b, _ = make_agent(tmp_path)
        with pytest.raises(AgentAlreadyRunning):
            b.start()


def test_unwritable_state_does_not_stop_detection(tmp_path, monkeypatch):
    agent, w = make_agent(tmp_path)
    with running(agent):
        def fail(state):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(agent.store, "save", fail)
        w.q.put(finding("XID_79"))
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)
        w.q.put(finding("XID_48", "gpu:0000:5d:00.0"))
        wait_for(lambda: len(agent.state.active) == 2)
        monkeypatch.undo()  # the disk works again: the final save on stop persists what was held in memory
    assert StateStore(tmp_path / "state").load().verdict.health is Health.PENDING_REBOOT


def test_taken_metrics_port_costs_only_metrics(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        agent, w = make_agent(tmp_path, **{"metrics.port": s.getsockname()[1]})
        with running(agent):
            assert agent.metrics_port is None
            w.q.put(finding("XID_79"))
            wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)


def test_instance_type_from_imds_when_config_is_silent(tmp_path):
    from fakes.imds import FakeImds
    with FakeImds({"meta-data/instance-type": "p5.48xlarge"}) as fake:
        agent, _ = make_agent(tmp_path, **{"imds.enabled": True, "imds.endpoint": fake.endpoint})
    assert agent.instance_type == "p5.48xlarge"
    configured, _ = make_agent(tmp_path, **{"instance_type": "trn1.32xlarge", "imds.enabled": True,
                                            "imds.endpoint": "http://127.0.0.1:9"})
    assert configured.instance_type == "trn1.32xlarge"


def test_gpu_count_mismatch_needs_two_sources_before_reboot(tmp_path):
    from fakes.nvml import FakeNvml, default_gpus
    from fakes.sysfs import hgx_node
    from nodemedic.checks.nvidia.nvml import NvmlPoller
    from nodemedic.checks.platform.pci import PciGpuPoller

    sysfs = tmp_path / "sys"
    hgx_node(sysfs, gpus=8)
    nvml = NvmlPoller(FakeNvml(default_gpus(7)), interval_s=0.2, sysfs_root=sysfs)
    pci = PciGpuPoller(sysfs_root=sysfs, interval_s=0.2)
    agent, _ = make_agent(tmp_path, checks=[nvml, pci], instance_type="p5.48xlarge")
    assert agent.ctx.expected_gpus == 8 and len(agent.checks) == 3
    with running(agent):
        wait_for(lambda: "GPU_COUNT_MISMATCH|node" in agent.state.active)
        time.sleep(0.6)  # several poll cycles: NVML alone must not take the node out
        fault = agent.state.active["GPU_COUNT_MISMATCH|node"]
        assert agent.state.verdict.health is Health.SCHEDULABLE and fault.held_action is not None
        shutil.rmtree(sysfs / "bus" / "pci" / "devices" / "0000:ca:00.0")  # the PCI bus loses it too
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)
        assert agent.state.active["GPU_COUNT_MISMATCH|node"].sources == ["nvml", "pci"]
