"""stress-ng deep checks: the parser against real captures, real short runs, and failure paths that leave nothing."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import psutil
import pytest

from nodemedic.checks.active.base import Status
from nodemedic.checks.active.stress import build_args, parse_stress_output, run_stress, stress_warnings

from fakes.processes import existing_children, new_children as no_children  # noqa: F401 (autouse fixture)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "stress_ng"
HAVE_STRESS_NG = shutil.which("stress-ng") is not None
needs_stress_ng = pytest.mark.skipif(not HAVE_STRESS_NG, reason="stress-ng not installed")


def sample(name: str) -> str:
    return (FIXTURES / name).read_text()


def fake_tool(tmp_path: Path, body: str) -> str:
    path = tmp_path / "stress-ng"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# -- parser on real captures ------------------------------------------------------------------------------------

def test_vm_bit_errors_fail():
    status, findings, metrics = parse_stress_output(sample("stress_ng_01_verify_vm_bit_errors_fail.txt"), 2,
                                                    "memory")
    assert status is Status.FAILED
    [f] = findings
    assert (f.code, f.component, f.check) == ("STRESS_MEMORY_FAILED", "memory", "stress.memory")
    assert f.evidence["errors_detected"] == 5
    assert f.evidence["failed_stressors"] == 1
    assert "vm: detected 5 bit errors while stressing memory" in f.evidence["fail_lines"]
    assert "5 failures reached" in f.message and "unsuccessful run completed" in f.message
    assert metrics["stressors"] == {}


def test_vm_bit_errors_fail_even_with_exit_zero_and_kind_inferred():
    status, [f], _ = parse_stress_output(sample("stress_ng_01_verify_vm_bit_errors_fail.txt"), 0)
    assert status is Status.FAILED and f.code == "STRESS_MEMORY_FAILED"  # "dispatching hogs: 1 vm"


def test_zero_bogo_ops_is_a_warning_not_a_fault():
    text = sample("stress_ng_03_metrics_check_zero_bogo_warn_fpunch.txt")
    status, findings, metrics = parse_stress_output(text, 0, "disk", "/scratch")
    assert status is Status.PASSED and findings == []
    assert metrics["stressors"]["fpunch"] == {"bogo_ops": 0, "real_time_s": 557.92, "usr_time_s": 0.40,
                                              "sys_time_s": 19.56, "bogo_ops_per_s_real": 0.0,
                                              "bogo_ops_per_s_cpu": 0.0}
    assert metrics["misc"] == {"fpunch": {"extents per file": 2049.12}}
    assert stress_warnings(text) == ["metrics-check: all bogo-op counters are zero, data may be incorrect"]


def test_old_info_prefixed_table():
    status, findings, metrics = parse_stress_output(sample("stress_ng_05_metrics_brief_old_info_prefix_2020.txt"),
                                                    0, "cpu")
    assert status is Status.PASSED and findings == []
    assert metrics["stressors"]["cpu"] == {"bogo_ops": 87526, "real_time_s": 120.03, "usr_time_s": 478.67,
                                           "sys_time_s": 0.02, "bogo_ops_per_s_real": 729.23,
                                           "bogo_ops_per_s_cpu": 182.84}
    assert metrics["bogo_ops_per_s"] == 729.23


def test_wcs_verify_fail_lines_without_verdict():
    status, [f], _ = parse_stress_output(sample("stress_ng_07_wcs_verify_fail_0.15.06_excerpt.txt"), 0, "cpu")
    assert status is Status.FAILED and f.code == "STRESS_CPU_FAILED" and f.component == "cpu"
    assert len(f.evidence["fail_lines"]) == 8
    assert f.evidence["fail_lines"][0] == "(null): ((void *)0) == test_wcschr(str1, '_') did not return expected result"


def test_unsuccessful_run_disk_component():
    status, [f], _ = parse_stress_output(sample("stress_ng_09_unsuccessful_run_checkbox_excerpt.txt"), 2, "disk",
                                         "/mnt/scratch")
    assert status is Status.FAILED
    assert (f.code, f.component) == ("STRESS_DISK_FAILED", "disk:/mnt/scratch")
    assert "exit status 2" in f.message


@pytest.mark.parametrize("text, rc, expected", [
    ("", 0, Status.ERROR),                                   # nothing at all
    ("Segmentation fault\n<binary junk>\n", 0, Status.ERROR),  # garbage never passes
    ("stress-ng: info:  [1] successful run completed in 2.00s\n", 5, Status.FAILED),  # killed stressor
    ("stress-ng: error: [1] unrecognized option\n", 1, Status.ERROR),  # bad options: no verdict
    ("stress-ng: info:  [1] dispatching hogs: 1 hdd\n", 3, Status.ERROR),  # ENOSPC: no verdict
    ("stress-ng: info:  [1] successful run completed in 2.00s\n", -9, Status.ERROR),
])
def test_exit_statuses_and_garbage(text, rc, expected):
    assert parse_stress_output(text, rc, "cpu")[0] is expected


def test_build_args_bounds_memory_and_disk(tmp_path):
    cpu = build_args("cpu", 5)
    assert cpu == ["stress-ng", "--cpu", "0", "--cpu-method", "all", "--verify", "--metrics-brief", "--timeout", "5"]
    mem = build_args("memory", 5, memory_fraction=0.1)
    workers, per_worker = int(mem[mem.index("--vm") + 1]), int(mem[mem.index("--vm-bytes") + 1])
    assert workers * per_worker <= psutil.virtual_memory().available * 0.1 + (1 << 20) * workers
    assert "--page-in" in mem and "--verify" in mem
    disk = build_args("disk", 5, str(tmp_path))
    assert disk[disk.index("--temp-path") + 1] == str(tmp_path) and "--hdd" in disk and "--verify" in disk
    with pytest.raises(ValueError):
        build_args("disk", 5)
    with pytest.raises(ValueError):
        build_args("gpu", 5)


# -- real runs ----------------------------------------------------------------------------------------------------

@needs_stress_ng
@pytest.mark.parametrize("kind", ["cpu", "memory", "disk"])
def test_real_run(kind, tmp_path):
    result = run_stress(kind, 2, scratch_dir=str(tmp_path) if kind == "disk" else None, memory_fraction=0.05)
    assert result.status is Status.PASSED, result.evidence
    stressor = {"cpu": "cpu", "memory": "vm", "disk": "hdd"}[kind]
    row = result.metrics["stressors"][stressor]
    assert row["bogo_ops"] > 0 and row["bogo_ops_per_s_real"] > 0 and 1.5 < row["real_time_s"] < 10
    assert result.evidence["returncode"] == 0 and result.record()["status"] == "passed"
    if kind == "disk":
        assert list(tmp_path.iterdir()) == []  # stress-ng cleaned its temp files
    assert no_children() == []


def test_missing_binary_is_skipped(tmp_path):
    result = run_stress("cpu", 1, binary=str(tmp_path / "nope"))
    assert result.status is Status.SKIPPED and result.findings == []


def test_fake_failure_replay_exit_2(tmp_path):
    replay = FIXTURES / "stress_ng_01_verify_vm_bit_errors_fail.txt"
    binary = fake_tool(tmp_path, f"cat '{replay}' >&2\nexit 2\n")
    result = run_stress("memory", 1, binary=binary)
    assert result.status is Status.FAILED
    [f] = result.findings
    assert f.code == "STRESS_MEMORY_FAILED" and f.evidence["returncode"] == 2
    assert result.evidence["returncode"] == 2 and "unsuccessful run completed" in result.evidence["output_tail"]
    assert no_children() == []


def test_timeout_is_error_and_kills_the_whole_group(tmp_path):
    # A stress-ng that forks a stressor and hangs: both must be gone after the timeout.
    marker = tmp_path / "child.pid"
    binary = fake_tool(tmp_path, f"sleep 60 &\necho $! > '{marker}'\nsleep 60\n")
    started = time.monotonic()
    result = run_stress("cpu", 0.2, binary=binary, timeout_margin_s=1)
    assert time.monotonic() - started < 8
    assert result.status is Status.ERROR and "timed out" in result.summary and result.findings == []
    assert no_children() == []
    assert gone(int(marker.read_text()))


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Dead or a zombie: a SIGKILLed process under load shows as runnable until it gets a CPU to exit on."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_garbage_from_tool_is_error(tmp_path):
    binary = fake_tool(tmp_path, "echo 'Illegal instruction (core dumped)'\nexit 0\n")
    result = run_stress("cpu", 1, binary=binary)
    assert result.status is Status.ERROR and result.findings == []
    assert os.path.exists(binary)


def test_zero_bogo_ops_of_our_own_run_is_no_verdict(tmp_path):
    # 0.15.06 prints no metrics-check line; the runner notes the empty run itself: not a fault, and not a pass.
    table = ("stress-ng: info:  [9] dispatching hogs: 2 vm\n"
             "stress-ng: metrc: [9] stressor       bogo ops real time  usr time  sys time   bogo ops/s     bogo ops/s\n"
             "stress-ng: metrc: [9]                           (secs)    (secs)    (secs)   (real time) (usr+sys time)\n"
             "stress-ng: metrc: [9] vm                    0      2.79      0.82      2.86         0.00           0.00\n"
             "stress-ng: info:  [9] successful run completed in 2.80s\n")
    (tmp_path / "out.txt").write_text(table)
    binary = fake_tool(tmp_path, f"cat '{tmp_path / 'out.txt'}' >&2\n")
    result = run_stress("memory", 1, binary=binary)
    assert result.status is Status.ERROR and result.findings == []
    assert "verified nothing" in result.summary
    assert result.evidence["warnings"] == ["zero bogo ops from vm: nothing was verified (run too short?)"]


def test_memory_test_is_sized_to_the_cgroup_limit_not_the_host(tmp_path):
    from nodemedic.checks.active.stress import available_memory

    (tmp_path / "proc").write_text("0::/system.slice/nodemedic.service\n")
    group = tmp_path / "cg" / "system.slice" / "nodemedic.service"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(f"{256 << 20}\n")
    (group / "memory.current").write_text(f"{56 << 20}\n")
    assert available_memory(str(tmp_path / "cg"), str(tmp_path / "proc")) == 200 << 20
    (group / "memory.max").write_text("max\n")
    host = available_memory(str(tmp_path / "cg"), str(tmp_path / "proc"))
    assert host > 200 << 20  # no limit: the host's available memory
    assert available_memory(str(tmp_path / "nowhere"), str(tmp_path / "proc")) > 0
