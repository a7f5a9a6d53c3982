from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodemedic.checks.active.base import Status
from nodemedic.checks.active.dcgm_diag import (
    EXIT_ISOLATE,
    EXIT_TEST_FAILED,
    FAIL,
    PASS,
    SKIP,
    WARN,
    diag_command,
    judge_diag,
    parse_diag,
    run_diag,
)
from nodemedic.checks.nvidia.dcgm import parse_discovery
from nodemedic.model import Action, Severity

from fakes.replay import replay

FIXTURES = Path(__file__).parent.parent / "fixtures" / "dcgm_diag"
DISCOVERY = Path(__file__).parent.parent / "fixtures" / "dcgm" / "discovery_h800x8.txt"
FAKE = str(Path(__file__).parent.parent / "fakes" / "bin" / "dcgmi-diag")


def report_of(name: str):
    return parse_diag((FIXTURES / name).read_text())


@pytest.fixture
def bdfs() -> dict[int, str]:
    """GPU id -> bus id, from the real H800 `dcgmi discovery -l` capture."""
    return {gid: gpu.pci_bus_id for gid, gpu in parse_discovery(DISCOVERY.read_text()).items() if gpu.pci_bus_id}


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return replay(monkeypatch, tmp_path, "DCGMI_DIAG_FAKE")


# -- DCGM 4 JSON --------------------------------------------------------------------------------------------------

def test_dcgm4_pass():
    report = report_of("dcgm4_r2_pass_synthetic.json")
    assert report.format == "dcgm4" and report.version == "4.2.3" and report.driver_version == "570.148.08"
    assert len(report.results) == 24 and {r.status for r in report.results} == {PASS}
    assert report.results[0].entity_ids == (0,) and report.results[0].test == "software"
    assert report.test_summaries == {"software": PASS, "memory": PASS, "pcie": PASS}
    assert report.serials[("GPU", 3)] == "1652320000003"
    result = judge_diag(report, 0)
    assert result.status is Status.PASSED and not result.findings
    assert result.metrics["tests"] == 3 and result.metrics["failed"] == 0


def test_dcgm4_failures_map_to_gpus_and_actions(bdfs):
    report = report_of("dcgm4_r2_fail_synthetic.json")
    assert [(r.test, r.entity_ids) for r in report.failures] == [
        ("software", (6,)), ("memory", (3,)), ("pcie", (5,)), ("pcie", (7,))]
    warning = report.failures[1].warnings[0]
    assert (warning.error_id, warning.category, warning.severity) == (84, 10, 2)

    result = judge_diag(report, EXIT_ISOLATE, bdfs)
    assert result.status is Status.FAILED
    by_gpu = {f.component: f for f in result.findings}
    assert set(by_gpu) == {f"gpu:{bdfs[g]}" for g in (1, 3, 5, 6, 7)}

    memory = by_gpu["gpu:0000:65:00.0"]  # GPU 3
    assert memory.code == "DCGM_DIAG_MEMORY" and memory.recommended_action is Action.REBOOT
    assert memory.severity is Severity.CRITICAL
    assert memory.evidence["error_ids"] == [84] and memory.evidence["error_severities"] == ["isolate"]
    assert memory.evidence["serial"] == "1652320000003"
    assert "2 rows were remapped" in memory.message

    nvlink = by_gpu[f"gpu:{bdfs[5]}"]  # reset
    assert nvlink.code == "DCGM_DIAG_PCIE" and nvlink.recommended_action is Action.REBOOT
    assert nvlink.evidence["error_ids"] == [99]
    assert by_gpu[f"gpu:{bdfs[7]}"].recommended_action is Action.REBOOT  # triage
    config = by_gpu[f"gpu:{bdfs[6]}"]
    assert config.code == "DCGM_DIAG_SOFTWARE" and config.recommended_action is Action.WATCH
    assert config.severity is Severity.WARNING
    warned = by_gpu[f"gpu:{bdfs[1]}"]  # monitor, a Warn only
    assert warned.recommended_action is Action.WATCH and warned.evidence["status"] == WARN
    assert result.metrics["failed"] == 4 and result.metrics["warned"] == 1
    json.dumps(result.record())


def test_dcgm4_without_bus_ids_names_dcgm_ids():
    result = judge_diag(report_of("dcgm4_r2_isolate_synthetic.json"), EXIT_ISOLATE)
    assert result.status is Status.FAILED
    [finding] = result.findings
    assert finding.component == "gpu:dcgm-3" and finding.recommended_action is Action.REBOOT
    assert finding.evidence["error_ids"] == [80]


def test_runtime_error_is_an_error_even_with_exit_0():
    report = report_of("dcgm4_runtime_error_synthetic.json")
    assert report.runtime_error is not None and "No GPUs are supported" in report.runtime_error
    for code in (0, 253):
        result = judge_diag(report, code)
        assert result.status is Status.ERROR and not result.findings


def test_aborted_partial_json_is_not_a_report():
    with pytest.raises(ValueError):
        report_of("dcgm4_aborted_partial_synthetic.json")


@pytest.mark.parametrize("name", ["garbage_synthetic.txt", "conn_error.txt"])
def test_garbage_raises(name):
    with pytest.raises(ValueError, match="not a dcgmi diag report"):
        report_of(name)


def test_unexpected_exit_code_is_an_error():
    report = report_of("dcgm4_r2_pass_synthetic.json")
    for code in (1, 253, -15, 137):
        assert judge_diag(report, code).status is Status.ERROR


def test_failure_exit_without_failed_test_is_an_error():
    report = report_of("dcgm4_r2_pass_synthetic.json")
    assert judge_diag(report, EXIT_TEST_FAILED).status is Status.ERROR
    assert judge_diag(report, EXIT_ISOLATE).status is Status.ERROR


def test_nothing_ran_is_an_error():
    doc = {"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": "memory", "results": [
        {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Skip"},
        {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Not Run"}],
        "test_summary": {"status": "Skip"}}]}]}, "metadata": {"version": "4.2.3"}}
    report = parse_diag(json.dumps(doc))
    assert {r.status for r in report.results} == {SKIP, "NOT_RUN"}
    assert judge_diag(report, 0).status is Status.ERROR


def test_test_summary_failure_without_entity_failure_is_a_node_finding():
    doc = {"DCGM Diagnostic": {"test_categories": [{"category": "Integration", "tests": [{"name": "pcie", "results": [
        {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"}],
        "test_summary": {"status": "Fail"}}]}]}}
    result = judge_diag(parse_diag(json.dumps(doc)), EXIT_TEST_FAILED)
    assert result.status is Status.FAILED
    assert [(f.component, f.code) for f in result.findings] == [("node", "DCGM_DIAG_PCIE")]


# -- DCGM 3 JSON --------------------------------------------------------------------------------------------------

def test_dcgm3_real_document_from_dcgm_unit_test():
    report = report_of("dcgm3_r1_pass_dcgm_unittest.json")
    assert report.format == "dcgm3" and report.version == "3.1.0"
    assert len(report.results) == 9 + 8  # nulls between tests skipped
    assert report.results[0].test == "Denylist" and report.results[0].entity_ids == tuple(range(8))
    assert report.results[-1].test == "software" and report.results[-1].entity_ids == (7,)  # integer gpu_ids
    assert judge_diag(report, 0).status is Status.PASSED


def test_dcgm3_memory_failure(bdfs):
    report = report_of("dcgm3_r2_memory_fail_synthetic.json")
    assert report.version == "3.3.5"
    [failure] = report.failures
    assert failure.entity_ids == (2,) and failure.warnings[0].error_id == 52
    assert failure.warnings[0].severity is None
    result = judge_diag(report, EXIT_TEST_FAILED, bdfs)
    assert result.status is Status.FAILED
    [finding] = result.findings
    assert finding.component == f"gpu:{bdfs[2]}" and finding.code == "DCGM_DIAG_GPU_MEMORY"
    assert finding.recommended_action is None  # no severity given: the catalog decides
    assert finding.severity is Severity.ERROR


def test_dcgm3_plain_string_warnings_and_multi_gpu_results():
    doc = {"DCGM GPU Diagnostic": {"test_categories": [{"category": "Deployment", "tests": [
        {"name": "Page Retirement/Row Remap", "results": [{
            "gpu_ids": "0,1,2,3", "status": "FAIL",
            "warnings": ["GPU 3 had memory errors and row remappings are pending"]}]}]}],
        "version": "3.3.5"}}
    result = judge_diag(parse_diag(json.dumps(doc)), EXIT_TEST_FAILED)
    [finding] = result.findings
    assert finding.component == "gpu:dcgm-3" and finding.code == "DCGM_DIAG_PAGE_RETIREMENT_ROW_REMAP"


# -- the text table (real captures) -------------------------------------------------------------------------------

def test_table_dcgm330_pcie_fail_all():
    report = report_of("table_r2_dcgm330_pcie_fail.txt")
    assert report.format == "table" and report.version == "3.3.0" and report.driver_version == "530.30.02"
    assert not report.truncated
    statuses = {r.test: r.status for r in report.results}
    assert statuses["Denylist"] == PASS and statuses["PCIe"] == FAIL and statuses["GPU Memory"] == SKIP
    [pcie] = report.failures
    assert pcie.entity_ids == tuple(range(8))  # "Fail - All" over 8 device ids
    assert pcie.warnings[0].message.startswith("GPU 0 Error using CUDA API cudaDeviceGetByPCIBusId Check DCGM")
    assert "bus ID = 00000000:1B:00.0" in pcie.warnings[0].message
    result = judge_diag(report, EXIT_TEST_FAILED)
    assert result.status is Status.FAILED
    assert [(f.component, f.code) for f in result.findings] == [("gpu:dcgm-0", "DCGM_DIAG_PCIE")]


def test_table_rowremap_and_thermal_excerpt():
    report = report_of("table_rowremap_thermal_excerpt.txt")
    assert report.truncated
    failures = report.failures
    assert failures[0].warnings[0].message == "GPU 3 has uncorrectable memory errors and row remappings are pending"
    memory = failures[1]
    assert memory.test == "GPU Memory" and memory.entity_ids == (0,)
    assert memory.warnings[0].message.startswith("GPU 0 Thermal violations totaling 13.3 seconds started at 9.7")
    passed = [r.entity_ids for r in report.results if r.test == "GPU Memory" and r.status == PASS]
    assert passed == [(1, 2, 3, 4, 5, 6, 7)]
    result = judge_diag(report, EXIT_TEST_FAILED)
    assert result.status is Status.FAILED
    assert {f.component for f in result.findings} == {"gpu:dcgm-3", "gpu:dcgm-0"}


def test_table_dcgm423_per_gpu_rows_excerpt():
    report = report_of("table_dcgm423_excerpt.txt")
    assert report.version == "4.2.3" and report.truncated
    software = [r for r in report.results if r.test == "software"]
    assert [r.entity_ids for r in software] == [(0,), (1,), (2,), (3,)]
    assert all(r.status == PASS for r in software)
    # An excerpt without failures has no verdict on the rest of the table.
    assert judge_diag(report, 0).status is Status.ERROR


def test_table_dcgm335_k8s_prefix_excerpt():
    report = report_of("table_dcgm335_k8s_excerpt.txt")
    assert report.version == "3.3.5" and report.driver_version == "550.54.15"
    assert [r.test for r in report.results] == ["Denylist", "NVML Library", "CUDA Main Library",
                                                 "Permissions and OS Blocks"]
    assert judge_diag(report, 0).status is Status.ERROR


# -- the runner ---------------------------------------------------------------------------------------------------

def test_diag_command():
    assert diag_command() == ["dcgmi", "diag", "-r", "2", "-j"]
    assert diag_command(4, 18) == ["dcgmi", "diag", "-r", "4", "-j", "-p", "pcie.gpu_nvlinks_expected_up=18"]
    assert diag_command(1, 18) == ["dcgmi", "diag", "-r", "1", "-j"]  # level 1 runs no pcie test


def test_run_diag_pass(fake):
    fake("dcgm4_r2_pass_synthetic.json")
    result = run_diag(level=2, expected_nvlinks=18, binary=FAKE, timeout_s=30)
    assert result.status is Status.PASSED, result.summary
    assert fake.calls() == [["diag", "-r", "2", "-j", "-p", "pcie.gpu_nvlinks_expected_up=18"]]
    assert result.evidence["returncode"] == 0 and result.evidence["level"] == 2


def test_run_diag_failures(fake, bdfs):
    fake("dcgm4_r2_fail_synthetic.json")
    result = run_diag(binary=FAKE, timeout_s=30, gpus=bdfs)
    assert result.status is Status.FAILED and result.evidence["returncode"] == EXIT_ISOLATE
    assert f"gpu:{bdfs[3]}" in {f.component for f in result.findings}


def test_run_diag_dcgm3_exit_226(fake):
    fake("dcgm3_r2_memory_fail_synthetic.json")
    result = run_diag(binary=FAKE, timeout_s=30)
    assert result.status is Status.FAILED and result.evidence["returncode"] == EXIT_TEST_FAILED


@pytest.mark.parametrize("name, returncode", [("dcgm4_aborted_partial_synthetic.json", -15),
                                              ("dcgm4_runtime_error_synthetic.json", 253),
                                              ("conn_error.txt", 235),
                                              ("garbage_synthetic.txt", 0)])
def test_run_diag_errors(fake, name, returncode):
    fake(name)
    result = run_diag(binary=FAKE, timeout_s=30)
    assert result.status is Status.ERROR, result.summary
    assert result.evidence["returncode"] == returncode and not result.findings


def test_run_diag_timeout_is_an_error(fake, monkeypatch):
    fake("dcgm4_r2_pass_synthetic.json")
    monkeypatch.setenv("DCGMI_DIAG_FAKE_SLEEP", "5")
    result = run_diag(binary=FAKE, timeout_s=0.5)
    assert result.status is Status.ERROR and "timed out" in result.summary


def test_run_diag_missing_binary_is_skipped(tmp_path):
    assert run_diag(binary=str(tmp_path / "dcgmi"), timeout_s=5).status is Status.SKIPPED
    assert run_diag(binary="nodemedic-no-such-dcgmi", timeout_s=5).status is Status.SKIPPED
