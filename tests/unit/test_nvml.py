"""NVML checks over the fake pynvml: events become findings; the poller reads every health field."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from nodemedic.checks.base import CheckUnavailable, NodeContext
from nodemedic.checks.nvidia.nvml import NvmlEventWatcher, NvmlPoller
from nodemedic.checks.platform.profiles import profile_for
from nodemedic.model import Action

from fakes import nvml as fake_mod
from fakes.nvml import FakeGpu, FakeNvml, default_gpus
from fakes.sysfs import hgx_node

GPU0 = "gpu:0000:53:00.0"


class Events:
    def __init__(self, nvml: FakeNvml):
        self.watcher = NvmlEventWatcher(nvml, wait_ms=50)
        self.q: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        assert self.watcher.wait_ready(5)

    def _run(self):
        try:
            self.watcher.watch(self.q.put, self.stop)
        except BaseException as exc:
            self.errors.append(exc)

    def close(self):
        self.stop.set()
        self.t.join(5)
        assert not self.t.is_alive()


def by_code(findings, code, component=None):
    return [f for f in findings if f.code == code and (component is None or f.component == component)]


def test_event_watcher_registers_supported_types_and_maps_events():
    nvml = FakeNvml()
    nvml.gpus[1].supported_events = fake_mod.nvmlEventTypeXidCriticalError  # an older GPU
    ev = Events(nvml)
    try:
        assert nvml.registered(0) & fake_mod.nvmlEventTypeGpuRecoveryAction
        assert nvml.registered(1) == fake_mod.nvmlEventTypeXidCriticalError
        nvml.post_event(0, fake_mod.nvmlEventTypeXidCriticalError, 79)
        f = ev.q.get(timeout=2)
        assert (f.code, f.component, f.check, f.evidence["xid"]) == ("XID_79", GPU0, "nvml.events", 79)
        cases = [(fake_mod.nvmlEventTypeDoubleBitEccError, 0, "GPU_ECC_UNCORRECTED"),
                 (fake_mod.nvmlEventTypeSingleBitEccError, 0, "GPU_ECC_CORRECTED"),
                 (fake_mod.nvmlEventTypeDramRetirementFailure, 0, "GPU_ROW_REMAP_FAILURE"),
                 (fake_mod.nvmlEventTypeDramRetirementEvent, 0, "GPU_MEMORY_RETIREMENT"),
                 (fake_mod.nvmlEventTypeNonFatalPoisonError, 0, "GPU_POISON_CONTAINED"),
                 (fake_mod.nvmlEventTypeFatalPoisonError, 0, "GPU_POISON_UNCONTAINED"),
                 (fake_mod.nvmlEventTypeGpuUnavailableError, 0, "GPU_LOST")]
        for etype, data, code in cases:
            nvml.post_event(2, etype, data)
            f = ev.q.get(timeout=2)
            assert f.code == code and f.component == "gpu:0000:75:00.0"
        nvml.post_event(3, fake_mod.nvmlEventTypeGpuRecoveryAction, 2)
        f = ev.q.get(timeout=2)
        assert f.code == "GPU_RECOVERY_ACTION" and f.recommended_action is Action.REBOOT
        nvml.post_event(3, fake_mod.nvmlEventTypeGpuRecoveryAction, 0)
        assert ev.q.get(timeout=2).healthy
    finally:
        ev.close()
    assert not ev.errors and nvml.initialised == 0  # shut down cleanly


def test_event_watcher_stops_promptly():
    ev = Events(FakeNvml())
    started = time.monotonic()
    ev.close()
    assert time.monotonic() - started < 1.0


def test_event_watcher_without_nvml_is_unavailable():
    nvml = FakeNvml()
    nvml.init_error = fake_mod.NVMLError_DriverNotLoaded
    with pytest.raises(CheckUnavailable, match="cannot initialise"):
        NvmlEventWatcher(nvml).watch(lambda f: None, threading.Event())


def test_healthy_8_gpu_node_poll(tmp_path):
    hgx_node(tmp_path)
    poller = NvmlPoller(FakeNvml(), expected_gpus=8, nvlinks_per_gpu=18, sysfs_root=tmp_path)
    findings = poller.run()
    assert all(f.healthy for f in findings), [f for f in findings if not f.healthy]
    assert len({f.component for f in findings}) == 9  # node + 8 GPUs
    codes = {f.code for f in by_code(findings, "GPU_ECC_UNCORRECTED")}
    assert codes == {"GPU_ECC_UNCORRECTED"}
    assert by_code(findings, "GPU_COUNT_MISMATCH", "node")[0].evidence == {"found": 8, "expected": 8}


def test_every_field_fault_is_reported(tmp_path):
    gpus = default_gpus()
    gpus[0].ecc_uncorrected_volatile = 2
    gpus[1].retired_pending = 1
    gpus[2].remapped_rows = (3, 1, 1, 0)
    gpus[3].remapped_rows = (0, 5, 0, 1)
    gpus[4].nvlinks = [1] * 16 + [0, 0]
    gpus[5].pcie_width = (8, 16)
    gpus[6].clock_reasons = 0x08 | 0x40 | 0x01  # hw slowdown + hw thermal + (idle, not a fault)
    gpus[7].recovery_action = 1
    findings = NvmlPoller(FakeNvml(gpus), expected_gpus=8, nvlinks_per_gpu=18, sysfs_root=tmp_path,
                          pcie_width=16).run()
    bad = {(f.code, f.component) for f in findings if not f.healthy}
    assert bad == {
        ("GPU_ECC_UNCORRECTED", "gpu:0000:53:00.0"), ("GPU_RETIRED_PAGES_PENDING", "gpu:0000:64:00.0"),
        ("GPU_ROW_REMAP_PENDING", "gpu:0000:75:00.0"), ("GPU_ROW_REMAP_FAILURE", "gpu:0000:86:00.0"),
        ("NVLINK_DOWN", "gpu:0000:97:00.0"), ("PCIE_LINK_DEGRADED", "gpu:0000:a8:00.0"),
        ("GPU_HW_SLOWDOWN", "gpu:0000:b9:00.0"), ("GPU_THERMAL_SLOWDOWN", "gpu:0000:b9:00.0"),
        ("GPU_RECOVERY_ACTION", "gpu:0000:ca:00.0")}
    nvlink = by_code(findings, "NVLINK_DOWN", "gpu:0000:97:00.0")[0]
    assert nvlink.evidence["down_links"] == [16, 17] and nvlink.evidence["up"] == 16
    assert by_code(findings, "GPU_RECOVERY_ACTION", "gpu:0000:ca:00.0")[0].recommended_action is Action.RESET_GPU
    assert by_code(findings, "GPU_POWER_BRAKE", "gpu:0000:b9:00.0")[0].healthy


def test_missing_gpus_lost_gpus_and_reset_required(tmp_path):
    gpus = default_gpus(7)
    gpus[2].lost = True
    gpus[3].handle_error = fake_mod.NVMLError_GpuIsLost
    gpus[4].handle_error = fake_mod.NVMLError_ResetRequired
    gpus[5].handle_error = fake_mod.NVMLError_Unknown
    hgx_node(tmp_path, gpus=7)
    findings = NvmlPoller(FakeNvml(gpus), expected_gpus=8, sysfs_root=tmp_path).run()
    bad = {(f.code, f.component) for f in findings if not f.healthy}
    assert ("GPU_COUNT_MISMATCH", "node") in bad
    assert ("GPU_LOST", "gpu:0000:75:00.0") in bad        # lost mid-query: its own address is known
    assert ("GPU_LOST", "gpu:0000:86:00.0") in bad        # no handle: named through the PCI bus order
    assert ("GPU_RESET_REQUIRED", "gpu:0000:97:00.0") in bad
    assert ("GPU_UNKNOWN_ERROR", "gpu:0000:a8:00.0") in bad


def test_unsupported_queries_are_skipped_not_faults(tmp_path):
    gpus = [FakeGpu(bus_id="00000000:00:1E.0", ecc_supported=False, nvlinks=[], recovery_action=None)]
    findings = NvmlPoller(FakeNvml(gpus), expected_gpus=1, nvlinks_per_gpu=0, sysfs_root=tmp_path).run()
    assert all(f.healthy for f in findings)
    assert not by_code(findings, "GPU_ECC_UNCORRECTED") and not by_code(findings, "NVLINK_DOWN")
    assert not by_code(findings, "GPU_RECOVERY_ACTION")


def test_pcie_replay_counter_delta(tmp_path):
    nvml = FakeNvml()
    poller = NvmlPoller(nvml, sysfs_root=tmp_path)
    assert not by_code(poller.run(), "PCIE_REPLAY_ERRORS")  # first poll only sets the baseline
    nvml.gpus[0].replays = 500
    assert not by_code(poller.run(), "PCIE_REPLAY_ERRORS", GPU0)[0].healthy
    assert by_code(poller.run(), "PCIE_REPLAY_ERRORS", GPU0)[0].healthy


def test_nvml_unavailable_on_a_gpu_instance_is_a_finding(tmp_path):
    nvml = FakeNvml()
    nvml.init_error = fake_mod.NVMLError_DriverNotLoaded
    poller = NvmlPoller(nvml, sysfs_root=tmp_path)
    ctx = NodeContext("n", "p5.48xlarge", profile_for("p5.48xlarge"))
    assert poller.applies(ctx)
    [f] = poller.run()
    assert f.code == "NVIDIA_DRIVER_UNAVAILABLE" and not f.healthy and f.component == "node"
    nvml.init_error = None
    assert by_code(poller.run(), "NVIDIA_DRIVER_UNAVAILABLE")[0].healthy


def test_no_gpus_expected_and_no_nvml_means_not_applicable(tmp_path):
    nvml = FakeNvml()
    nvml.init_error = fake_mod.NVMLError_LibraryNotFound
    poller = NvmlPoller(nvml, sysfs_root=tmp_path)
    assert not poller.applies(NodeContext("n", "trn1.32xlarge", profile_for("trn1.32xlarge")))
    assert not poller.applies(NodeContext("n"))
    with pytest.raises(CheckUnavailable):
        poller.run()
    assert not NvmlEventWatcher(nvml).applies(NodeContext("n"))


def test_profile_supplies_expectations(tmp_path):
    gpus = default_gpus(4)
    for g in gpus:
        g.nvlinks = [1] * 12
    gpus[0].nvlinks = [1] * 10 + [0, 0]
    poller = NvmlPoller(FakeNvml(gpus), sysfs_root=tmp_path)
    assert poller.applies(NodeContext("n", "ml.p4d.24xlarge", profile_for("ml.p4d.24xlarge")))
    findings = poller.run()
    count = by_code(findings, "GPU_COUNT_MISMATCH")[0]
    assert not count.healthy and count.evidence == {"found": 4, "expected": 8}
    down = by_code(findings, "NVLINK_DOWN", GPU0)[0]
    assert not down.healthy and down.evidence["expected"] == 12 and down.evidence["down_links"] == [10, 11]
    assert by_code(findings, "NVLINK_DOWN", "gpu:0000:64:00.0")[0].healthy


def test_real_pynvml_is_the_default_seam():
    """Without a module handed in, the checks import nvidia-ml-py's pynvml (not the fake)."""
    from nodemedic.checks.nvidia.nvml import load_pynvml
    try:
        mod = load_pynvml()
    except ImportError:
        pytest.skip("nvidia-ml-py not installed")
    assert mod.__name__ == "pynvml" and hasattr(mod, "nvmlEventSetWait_v2")
