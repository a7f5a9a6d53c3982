"""Every kernel-log line form in REFERENCE.md and the real captures in tests/fixtures/kernel_log."""

from __future__ import annotations

import pytest

from nodemedic.checks.kernel_log.parser import KernelLogClassifier, normalize_bdf
from nodemedic.model import Action

from conftest import kernel_samples

SAMPLES = kernel_samples()


@pytest.mark.parametrize("sample", SAMPLES, ids=[f"{i}-{s.get('code')}" for i, s in enumerate(SAMPLES)])
def test_sample_lines(sample):
    f = KernelLogClassifier().classify(sample["line"], 123.0)
    if sample.get("code") is None:
        assert f is None, f"should not be recognised: {sample['line']}"
        return
    assert f is not None, f"not recognised: {sample['line']}"
    assert f.code == sample["code"]
    assert f.component == sample["component"]
    assert f.healthy is bool(sample.get("healthy", False))
    assert f.observed_at == 123.0
    assert f.check == "kernel_log"
    assert f.evidence["line"] == sample["line"]
    if "action" in sample:
        assert f.recommended_action == Action.parse(sample["action"])


def test_fixture_covers_every_reference_form():
    codes = {s.get("code") for s in SAMPLES}
    for needed in ("XID_79", "XID_94", "XID_154", "SXID_12028", "PCIE_AER_CORRECTED", "PCIE_AER_NONFATAL",
                   "PCIE_AER_FATAL", "MCE_CORRECTED", "MCE_UNCORRECTED", "EDAC_CE", "EDAC_UE",
                   "NEURON_SRAM_UNCORRECTABLE_ERROR", "EFA_ADMIN_QUEUE_FAILURE"):
        assert needed in codes


def test_xid_evidence_old_and_new_formats():
    c = KernelLogClassifier()
    new = c.classify("NVRM: Xid (PCI:0000:17:00): 94, pid='<unknown>', name=<unknown>, Contained: CE User "
                     "Channel (0x9). RST: No, D-RST: No", 0)
    assert new.evidence["xid"] == 94 and new.evidence["pid"] == "<unknown>"
    assert new.evidence["process"] == "<unknown>"
    assert new.message == "Xid 94: Contained: CE User Channel (0x9). RST: No, D-RST: No"
    old = c.classify("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.", 0)
    assert old.evidence["pid"] == "1234" and "process" not in old.evidence
    assert old.message == "Xid 79: GPU has fallen off the bus."
    mig = c.classify("NVRM: Xid (PCI:0000:3b:00 GPU-I:02 GPU-CI:01): 31, pid=1, name=x, fault", 0)
    assert mig.evidence["gpu_instance"] == 2 and mig.evidence["compute_instance"] == 1


@pytest.mark.parametrize("value,action,healthy", [
    (0, None, True), (1, Action.RESET_GPU, False), (2, Action.REBOOT, False), (3, Action.RESET_GPU, False),
    (4, Action.RESET_GPU, False)])
def test_xid_154_named_actions(value, action, healthy):
    line = f"NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x1 (Old) to 0x{value} (Whatever)"
    f = KernelLogClassifier().classify(line, 0)
    assert f.code == "XID_154"
    assert f.healthy is healthy
    assert f.recommended_action == action
    assert f.evidence["recovery_action"] == value


def test_fallen_off_bus_split_over_several_lines():
    """dmesg and the journal show the 570 driver's multi-line message as separate lines."""
    c = KernelLogClassifier()
    lines = ["[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
             "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
             "               NVRM: fallen off the bus and is not responding to commands.",
             "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s)."]
    results = [c.classify(line, 0) for line in lines]
    assert results[0] is None and results[1] is None and results[3] is None
    assert results[2].code == "XID_79" and results[2].component == "gpu:0000:b3:00.0"


def test_sxid_severity_names_the_action():
    c = KernelLogClassifier()
    fatal = c.classify("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Fatal, Link 32 egress error", 0)
    nonfatal = c.classify("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 error", 0)
    data = c.classify("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Data {0x1, 0x2}", 0)
    assert fatal.recommended_action is Action.REBOOT and fatal.evidence["fatal"] is True
    assert nonfatal.recommended_action is Action.WATCH
    assert data.recommended_action is None


def test_neuron_fields_and_missing_device():
    c = KernelLogClassifier()
    f = c.classify("NEURON_HW_ERR=HBM_UNCORRECTABLE_ERROR instance-id=i-1 hostname=h nd-id=7 nc-id=1 "
                   "serial-num=abc action=TERMINATE_INSTANCE", 0)
    assert f.code == "NEURON_HBM_UNCORRECTABLE_ERROR" and f.component == "neuron:7"
    assert f.evidence["serial-num"] == "abc" and f.recommended_action is Action.REPLACE
    bare = c.classify("kernel: NEURON_HW_ERR=DMA_ERROR", 0)
    assert bare.code == "NEURON_DMA_ERROR" and bare.component == "neuron:unknown"
    assert bare.recommended_action is None


def test_edac_count_and_location():
    f = KernelLogClassifier().classify("EDAC MC1: 262 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0 "
                                       "(channel:1 slot:0)", 0)
    assert f.evidence["count"] == 262 and f.evidence["location"] == "CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"


def test_mce_status_bits_decide_corrected_or_not():
    c = KernelLogClassifier()
    corrected = c.classify("mce: [Hardware Error]: CPU 3: Machine Check: 0 Bank 11: 8c00004f000800c2", 0)
    exception = c.classify("mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 11: 8c00004f000800c2", 0)
    assert corrected.code == "MCE_CORRECTED" and corrected.component == "cpu:3"
    assert exception.code == "MCE_UNCORRECTED"


@pytest.mark.parametrize("line", [
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.154.05  Thu Dec 28 15:37:48 UTC 2023",
    "NVRM: Xid garbage without an address",
    "pcieport 0000:00:01.0: AER: enabled with IRQ 122",
    "EDAC MC: Ver: 3.0.0",
    "mce: CPU0: Thermal monitoring enabled (TM1)",
    "efa 0000:10:1c.0: Setup irqs",
    "infiniband mlx5_0: mlx5_ib_test_wc:290:(pid 1234): Error -110 while trying to test write-combining support",
    "",
    "\x00\xff garbage \ufffd",
    "x" * 100_000,
])
def test_unrecognised_or_malformed_lines_are_ignored(line):
    assert KernelLogClassifier().classify(line, 0) is None


def test_normalize_bdf():
    assert normalize_bdf("00000000", "3B", "00") == "0000:3b:00.0"
    assert normalize_bdf("00008ED0", "00", "00", "1") == "8ed0:00:00.1"
    assert normalize_bdf("10003", "00", "00") == "10003:00:00.0"
