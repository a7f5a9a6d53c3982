"""nvidia-smi check: XML parser on real captures, error outputs, exit codes, the poller through a fake binary."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodemedic.catalog import load_catalog
from nodemedic.checks.base import CheckUnavailable, NodeContext
from nodemedic.checks.nvidia.smi import (NvidiaSmiPoller, classify_output, evaluate, normalize_bus_id,
                                         parse_smi_xml)
from nodemedic.model import Action, Finding

FIXTURES = Path(__file__).parent.parent / "fixtures" / "nvidia_smi"
FAKE = str(Path(__file__).parent.parent / "fakes" / "bin" / "nvidia-smi")
A100, A10G, T4 = "nvsmi_xml_01_a100_sxm4_535.xml", "nvsmi_xml_04_a10g_aws_515.xml", "nvsmi_xml_05_tesla_t4_aws_515.xml"


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


def by_code(findings: list[Finding]) -> dict[str, Finding]:
    out = {f.code: f for f in findings}
    assert len(out) == len(findings), [f.code for f in findings]
    return out


# -- parser on the real captures --------------------------------------------------------------------------------------
def test_a100_v12_mig_clocks_event_reasons():
    report = parse_smi_xml(read(A100))
    assert report.driver_version == "535.54.03"
    assert report.attached_gpus == 4 and len(report.gpus) == 1  # the fixture's author kept one <gpu> of four
    gpu = report.gpus[0]
    assert gpu.bus_id == "0000:01:00.0" and gpu.component == "gpu:0000:01:00.0"
    assert gpu.uuid == "GPU-513536b6-7d19-9063-b049-1e69664bb298"
    assert gpu.product_name == "NVIDIA A100-SXM4-80GB"
    assert gpu.ecc_volatile_uncorrected == 0  # the MIG devices' own sram counters are not read as the GPU's
    assert gpu.retired_pages_pending is None  # N/A on Ampere
    assert gpu.remap_pending is None and gpu.remap_failure is None  # <remapped_rows>N/A</remapped_rows> with MIG
    assert (gpu.hw_slowdown, gpu.sw_thermal_slowdown, gpu.hw_thermal_slowdown, gpu.hw_power_brake) == (
        False, False, False, False)
    assert (gpu.pcie_gen_current, gpu.pcie_gen_max, gpu.pcie_width_current, gpu.pcie_width_max) == (4, 4, 16, 16)
    assert gpu.recovery_action is None  # 535 does not print <gpu_recovery_action>


def test_a10g_v11_throttle_reasons_structured_remap():
    report = parse_smi_xml(read(A10G))
    assert report.driver_version == "515.105.01" and report.attached_gpus == 1
    gpu = report.gpus[0]
    assert gpu.bus_id == "0000:00:1e.0"  # 00000000:00:1E.0
    assert gpu.uuid == "GPU-9a9a6c50-2a47-2f51-a902-b82c3b127e94" and gpu.product_name == "NVIDIA A10G"
    assert gpu.remap_pending is False and gpu.remap_failure is False
    assert gpu.retired_pages_pending is None
    assert gpu.hw_slowdown is False and gpu.hw_power_brake is False
    assert (gpu.pcie_gen_current, gpu.pcie_gen_max, gpu.pcie_width_current, gpu.pcie_width_max) == (1, 4, 8, 16)


def test_t4_v11_remap_na_scalar_and_retired_pages():
    gpu = parse_smi_xml(read(T4)).gpus[0]
    assert gpu.product_name == "Tesla T4" and gpu.uuid == "GPU-d37e67a5-91dd-3774-a5cb-99096249601a"
    assert gpu.remap_pending is None and gpu.remap_failure is None
    assert gpu.retired_pages_pending is False
    assert gpu.ecc_volatile_uncorrected == 0
    assert (gpu.pcie_gen_current, gpu.pcie_gen_max, gpu.pcie_width_current, gpu.pcie_width_max) == (3, 3, 8, 16)


@pytest.mark.parametrize("name", [A100, A10G, T4])
def test_gpu_id_attribute_and_pci_bus_id_agree(name):
    import xml.etree.ElementTree as ET
    for el in ET.fromstring(read(name)).findall("gpu"):
        assert el.get("id") == el.findtext("pci/pci_bus_id")


def test_normalize_bus_id():
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0000:0B:00.0") == "0000:0b:00.0"
    assert normalize_bus_id("00000001:00:1E.0") == "0001:00:1e.0"


def test_v12_split_sram_counters_and_missing_elements():
    xml = """<?xml version="1.0" ?><nvidia_smi_log><driver_version>570.86.15</driver_version>
      <attached_gpus>1</attached_gpus><gpu id="00000000:3B:00.0">
      <gpu_recovery_action>Drain and Reset</gpu_recovery_action>
      <ecc_errors><volatile><sram_correctable>4</sram_correctable>
      <sram_uncorrectable_parity>1</sram_uncorrectable_parity>
      <sram_uncorrectable_secded>2</sram_uncorrectable_secded><dram_correctable>0</dram_correctable>
      <dram_uncorrectable>N/A</dram_uncorrectable></volatile></ecc_errors></gpu></nvidia_smi_log>"""
    gpu = parse_smi_xml(xml).gpus[0]
    assert gpu.bus_id == "0000:3b:00.0"  # from the id attribute: no <pci> block
    assert gpu.ecc_volatile_uncorrected == 3
    assert gpu.recovery_action == 4
    assert gpu.uuid is None and gpu.pcie_width_max is None and gpu.hw_slowdown is None


def test_ecc_na_is_none():
    xml = read(A10G).replace("<dram_uncorrectable>0<", "<dram_uncorrectable>N/A<")
    xml = xml.replace("<sram_uncorrectable>0<", "<sram_uncorrectable>N/A<")
    assert parse_smi_xml(xml).gpus[0].ecc_volatile_uncorrected is None
    assert "GPU_ECC_UNCORRECTED" not in by_code(evaluate(0, xml))


@pytest.mark.parametrize("text", [read("semi_a10g_515_truncated.xml"), "", "not xml at all",
                                  "<?xml version='1.0'?><other/>",
                                  "<nvidia_smi_log><gpu id='garbage'></gpu></nvidia_smi_log>"])
def test_malformed_xml_raises_value_error(text):
    with pytest.raises(ValueError, match="nvidia-smi"):
        parse_smi_xml(text)


# -- findings from XML ------------------------------------------------------------------------------------------------
def test_healthy_a100_gives_healthy_findings_for_readable_fields_only():
    findings = by_code(evaluate(0, read(A100), now=1.0, pcie_width=16))
    assert set(findings) == {"GPU_ECC_UNCORRECTED", "GPU_HW_SLOWDOWN", "GPU_THERMAL_SLOWDOWN", "GPU_POWER_BRAKE",
                             "PCIE_LINK_DEGRADED", "GPU_INFOROM_CORRUPTED",
                             "NVIDIA_DRIVER_UNAVAILABLE"}  # retired pages and remap are N/A, no recovery action
    assert all(f.healthy and f.check == "nvidia_smi" for f in findings.values())
    assert all(f.component == "gpu:0000:01:00.0" for c, f in findings.items() if c != "NVIDIA_DRIVER_UNAVAILABLE")
    assert findings["NVIDIA_DRIVER_UNAVAILABLE"].component == "node"
    assert findings["GPU_ECC_UNCORRECTED"].evidence["volatile_uncorrected"] == 0


def test_a10g_pcie_link_judged_only_against_a_known_instance_width():
    # AWS's own g5 capture runs x8 of a x16 maximum at gen1 of gen4 (idle): with no known width for the
    # instance type, neither is a fault.
    findings = by_code(evaluate(0, read(A10G)))
    assert "PCIE_LINK_DEGRADED" not in findings
    link = by_code(evaluate(0, read(A10G), pcie_width=16))["PCIE_LINK_DEGRADED"]
    assert not link.healthy
    assert link.evidence == {"pci": "0000:00:1e.0", "uuid": "GPU-9a9a6c50-2a47-2f51-a902-b82c3b127e94",
                             "current_link_width": 8, "max_link_width": 16, "expected_link_width": 16,
                             "current_link_gen": 1, "max_link_gen": 4}
    assert by_code(evaluate(0, read(A10G), pcie_width=8))["PCIE_LINK_DEGRADED"].healthy
    gen_only = read(A10G).replace("<current_link_width>8x</current_link_width>",
                                  "<current_link_width>16x</current_link_width>")
    assert by_code(evaluate(0, gen_only, pcie_width=16))["PCIE_LINK_DEGRADED"].healthy
    assert findings["GPU_ROW_REMAP_PENDING"].healthy and findings["GPU_ROW_REMAP_FAILURE"].healthy


def test_semi_synthetic_a100_faults():
    findings = by_code(evaluate(0, read("semi_a100_535_faults.xml"), pcie_width=16))
    for code in ("GPU_ECC_UNCORRECTED", "GPU_HW_SLOWDOWN", "GPU_THERMAL_SLOWDOWN", "GPU_POWER_BRAKE",
                 "PCIE_LINK_DEGRADED", "GPU_RECOVERY_ACTION"):
        assert not findings[code].healthy, code
    assert findings["GPU_ECC_UNCORRECTED"].evidence["volatile_uncorrected"] == 3  # sram 1 + dram 2
    assert findings["GPU_THERMAL_SLOWDOWN"].evidence["sw_thermal_slowdown"] is True
    assert findings["GPU_RECOVERY_ACTION"].recommended_action is Action.RESET_GPU


def test_semi_synthetic_remap_and_retired_pages():
    remap = by_code(evaluate(0, read("semi_a10g_515_remap_pending_failure.xml")))
    assert not remap["GPU_ROW_REMAP_PENDING"].healthy and not remap["GPU_ROW_REMAP_FAILURE"].healthy
    retired = by_code(evaluate(0, read("semi_t4_515_retired_pending.xml")))
    assert not retired["GPU_RETIRED_PAGES_PENDING"].healthy
    assert by_code(evaluate(0, read(T4)))["GPU_RETIRED_PAGES_PENDING"].healthy


@pytest.mark.parametrize("text,number,action,healthy", [
    ("None", 0, None, True), ("Reset", 1, Action.RESET_GPU, False), ("Reboot", 2, Action.REBOOT, False),
    ("Drain P2P", 3, Action.RESET_GPU, False), ("Drain and Reset", 4, Action.RESET_GPU, False),
    ("0x2 (Node Reboot Required)", 2, Action.REBOOT, False)])
def test_recovery_action(text, number, action, healthy):
    xml = read("semi_a100_535_faults.xml").replace(">Reset</gpu_recovery_action>", f">{text}</gpu_recovery_action>")
    finding = by_code(evaluate(0, xml))["GPU_RECOVERY_ACTION"]
    assert (finding.evidence["recovery_action"], finding.recommended_action, finding.healthy) == (
        number, action, healthy)


def test_recovery_action_na_gives_no_finding():
    xml = read("semi_a100_535_faults.xml").replace(">Reset</gpu_recovery_action>", ">N/A</gpu_recovery_action>")
    assert "GPU_RECOVERY_ACTION" not in by_code(evaluate(0, xml))


def test_count_mismatch_and_healthy_count():
    low = by_code(evaluate(0, read(A100), expected_gpus=8))["GPU_COUNT_MISMATCH"]
    assert not low.healthy and low.component == "node"
    assert low.evidence == {"found": 1, "expected": 8, "bus_ids": ["0000:01:00.0"], "attached_gpus": 4}
    ok = by_code(evaluate(0, read(T4), expected_gpus=1))["GPU_COUNT_MISMATCH"]
    assert ok.healthy and ok.component == "node" and ok.evidence["found"] == 1
    assert "GPU_COUNT_MISMATCH" not in by_code(evaluate(0, read(T4)))


def test_every_code_is_in_the_catalog():
    catalog = load_catalog()
    findings = evaluate(0, read("semi_a100_535_faults.xml"), expected_gpus=8, pcie_width=16)
    findings += evaluate(0, read("semi_a10g_515_remap_pending_failure.xml"))
    findings += evaluate(0, read("semi_t4_515_retired_pending.xml"))
    for name in FIXTURES.glob("nvsmi_err_*.txt"):
        findings += classify_output(name.read_text())
    for rc in (8, 9, 10, 12, 14, 15):
        findings += evaluate(rc, "")
    assert {f.code for f in findings if f.code not in catalog} == set()
    assert len({f.code for f in findings}) >= 15


# -- error outputs ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,component,code", [
    ("nvsmi_err_01_devhandle_unknown_2015.txt", "gpu:0000:0b:00.0", "GPU_UNKNOWN_ERROR"),
    ("nvsmi_err_02_devhandle_unknown_nospace.txt", "gpu:0000:07:00.0", "GPU_UNKNOWN_ERROR"),
    ("nvsmi_err_04_gpu_lost_linux.txt", "gpu:0000:03:00.0", "GPU_LOST"),
    ("nvsmi_err_07_devhandle_query_single.txt", "gpu:0000:09:00.0", "GPU_UNKNOWN_ERROR"),
    ("nvsmi_err_08_driver_communication.txt", "node", "NVIDIA_DRIVER_UNAVAILABLE"),
    ("nvsmi_err_09_inforom_warning_line.txt", "gpu:0000:00:1e.0", "GPU_INFOROM_CORRUPTED"),
])
def test_error_outputs(name, component, code):
    [finding] = classify_output(read(name))
    assert (finding.component, finding.code, finding.healthy) == (component, code, False)
    assert finding.evidence["line"] in read(name)


def test_gpu_lost_with_exit_15_is_one_finding_on_the_gpu():
    [finding] = evaluate(15, read("nvsmi_err_04_gpu_lost_linux.txt"))
    assert (finding.component, finding.code) == ("gpu:0000:03:00.0", "GPU_LOST")


def test_no_devices_found():
    [count] = evaluate(6, read("nvsmi_err_06_no_devices_found.txt"), expected_gpus=8)
    assert (count.code, count.healthy, count.evidence["found"], count.evidence["bus_ids"]) == (
        "GPU_COUNT_MISMATCH", False, 0, [])
    assert evaluate(6, read("nvsmi_err_06_no_devices_found.txt")) == []  # no expectation, nothing to compare


def test_inforom_warning_beside_xml_keeps_the_xml_findings():
    findings = evaluate(0, read("nvsmi_err_09_inforom_warning_line.txt") + read(T4), expected_gpus=1)
    codes = [f.code for f in findings]
    assert "GPU_INFOROM_CORRUPTED" in codes and "GPU_COUNT_MISMATCH" in codes and "GPU_ECC_UNCORRECTED" in codes


# -- exit codes -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rc,code", [(8, "GPU_POWER_CABLE"), (9, "NVIDIA_DRIVER_UNAVAILABLE"),
                                     (10, "GPU_UNKNOWN_ERROR"), (12, "NVIDIA_DRIVER_UNAVAILABLE"),
                                     (14, "GPU_INFOROM_CORRUPTED"), (15, "GPU_LOST")])
def test_exit_codes(rc, code):
    [finding] = evaluate(rc, "")
    assert (finding.component, finding.code, finding.healthy) == ("node", code, False)
    assert finding.evidence["exit_code"] == rc


def test_exit_9_with_driver_message_is_one_finding():
    [finding] = evaluate(9, read("nvsmi_err_08_driver_communication.txt"))
    assert finding.code == "NVIDIA_DRIVER_UNAVAILABLE" and "couldn't communicate" in finding.evidence["line"]


@pytest.mark.parametrize("rc", [2, 4])
def test_bad_argument_and_permission_are_check_unavailable(rc):
    with pytest.raises(CheckUnavailable, match=f"exited {rc}"):
        evaluate(rc, "Insufficient Permissions")


def test_unknown_exit_without_message_is_check_unavailable():
    with pytest.raises(CheckUnavailable, match="exited 255"):
        evaluate(255, "something nobody has seen before")


def test_exit_0_without_xml_raises_value_error():
    with pytest.raises(ValueError):
        evaluate(0, "garbage")
    with pytest.raises(ValueError):
        evaluate(0, read("semi_a10g_515_truncated.xml"))


def test_failing_exit_with_truncated_xml_keeps_its_exit_finding():
    [finding] = evaluate(15, read("semi_a10g_515_truncated.xml"))
    assert finding.code == "GPU_LOST" and finding.component == "node"


# -- the poller through the fake binary -------------------------------------------------------------------------------
@pytest.fixture
def fake(monkeypatch):
    def use(fixture: str, exit_code: int = 0, stream: str = "stdout", sleep: float = 0) -> None:
        monkeypatch.setenv("FAKE_NVIDIA_SMI_FIXTURE", fixture)
        monkeypatch.setenv("FAKE_NVIDIA_SMI_EXIT", str(exit_code))
        monkeypatch.setenv("FAKE_NVIDIA_SMI_STREAM", stream)
        monkeypatch.setenv("FAKE_NVIDIA_SMI_SLEEP", str(sleep))
    return use


def test_poller_end_to_end_healthy(fake):
    fake(T4)
    poller = NvidiaSmiPoller(expected_gpus=1, binary=FAKE)
    assert poller.name == "nvidia_smi" and poller.interval_s == 60.0 and poller.timeout_s == 30.0
    findings = by_code(poller.run())
    assert findings["GPU_COUNT_MISMATCH"].healthy
    assert findings["GPU_RETIRED_PAGES_PENDING"].healthy
    assert all(f.check == "nvidia_smi" for f in findings.values())


def test_poller_end_to_end_faults(fake):
    fake("semi_a100_535_faults.xml")
    findings = by_code(NvidiaSmiPoller(expected_gpus=4, binary=FAKE).run())
    assert not findings["GPU_COUNT_MISMATCH"].healthy
    assert findings["GPU_RECOVERY_ACTION"].recommended_action is Action.RESET_GPU


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_poller_error_output_and_exit_code(fake, stream):
    fake("nvsmi_err_04_gpu_lost_linux.txt", exit_code=15, stream=stream)
    [finding] = NvidiaSmiPoller(binary=FAKE).run()
    assert (finding.component, finding.code) == ("gpu:0000:03:00.0", "GPU_LOST")


def test_poller_malformed_xml_raises_value_error(fake):
    fake("semi_a10g_515_truncated.xml")
    with pytest.raises(ValueError):
        NvidiaSmiPoller(binary=FAKE).run()


def test_poller_timeout_is_check_unavailable(fake):
    fake(T4, sleep=5)
    with pytest.raises(CheckUnavailable, match="timed out"):
        NvidiaSmiPoller(binary=FAKE, timeout_s=0.5).run()


def test_poller_missing_binary():
    with pytest.raises(CheckUnavailable, match="not found"):
        NvidiaSmiPoller(binary="/nonexistent/nvidia-smi").run()


def test_fake_refuses_other_arguments(fake):
    from nodemedic.checks.tools import run_tool
    fake(T4)
    result = run_tool([FAKE, "-L"], 10)
    assert result.returncode == 2 and "not recognized" in result.stdout
    with pytest.raises(CheckUnavailable, match="exited 2"):
        evaluate(result.returncode, result.stdout, result.stderr)


def test_applies():
    ctx = NodeContext(node_name="n1")
    assert NvidiaSmiPoller(binary=FAKE).applies(ctx)
    assert not NvidiaSmiPoller(binary="/nonexistent/nvidia-smi").applies(ctx)
    assert NvidiaSmiPoller(expected_gpus=8, binary="/nonexistent/nvidia-smi").applies(ctx)
    assert not NvidiaSmiPoller(expected_gpus=0, binary="/nonexistent/nvidia-smi").applies(ctx)
