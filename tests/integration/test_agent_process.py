"""`nodemedic run` as a real subprocess on a temp log file, driven and observed through the CLI and metrics."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN

NODEMEDIC = str(BIN / "nodemedic")
pytestmark = pytest.mark.integration


class AgentProcess:
    def __init__(self, tmp_path: Path, env: dict[str, str], *extra: str):
        self.log = tmp_path / "kern.log"
        self.state = tmp_path / "state"
        self.env = env
        self.lines: queue.Queue[dict] = queue.Queue()
        self.raw: list[str] = []
        self.proc = subprocess.Popen(
            [NODEMEDIC, "run", "--kernel-log", str(self.log), "--state-dir", str(self.state), "--metrics-port", "0",
             "--node-name", "test-node", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        started = self.wait(lambda e: "metrics on" in e.get("msg", ""), 20)
        self.port = int(re.search(r":(\d+)/metrics", started["msg"]).group(1))
        self.wait(lambda e: e.get("msg", "").startswith("nodemedic ready"), 20)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.raw.append(line)
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                self.lines.put({"msg": line})

    def wait(self, pred, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if pred(event):
                return event
        raise AssertionError("expected log line not seen; output so far:\n" + "".join(self.raw[-30:]))

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([NODEMEDIC, *args, "--state-dir", str(self.state)], capture_output=True, text=True,
                              env=self.env, timeout=30)

    def metrics(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)


def detection(component: str):
    return lambda e: "HealthMonitoringAgentDetectionEvent" in e and e.get("component") == component


def test_agent_reacts_to_injected_lines_and_resumes_after_restart(tmp_path, agent_env):
    agent = AgentProcess(tmp_path, agent_env)
    try:
        inject = subprocess.run([NODEMEDIC, "inject", "xid", "79", "--pci", "0000:3b:00.0", "--to", str(agent.log)],
                                capture_output=True, text=True, env=agent_env, timeout=30)
        assert inject.returncode == 0, inject.stderr
        event = agent.wait(detection("gpu:0000:3b:00.0"))
        assert event["HealthMonitoringAgentDetectionEvent"] == "activated"
        assert event["code"] == "XID_79" and event["action"] == "reboot" and event["node"] == "test-node"
        assert event["health"] == "UnschedulablePendingReboot"

        status = agent.cli("status", "--json")
        assert status.returncode == 1, status.stderr
        doc = json.loads(status.stdout)
        assert doc["agent_running"] is True and doc["verdict"]["health"] == "UnschedulablePendingReboot"
        assert doc["active"][0]["component"] == "gpu:0000:3b:00.0"

        body = agent.metrics()
        assert 'nodemedic_node_health{status="UnschedulablePendingReboot"} 1.0' in body
        assert 'nodemedic_findings_total{check="kernel_log",code="XID_79",healthy="false"} 1.0' in body

        # an application error on another GPU is logged but changes nothing
        with open(agent.log, "a") as fh:
            fh.write("Feb 23 16:24:18 h kernel: NVRM: Xid (PCI:0000:5d:00): 13, pid=1, name=python, Graphics "
                     "Exception\n" + "Feb 23 16:24:18 h kernel: unrelated noise\n" * 100)
        app = agent.wait(detection("gpu:0000:5d:00.0"))
        assert app["HealthMonitoringAgentDetectionEvent"] == "no_action"
        assert app["health"] == "UnschedulablePendingReboot"
        assert agent.terminate() == 0
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()

    again = AgentProcess(tmp_path, agent_env)
    try:
        resumed = again.cli("status", "--json")
        assert json.loads(resumed.stdout)["verdict"]["health"] == "UnschedulablePendingReboot"
        assert 'nodemedic_node_health{status="UnschedulablePendingReboot"} 1.0' in again.metrics()
        # the old line is not read again after a restart: no duplicate decision
        with pytest.raises(AssertionError):
            again.wait(detection("gpu:0000:3b:00.0"), timeout=1.0)
        cleared = again.cli("clear", "--code", "XID_79")
        assert cleared.returncode == 0, cleared.stderr
        assert "running agent applied it" in cleared.stdout and "Schedulable" in cleared.stdout
        event = again.wait(detection("gpu:0000:3b:00.0"))
        assert event["HealthMonitoringAgentDetectionEvent"] == "cleared" and event["health"] == "Schedulable"
        assert again.cli("status").returncode == 0
        assert again.terminate() == 0
    finally:
        if again.proc.poll() is None:
            again.proc.kill()


def test_a_line_written_right_after_ready_is_not_missed(tmp_path, agent_env):
    agent = AgentProcess(tmp_path, agent_env)
    try:
        with open(agent.log, "a") as fh:
            fh.write("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n")
        assert agent.wait(detection("gpu:0000:3b:00.0"))["code"] == "XID_79"
        assert agent.terminate() == 0
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()


def test_storm_of_one_xid_is_one_decision_and_counted(tmp_path, agent_env):
    agent = AgentProcess(tmp_path, agent_env)
    try:
        line = "Feb 23 16:24:18 h kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n"
        with open(agent.log, "a") as fh:
            for _ in range(20):
                fh.write(line * 1000)
                fh.flush()
            fh.write("NVRM: Xid (PCI:0000:5d:00): 48, pid=1, name=x, DBE\n")
        agent.wait(detection("gpu:0000:5d:00.0"), timeout=20)
        decisions = [ln for ln in agent.raw if "HealthMonitoringAgentDetectionEvent" in ln]
        assert len(decisions) == 2
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if 'code="XID_79",healthy="false"} 20000.0' in agent.metrics():
                break
            time.sleep(0.1)
        else:
            pytest.fail("storm findings not all counted")
        assert agent.terminate() == 0  # repeats are persisted lazily, and at the latest on stop
        final = json.loads(agent.cli("status", "--json").stdout)
        assert {f["code"]: f["count"] for f in final["active"]}["XID_79"] == 20000
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()


def test_corrupt_state_file_is_moved_aside_and_agent_starts(tmp_path, agent_env):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text("{ this is not json")
    agent = AgentProcess(tmp_path, agent_env)
    try:
        assert any("moved aside" in line for line in agent.raw)
        assert list((tmp_path / "state").glob("state.json.corrupt-*"))
        assert agent.cli("status").returncode == 0
        assert agent.terminate() == 0
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()


def test_log_file_created_after_start_is_followed(tmp_path, agent_env):
    env = dict(agent_env)
    agent = AgentProcess(tmp_path, env)  # kern.log does not exist yet: the file source waits for it to appear
    try:
        agent.log.write_text("")
        with open(agent.log, "a") as fh:
            fh.write("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, DBE\n")
        event = agent.wait(detection("gpu:0000:3b:00.0"))
        assert event["action"] == "reset_gpu" and event["health"] == "Unschedulable"
        assert agent.terminate() == 0
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()


def test_bad_config_exits_2_with_the_key(tmp_path, agent_env):
    bad = tmp_path / "bad.yaml"
    bad.write_text("checks: {kernel_log: {lookback_s: soon}}\n")
    out = subprocess.run([NODEMEDIC, "run", "--config", str(bad)], capture_output=True, text=True, env=agent_env,
                         timeout=30)
    assert out.returncode == 2 and "checks.kernel_log.lookback_s" in out.stderr


def test_unreadable_kernel_log_source_reports_check_failure(tmp_path, agent_env):
    env = dict(agent_env, NODEMEDIC_CHECKS__KERNEL_LOG__SOURCE="journal")
    env["PATH"] = str(BIN)  # no journalctl on PATH
    state = tmp_path / "state"
    proc = subprocess.Popen([str(BIN / "nodemedic"), "run", "--state-dir", str(state), "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.monotonic() + 20
        seen = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen += line
            if "HealthMonitoringAgentDetectionEvent" in line and "CHECK_FAILED" in line:
                event = json.loads(line)
                assert event["action"] == "watch" and event["health"] == "Schedulable"
                assert "journalctl not found" in event["evidence"]["reason"]
                break
        else:
            pytest.fail("no check failure reported:\n" + seen)
        assert proc.poll() is None  # still running
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def test_ranks_on_the_recovery_socket_are_signalled(tmp_path, agent_env):
    import socket as socketlib

    from nodemedic.recovery.protocol import FrameReader, encode

    agent = AgentProcess(tmp_path, agent_env)
    try:
        path = agent_env["NODEMEDIC_RECOVERY__SOCKET"]
        rank = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        rank.settimeout(10)
        rank.connect(path)
        rank.sendall(encode({"type": "register", "rank": 0, "local_rank": 0, "pid": os.getpid(), "job_id": "j1",
                             "gpus": ["0000:3b:00.0"]}))
        reader = FrameReader()
        registered = reader.feed(rank.recv(4096))[0]
        assert registered["type"] == "registered"
        with open(agent.log, "a") as fh:
            fh.write("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n")
        messages = []
        while not messages:
            messages = reader.feed(rank.recv(4096))
        fault = messages[0]
        assert fault["type"] == "fault" and fault["code"] == "XID_79"
        assert fault["generation"] > registered["generation"]
        rank.close()
        assert agent.terminate() == 0
        assert not os.path.exists(path)
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
