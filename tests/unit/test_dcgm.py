from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from nodemedic.checks.base import CheckUnavailable, NodeContext
from nodemedic.checks.nvidia.dcgm import (
    DcgmHealthPoller,
    DcgmPolicyWatcher,
    PolicyViolation,
    PolicyViolationParser,
    parse_discovery,
    parse_health,
)
from nodemedic.model import Action, Severity

FIXTURES = Path(__file__).parent.parent / "fixtures" / "dcgm"
FAKE = str(Path(__file__).parent.parent / "fakes" / "bin" / "dcgmi")
H800_BUS = ["0000:18:00.0", "0000:3e:00.0", "0000:51:00.0", "0000:65:00.0",
            "0000:98:00.0", "0000:bd:00.0", "0000:cf:00.0", "0000:e2:00.0"]
ALL_SYSTEMS = {"PCIE", "NVLINK", "PMU", "MCU", "MEM", "SM", "INFOROM", "THERMAL", "POWER", "DRIVER"}


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.fixture
def calls(tmp_path, monkeypatch):
    """The fake dcgmi's invocations, as argument lists."""
    log = tmp_path / "dcgmi.log"
    monkeypatch.setenv("DCGMI_FAKE_LOG", str(log))
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- parsers ------------------------------------------------------------------------------------------------------

def test_discovery_h800x8():
    gpus = parse_discovery(text("discovery_h800x8.txt"))
    assert sorted(gpus) == list(range(8))
    assert [gpus[i].pci_bus_id for i in range(8)] == H800_BUS
    assert gpus[0].name == "NVIDIA H800"
    assert gpus[7].uuid == "GPU-474d838c-171f-d249-4f45-bbc01a8eb74a"


def test_discovery_null_names_and_trailing_padding():
    gpus = parse_discovery(text("discovery_null_names_excerpt.txt"))
    assert gpus[0].pci_bus_id == "0000:4c:00.0" and gpus[0].name is None
    assert gpus[1].pci_bus_id == "0000:5d:00.0"
    assert gpus[1].uuid == "GPU-75c4ee16-a840-6f6c-9a7b-5ed8f41598b8"
    assert gpus[2].pci_bus_id is None  # the excerpt stops after GPU 2's name


def test_discovery_connection_error_has_no_gpus():
    assert parse_discovery(text("discovery_conn_error.txt")) == {}


def test_health_healthy_json():
    report = parse_health(text("health_healthy.json"))
    assert (report.overall, report.incidents) == ("PASS", [])


def test_health_doc_warning_json():
    report = parse_health(text("health_doc_warning.json"))
    assert report.overall == "WARN"
    assert [(i.entity_group, i.entity_id, i.system, i.result, i.message) for i in report.incidents] == [
        ("GPU", 0, "PCIE", "WARN", "Detected more than 8 PCIe replays per minute for GPU 0: 13"),
        ("GPU", 1, "INFOROM", "WARN", "A corrupt InfoROM has been detected in GPU 1."),
    ]


def test_health_incidents_json():
    report = parse_health(text("health_incidents.json"))
    assert report.overall == "FAIL"
    got = {(i.entity_id, i.system): i.result for i in report.incidents}
    assert got == {(0, "PCIE"): "WARN", (2, "MEM"): "FAIL", (3, "THERMAL"): "FAIL", (3, "POWER"): "WARN",
                   (5, "NVLINK"): "FAIL", (6, "INFOROM"): "FAIL"}
    mem = next(i for i in report.incidents if i.system == "MEM")
    assert mem.message.startswith("Detected 2 volatile double-bit ECC error(s) in GPU 2. Drain the GPU")
    assert mem.message.endswith("A pending retired page has been detected in GPU 2. Monitor - this GPU can still "
                                "perform workload")


def test_health_rejects_non_report():
    with pytest.raises(ValueError):
        parse_health(text("health_not_enabled.txt"))


def feed_all(name: str) -> tuple[PolicyViolationParser, list[PolicyViolation]]:
    parser = PolicyViolationParser()
    out = [v for line in text(name).splitlines() for v in parser.feed(line)]
    return parser, out + parser.flush()


def test_policy_violations_from_source_format():
    _, violations = feed_all("policy_violations.txt")
    assert [(v.kind, v.code, v.values) for v in violations] == [
        ("dbe", "GPU_ECC_UNCORRECTED", {"DBE error count": 1}),
        ("pcie", "PCIE_REPLAY_ERRORS", {"PCIe replay count": 120}),
        ("max_pages", "GPU_RETIRED_PAGES_LIMIT", {"SBE page retirement count": 12, "DBE page retirement count": 50}),
        ("thermal", "GPU_THERMAL_VIOLATION", {"Temperature": 93}),
        ("power", "GPU_POWER_VIOLATION", {"Power": 712}),
        ("nvlink", "NVLINK_ERRORS", {"NVLink Counter value": 17}),
        ("xid", "XID_79", {}),
    ]
    assert violations[0].timestamp == "Tue Mar 10 14:02:11 2026"
    assert violations[5].nvlink_field == 409 and violations[6].xid == 79


def test_policy_violation_real_capture_issue124():
    # Starts with the tail of an earlier violation, which is dropped.
    _, violations = feed_all("policy_reg_issue124.txt")
    assert [(v.code, v.timestamp, v.values) for v in violations] == [
        ("PCIE_REPLAY_ERRORS", "Wed Jan 28 00:34:23 2026", {"PCIe replay count": 99999})]


def test_policy_violation_doc_example():
    parser, violations = feed_all("policy_reg_doc.txt")
    assert parser.listening  # "Listening for violations" without the period
    assert [(v.code, v.headline, v.values) for v in violations] == [
        ("PCIE_REPLAY_ERRORS", "A PCIe error has violated policy manager values.", {})]


# -- the health poller through the fake dcgmi ------------------------------------------------------------------

def test_health_poller_applies_only_with_dcgmi():
    ctx = NodeContext("n1")
    assert DcgmHealthPoller(binary=FAKE).applies(ctx)
    assert not DcgmHealthPoller(binary="/nonexistent/dcgmi").applies(ctx)


def test_health_poller_healthy_sets_watches_once(calls):
    poller = DcgmHealthPoller(binary=FAKE)
    findings = poller.run()
    assert calls() == [["health", "-s", "a"], ["health", "-c", "-j"], ["discovery", "-l"]]
    assert all(f.healthy and f.check == "dcgm.health" for f in findings)
    per_gpu = [f for f in findings if f.component.startswith("gpu:")]
    assert len(per_gpu) == 8 * len(ALL_SYSTEMS)
    assert {f.component for f in per_gpu} == {f"gpu:{bdf}" for bdf in H800_BUS}
    assert {f.code for f in per_gpu} == {f"DCGM_HEALTH_{s}" for s in ALL_SYSTEMS}
    assert [(f.component, f.code) for f in findings if f.component == "node"] == [("node", "DCGM_UNREACHABLE")]

    second = poller.run()
    assert calls()[3:] == [["health", "-c", "-j"]]  # watches and GPU list are kept
    assert len(second) == 8 * len(ALL_SYSTEMS)


def test_health_poller_maps_warn_and_fail(calls, monkeypatch):
    monkeypatch.setenv("DCGMI_FAKE_HEALTH", "health_incidents.json")
    findings = DcgmHealthPoller(binary=FAKE, host="unix:///var/run/dcgm.sock").run()
    assert all(call[-2:] == ["--host", "unix:///var/run/dcgm.sock"] for call in calls())
    faults = {(f.component, f.code): (f.recommended_action, f.severity) for f in findings if not f.healthy}
    assert faults == {
        ("gpu:0000:18:00.0", "DCGM_HEALTH_PCIE"): (Action.WATCH, Severity.WARNING),
        ("gpu:0000:51:00.0", "DCGM_HEALTH_MEM"): (Action.REBOOT, Severity.ERROR),
        ("gpu:0000:65:00.0", "DCGM_HEALTH_THERMAL"): (Action.WATCH, Severity.ERROR),
        ("gpu:0000:65:00.0", "DCGM_HEALTH_POWER"): (Action.WATCH, Severity.WARNING),
        ("gpu:0000:bd:00.0", "DCGM_HEALTH_NVLINK"): (Action.REBOOT, Severity.ERROR),
        ("gpu:0000:cf:00.0", "DCGM_HEALTH_INFOROM"): (Action.WATCH, Severity.ERROR),
    }
    mem = next(f for f in findings if f.code == "DCGM_HEALTH_MEM" and not f.healthy)
    assert "Failure on GPU 2" in mem.message and mem.evidence["system"] == "Memory system"
    healthy = {(f.component, f.code) for f in findings if f.healthy}
    assert ("gpu:0000:18:00.0", "DCGM_HEALTH_PCIE") not in healthy
    assert ("gpu:0000:18:00.0", "DCGM_HEALTH_MEM") in healthy
    assert ("gpu:0000:e2:00.0", "DCGM_HEALTH_PCIE") in healthy
    assert len(healthy) == 8 * len(ALL_SYSTEMS) - 6 + 1  # + DCGM_UNREACHABLE on the node


def test_health_poller_without_discovery_names_gpus_by_dcgm_id(monkeypatch):
    monkeypatch.setenv("DCGMI_FAKE_HEALTH", "health_doc_warning.json")
    monkeypatch.setenv("DCGMI_FAKE_DISCOVERY", "discovery_conn_error.txt")
    findings = DcgmHealthPoller(binary=FAKE).run()
    assert {(f.component, f.code) for f in findings if not f.healthy} == {
        ("gpu:dcgm-0", "DCGM_HEALTH_PCIE"), ("gpu:dcgm-1", "DCGM_HEALTH_INFOROM")}
    assert {f.component for f in findings if f.healthy} == {"gpu:dcgm-0", "gpu:dcgm-1", "node"}


def test_health_poller_unreachable_then_reported_then_back(calls, monkeypatch):
    clock = Clock()
    poller = DcgmHealthPoller(binary=FAKE, unreachable_after_s=300, clock=clock)
    monkeypatch.setenv("DCGMI_FAKE_DOWN", "1")
    with pytest.raises(CheckUnavailable, match="DCGM not available: Error: unable to establish a connection"):
        poller.run()
    clock.now += 300
    with pytest.raises(CheckUnavailable):
        poller.run()
    clock.now += 1
    for _ in range(2):
        [down] = poller.run()
        assert (down.component, down.code, down.healthy, down.severity) == (
            "node", "DCGM_UNREACHABLE", False, Severity.WARNING)
        assert "unreachable for 301s" in down.message

    monkeypatch.delenv("DCGMI_FAKE_DOWN")
    back = poller.run()
    assert [(f.code, f.healthy) for f in back if f.component == "node"] == [("DCGM_UNREACHABLE", True)]
    assert calls()[-3:] == [["health", "-s", "a"], ["health", "-c", "-j"], ["discovery", "-l"]]
    assert [f.component for f in poller.run() if f.component == "node"] == []  # cleared once
    # A new outage is timed from its own first failure.
    monkeypatch.setenv("DCGMI_FAKE_DOWN", "1")
    clock.now += 10_000
    with pytest.raises(CheckUnavailable):
        poller.run()


def test_health_poller_sets_watches_again_when_engine_forgot_them(calls, monkeypatch):
    monkeypatch.setenv("DCGMI_FAKE_HEALTH", "health_not_enabled.txt")
    with pytest.raises(CheckUnavailable, match="Health watches not enabled"):
        DcgmHealthPoller(binary=FAKE).run()
    assert calls() == [["health", "-s", "a"], ["health", "-c", "-j"], ["health", "-s", "a"], ["health", "-c", "-j"]]


def test_health_poller_missing_binary_is_unavailable():
    with pytest.raises(CheckUnavailable, match="not found"):
        DcgmHealthPoller(binary="/nonexistent/dcgmi").run()


# -- the policy watcher through the fake dcgmi -----------------------------------------------------------------

class Running:
    """A watcher's watch() in a thread, collecting what it emits."""

    def __init__(self, watcher: DcgmPolicyWatcher):
        self.watcher = watcher
        self.findings: list = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.watcher.watch(self.findings.append, self.stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def wait_for(self, n: int, timeout: float = 10.0) -> list:
        deadline = time.monotonic() + timeout
        while len(self.findings) < n and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)
        return self.findings

    def finish(self) -> float:
        started = time.monotonic()
        self.stop.set()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()
        return time.monotonic() - started


def test_policy_watcher_streams_violations_and_stops_promptly(calls, monkeypatch):
    monkeypatch.setenv("DCGMI_FAKE_POLICY_DELAY", "0.05")
    watcher = DcgmPolicyWatcher(binary=FAKE, host="10.0.0.5", group=2)
    run = Running(watcher)
    assert watcher.wait_ready(10)
    findings = run.wait_for(7)
    assert [f.code for f in findings] == ["GPU_ECC_UNCORRECTED", "PCIE_REPLAY_ERRORS", "GPU_RETIRED_PAGES_LIMIT",
                                         "GPU_THERMAL_VIOLATION", "GPU_POWER_VIOLATION", "NVLINK_ERRORS", "XID_79"]
    assert {(f.check, f.component) for f in findings} == {("dcgm.policy", "node")}
    assert findings[1].evidence["PCIe replay count"] == 120
    assert findings[6].evidence["xid"] == 79
    assert findings[0].message == ("DCGM policy violation: A double-bit ECC error has violated policy manager "
                                   "values. (DBE error count: 1)")
    assert run.finish() < 1.0
    assert run.error is None
    assert watcher.proc is not None and watcher.proc.poll() is not None  # the follower was terminated
    assert calls() == [
        ["policy", "-g", "2", "--set", "0,0", "-e", "-p", "-n", "-x", "-M", "60", "-T", "90", "--host", "10.0.0.5"],
        ["policy", "-g", "2", "--reg", "--host", "10.0.0.5"],
    ]


def test_policy_watcher_ready_without_period_and_flushes_detail_less_violation(monkeypatch):
    monkeypatch.setenv("DCGMI_FAKE_POLICY", "policy_reg_doc.txt")
    watcher = DcgmPolicyWatcher(binary=FAKE)
    run = Running(watcher)
    assert watcher.wait_ready(10)
    [finding] = run.wait_for(1)
    assert (finding.code, finding.component) == ("PCIE_REPLAY_ERRORS", "node")
    run.finish()


def test_policy_watcher_follower_exit_is_runtime_error(monkeypatch):
    monkeypatch.setenv("DCGMI_FAKE_POLICY", "policy_reg_issue124.txt")
    monkeypatch.setenv("DCGMI_FAKE_POLICY_EXIT", "3")
    emitted: list = []
    with pytest.raises(RuntimeError, match=r"exited \(3\)"):
        DcgmPolicyWatcher(binary=FAKE).watch(emitted.append, threading.Event())
    assert [f.code for f in emitted] == ["PCIE_REPLAY_ERRORS"]  # what came before the exit is still reported


def test_policy_watcher_unreachable_or_missing_is_unavailable(monkeypatch):
    assert not DcgmPolicyWatcher(binary="/nonexistent/dcgmi").applies(NodeContext("n1"))
    with pytest.raises(CheckUnavailable, match="not found"):
        DcgmPolicyWatcher(binary="/nonexistent/dcgmi").watch(lambda f: None, threading.Event())
    monkeypatch.setenv("DCGMI_FAKE_DOWN", "1")
    with pytest.raises(CheckUnavailable, match="DCGM not available"):
        DcgmPolicyWatcher(binary=FAKE).watch(lambda f: None, threading.Event())


def test_policy_violation_naming_a_gpu_goes_to_that_gpu():
    watcher = DcgmPolicyWatcher(binary=FAKE)
    v = PolicyViolation("dbe", "GPU_ECC_UNCORRECTED", "A double-bit ECC error has violated policy manager values.",
                        gpu_id=1)
    assert watcher._component(v) == "gpu:0000:3e:00.0"
