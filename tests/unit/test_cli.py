"""The CLI's commands and exit codes, run in-process."""

from __future__ import annotations

import json

import pytest

from nodemedic.cli import main, xid_line
from nodemedic.checks.kernel_log.parser import KernelLogClassifier
from nodemedic.state import StateStore

from conftest import finding, kernel_samples


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    for k in list(__import__("os").environ):
        if k.startswith("NODEMEDIC_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("NODEMEDIC_IMDS__ENABLED", "false")
    monkeypatch.setenv("NODEMEDIC_STATE_DIR", str(tmp_path / "state"))
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    monkeypatch.setenv("NODEMEDIC_CONFIG", str(cfg))


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    code, out, _ = run(capsys, "version")
    assert code == 0 and out.startswith("nodemedic 0.")


def test_check_healthy_unhealthy_and_cannot_check(capsys, tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("[    1.0] Linux version 6.1\n[    2.0] NVRM: Xid (PCI:0000:cb:00): 13, pid=1, name=p, boom\n")
    code, out, _ = run(capsys, "check", "--kernel-log", str(log))
    assert code == 0 and "Schedulable" in out and "kernel_log" in out
    log.write_text("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n")
    code, out, _ = run(capsys, "check", "--kernel-log", str(log), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["exit_code"] == 1
    assert doc["verdict"]["health"] == "UnschedulablePendingReboot"
    assert doc["faults"][0]["component"] == "gpu:0000:3b:00.0"
    code, out, _ = run(capsys, "check", "--kernel-log", str(tmp_path / "missing.log"))
    assert code == 2 and "failed" in out


def test_check_with_config_error_exits_2(capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("metrics: {port: nope}\n")
    code, _, err = run(capsys, "check", "--config", str(bad))
    assert code == 2 and "metrics.port" in err


def test_status_reads_the_state_store(capsys, tmp_path, policy, state, clock):
    code, _, err = run(capsys, "status")
    assert code == 2 and "no state" in err
    store = StateStore(tmp_path / "state")
    store.save(state)
    code, out, _ = run(capsys, "status")
    assert code == 0 and "Schedulable" in out and "not running" in out
    policy.observe(state, finding("XID_79"), clock())
    store.save(state)
    code, out, _ = run(capsys, "status")
    assert code == 1 and "UnschedulablePendingReboot" in out and "XID_79" in out
    code, out, _ = run(capsys, "status", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["active"][0]["code"] == "XID_79" and doc["agent_running"] is False


def test_replay_prints_decisions_with_log_times_and_has_no_side_effects(capsys, tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(
        "Feb 23 16:24:18 host kernel: NVRM: Xid (PCI:0000:9b:00): 119, pid=1, name=x, Timeout waiting for RPC\n"
        "Feb 23 16:24:19 host kernel: NVRM: Xid (PCI:0000:9b:00): 119, pid=1, name=x, Timeout waiting for RPC\n"
        "Feb 23 16:25:00 host kernel: NVRM: Xid (PCI:0000:cb:00): 13, pid=1, name=x, Graphics exception\n")
    code, out, _ = run(capsys, "replay", str(log), "--json", "--year", "2025")
    doc = json.loads(out)
    assert code == 1 and doc["lines"] == 3
    assert [d["HealthMonitoringAgentDetectionEvent"] for d in doc["decisions"]] == ["activated", "no_action"]
    assert doc["decisions"][0]["when"] == "2025-02-23T16:24:18Z"
    assert doc["verdict"]["health"] == "UnschedulablePendingReboot"
    assert not (tmp_path / "state").exists()
    code, out, _ = run(capsys, "replay", str(log), "--year", "2025")
    assert "activated" in out and "final verdict: UnschedulablePendingReboot" in out


def test_replay_of_all_samples_and_missing_file(capsys, tmp_path):
    log = tmp_path / "all.log"
    log.write_text("\n".join(s["line"] for s in kernel_samples()) + "\n")
    code, out, _ = run(capsys, "replay", str(log))
    assert code == 1 and "UnschedulablePendingReplacement" in out
    code, _, err = run(capsys, "replay", str(tmp_path / "nope"))
    assert code == 2 and "cannot read" in err


@pytest.mark.parametrize("xid", [13, 48, 79, 94, 119, 154])
def test_injected_xid_lines_parse_back(xid):
    line = xid_line(xid, "0000:3B:00.0")
    f = KernelLogClassifier().classify(line, 0)
    assert f.code == f"XID_{xid}" and f.component == "gpu:0000:3b:00.0"


def test_inject_appends_to_file(capsys, tmp_path):
    log = tmp_path / "kern.log"
    code, out, _ = run(capsys, "inject", "xid", "79", "--pci", "3b:00.0", "--to", str(log))
    assert code == 0
    line = log.read_text().strip()
    assert " kernel: NVRM: Xid (PCI:0000:3b:00): 79," in line and out.strip() == line
    code, _, err = run(capsys, "inject", "xid", "79", "--pci", "zz", "--to", str(log))
    assert code == 2 and "PCI address" in err
    code, _, err = run(capsys, "inject", "xid", "79", "--pci", "3b:00.0")
    assert code == 2 and "--to" in err


def test_clear_without_running_agent(capsys, tmp_path, policy, state, clock):
    policy.observe(state, finding("XID_79"), clock())
    StateStore(tmp_path / "state").save(state)
    code, _, err = run(capsys, "clear")
    assert code == 2 and "say what to clear" in err
    code, out, _ = run(capsys, "clear", "--code", "XID_79")
    assert code == 0 and "cleared 1 fault" in out and "Schedulable" in out
    loaded = StateStore(tmp_path / "state").load()
    assert loaded.active == {} and loaded.history[-1].code == "XID_79"
