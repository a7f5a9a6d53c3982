"""The deep-check runner: plans per level, limits and cancellation that leave no process, the run's status, its log."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nodemedic.checks.active import counts
from nodemedic.checks.active.base import DeepCheckResult, Status
from nodemedic.checks.base import NodeContext
from nodemedic.checks.platform.profiles import profile_for
from nodemedic.checks.tools import ToolNotFound, run_tool
from nodemedic.config import load_config
from nodemedic.diag import DeepTest, DiagRun, build_plan, result_command, result_findings, run_plan, run_test, select
from nodemedic.model import DEEP_ERROR, DEEP_FAILED, DEEP_PASSED, Finding, Severity
from nodemedic.telemetry.deep_log import DeepCheckLog, read_records

from fakes.nvml import FakeNvml, default_gpus
from fakes.processes import new_children

P5 = NodeContext("n1", "p5.48xlarge", profile_for("p5.48xlarge"))


def config(**overrides):
    return load_config(env={}, path="/dev/null", overrides={"imds.enabled": False, **overrides})


def sleeper(name: str, seconds: float = 60, timeout: float = 120) -> DeepTest:
    """A test whose tool runs long: `sleep` in its own process group, as every deep-check tool runs."""
    def run() -> DeepCheckResult:
        out = run_tool(["sleep", str(seconds)], timeout)
        return DeepCheckResult(name, Status.PASSED, f"slept, exit {out.returncode}")
    return DeepTest(name, run, timeout)


def fixed(name: str, status: Status, findings: list[Finding] | None = None) -> DeepTest:
    return DeepTest(name, lambda: DeepCheckResult(name, status, str(status), findings or []), 10)


def gone(timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not new_children():
            return True
        time.sleep(0.05)
    return False


# -- the plan -------------------------------------------------------------------------------------------------------

def test_level_2_plan_in_order_with_profile_expectations():
    tests = build_plan(config(), P5, 2)
    assert [t.name for t in tests] == ["gpu.count", "efa.count", "dcgm.diag", "nccl.all_reduce", "efa.pingpong",
                                       "stress.cpu", "stress.memory", "stress.disk"]
    assert {t.name: t.timeout_s for t in tests}["dcgm.diag"] == 900


def test_level_4_runs_dcgm_r4_with_expected_nvlinks_and_longer_limits(tmp_path, monkeypatch):
    log = tmp_path / "calls.log"
    monkeypatch.setenv("DCGMI_DIAG_FAKE_LOG", str(log))
    binary = str(__import__("conftest").REPO / "tests/fakes/bin/dcgmi-diag")
    tests = {t.name: t for t in build_plan(config(**{"deep_checks.dcgm.binary": binary}), P5, 4)}
    assert tests["dcgm.diag"].timeout_s == 4 * 3600
    assert tests["stress.cpu"].timeout_s == 600 + 60
    result = tests["dcgm.diag"].run()
    assert result.status is Status.PASSED
    assert json.loads(log.read_text().splitlines()[0]) == ["diag", "-r", "4", "-j", "-p",
                                                          "pcie.gpu_nvlinks_expected_up=18"]


def test_disabled_tests_are_not_planned_and_efa_count_needs_the_efa_provider():
    cfg = config(**{"deep_checks.dcgm.enabled": False, "deep_checks.stress.kinds": ["cpu"],
                    "deep_checks.efa.provider": "tcp"})
    assert [t.name for t in build_plan(cfg, P5, 2)] == ["gpu.count", "nccl.all_reduce", "efa.pingpong",
                                                        "stress.cpu"]


def test_only_selects_by_name_or_family_and_rejects_unknown_names():
    tests = build_plan(config(), P5, 2)
    assert [t.name for t in select(tests, ["stress"])] == ["stress.cpu", "stress.memory", "stress.disk"]
    assert [t.name for t in select(tests, ["dcgm.diag", "stress.cpu"])] == ["dcgm.diag", "stress.cpu"]
    assert select(tests, None) == tests
    with pytest.raises(ValueError, match="unknown deep check.*bogus.*known:"):
        select(tests, ["bogus"])
    with pytest.raises(ValueError):
        build_plan(config(), P5, 3)


# -- running one test -----------------------------------------------------------------------------------------------

def test_a_test_past_its_limit_is_error_and_its_tool_is_killed():
    test = sleeper("slow", seconds=60, timeout=0.5)
    test.timeout_s = 0.2  # the runner's limit bites before the tool's own
    started = time.monotonic()
    result = run_test(test, threading.Event(), backstop_s=0.3)
    assert result.status is Status.ERROR and "timed out" in result.summary
    assert time.monotonic() - started < 10
    assert gone(), new_children()


def test_a_tools_own_timeout_is_error_never_pass():
    result = run_test(sleeper("slow", seconds=60, timeout=0.3), threading.Event())
    assert result.status is Status.ERROR and "timed out" in result.summary
    assert gone(), new_children()


def test_a_crash_is_error_and_a_missing_tool_skipped():
    def boom() -> DeepCheckResult:
        raise RuntimeError("parser bug")

    def missing() -> DeepCheckResult:
        raise ToolNotFound("neuron-ls not found")

    crashed = run_test(DeepTest("boom", boom, 5), threading.Event())
    assert crashed.status is Status.ERROR and "RuntimeError: parser bug" in crashed.summary
    assert run_test(DeepTest("missing", missing, 5), threading.Event()).status is Status.SKIPPED


# -- a run ----------------------------------------------------------------------------------------------------------

def test_cancel_kills_the_running_tool_and_skips_the_rest(tmp_path):
    cancel = threading.Event()
    deep_log = DeepCheckLog(tmp_path / "deep.log", "n1")
    run = DiagRun("r1", 2, "test", time.time())
    threading.Timer(0.5, cancel.set).start()
    started = time.monotonic()
    run_plan([fixed("first", Status.PASSED), sleeper("long"), sleeper("never")], run, cancel, deep_log)
    assert time.monotonic() - started < 10
    assert [str(r.status) for r in run.results] == ["passed", "error", "skipped"]
    assert "cancelled" in run.results[1].summary and run.cancelled
    assert run.status == DEEP_ERROR
    assert gone(), new_children()
    events = [r["event"] for r in read_records(tmp_path / "deep.log")]
    assert events == ["DeepHealthCheckStarted"] + ["DeepHealthCheckResult"] * 3 + ["DeepHealthCheckCompleted"]


@pytest.mark.parametrize("statuses, expected", [
    ([Status.PASSED, Status.SKIPPED], DEEP_PASSED),
    ([Status.PASSED, Status.FAILED, Status.ERROR], DEEP_FAILED),
    ([Status.PASSED, Status.ERROR], DEEP_ERROR),
    ([Status.SKIPPED, Status.SKIPPED], DEEP_ERROR),  # nothing ran: not a pass
    ([], DEEP_ERROR),
])
def test_run_status(statuses, expected):
    run = DiagRun("r", 2, "t", 0, results=[DeepCheckResult(f"t{i}", s, "") for i, s in enumerate(statuses)])
    assert run.status == expected


def test_what_each_outcome_tells_the_policy():
    bad = Finding("stress.cpu", "cpu", "STRESS_CPU_FAILED", "x", Severity.ERROR)
    failed = result_findings(DeepCheckResult("stress.cpu", Status.FAILED, "x", [bad]))
    assert failed == [bad]
    error = result_findings(DeepCheckResult("dcgm.diag", Status.ERROR, "aborted"))
    assert [(f.code, f.healthy, f.check) for f in error] == [("CHECK_FAILED", False, "dcgm.diag")]
    passed = result_findings(DeepCheckResult("dcgm.diag", Status.PASSED, "ok"))
    assert [(f.code, f.healthy) for f in passed] == [("CHECK_FAILED", True)]
    assert result_findings(DeepCheckResult("neuron.ls", Status.SKIPPED, "absent")) == []
    cmd = json.loads(json.dumps(result_command(DeepCheckResult("stress.cpu", Status.FAILED, "x", [bad]), "r1")))
    assert Finding.from_dict(cmd["findings"][0]) == bad and cmd["passed"] is None


# -- the log --------------------------------------------------------------------------------------------------------

def test_log_rotates_and_keeps_whole_json_lines(tmp_path):
    path = tmp_path / "logs" / "deep.log"
    deep_log = DeepCheckLog(path, "n1", "p5.48xlarge", max_bytes=4096, backups=2)
    for i in range(200):
        deep_log.write("DeepHealthCheckResult", {"run_id": "r", "i": i, "pad": "x" * 100}, 1_700_000_000 + i)
    deep_log.close()
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["deep.log", "deep.log.1", "deep.log.2"]
    records = read_records(path)
    assert records and all(r["node"] == "n1" and r["instance_type"] == "p5.48xlarge" for r in records)
    assert records[-1]["i"] == 199 and records[-1]["time"].startswith("2023-11-")
    assert all(p.stat().st_size <= 4096 for p in path.parent.iterdir())


def test_unwritable_log_path_falls_back_and_never_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    deep_log = DeepCheckLog(blocker / "sub" / "deep.log", "n1", fallback=tmp_path / "state" / "deep.log")
    deep_log.write("DeepHealthCheckStarted", {}, 0)
    assert deep_log.path == tmp_path / "state" / "deep.log" and read_records(deep_log.path)
    nowhere = DeepCheckLog(blocker / "a.log", "n1")
    nowhere.write("DeepHealthCheckStarted", {}, 0)  # nothing to write to: said once, no exception
    assert nowhere.path is None


# -- counts ---------------------------------------------------------------------------------------------------------

def test_gpu_counts_pass_fail_and_skip():
    ok = counts.run_gpu_counts(8, 18, nvml=FakeNvml())
    assert ok.status is Status.PASSED and ok.metrics["gpus"] == 8
    short = counts.run_gpu_counts(8, 18, nvml=FakeNvml(default_gpus(7)))
    assert short.status is Status.FAILED
    assert [(f.check, f.code) for f in short.findings] == [("gpu.count", "GPU_COUNT_MISMATCH")]
    gpus = default_gpus(8)
    gpus[3].nvlinks = [1] * 16 + [0, 0]
    links = counts.run_gpu_counts(8, 18, nvml=FakeNvml(gpus))
    assert links.status is Status.FAILED and [f.code for f in links.findings] == ["NVLINK_DOWN"]
    assert links.findings[0].component.startswith("gpu:")


def test_gpu_counts_without_nvml():
    broken = FakeNvml()
    broken.init_error = __import__("fakes.nvml", fromlist=["x"]).NVMLError_DriverNotLoaded
    assert counts.run_gpu_counts(None, None, nvml=broken).status is Status.SKIPPED
    assert counts.run_gpu_counts(8, 18, nvml=broken).status is Status.ERROR  # the passive check reports the fault


def test_efa_count_with_real_fi_info():
    if not __import__("shutil").which("fi_info"):
        pytest.skip("fi_info (libfabric-bin) not installed")
    found = counts.run_efa_count(None, provider="tcp")
    assert found.status is Status.PASSED and found.metrics["devices"] >= 1
    short = counts.run_efa_count(found.metrics["devices"] + 4, provider="tcp")
    assert short.status is Status.FAILED and short.findings[0].code == "EFA_COUNT_MISMATCH"
    none = counts.run_efa_count(None, provider="efa")  # no EFA here: fi_info says ENODATA
    assert none.status is Status.SKIPPED


def test_neuron_tests_are_planned_on_trainium_and_run_through_the_fakes(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert not [t for t in build_plan(config(), P5, 2) if t.name.startswith("neuron.")]
    fakes = str(__import__("conftest").REPO / "tests" / "fakes" / "bin")
    monkeypatch.setenv("PATH", f"{fakes}:{__import__('os').environ['PATH']}")
    trn2 = NodeContext("t1", "trn2.48xlarge", profile_for("trn2.48xlarge"))
    tests = {t.name: t for t in build_plan(config(), trn2, 2)}
    assert {"neuron.device_count", "neuron.hw_check", "neuron.nccom"} <= set(tests)
    assert tests["neuron.device_count"].run().status is Status.PASSED  # the fake lists 16 devices
    monkeypatch.setenv("NEURON_LS_FAKE_OUTPUT", "ls_trn2_15dev_missing7_synthetic.json")
    short = tests["neuron.device_count"].run()
    assert short.status is Status.FAILED and short.findings[0].code == "NEURON_DEVICE_COUNT_LOW"


def test_without_a_profile_the_all_reduce_uses_the_gpus_nvml_sees(monkeypatch):
    from nodemedic import diag
    from nodemedic.checks.active import torch_allreduce

    calls = []
    monkeypatch.setattr("nodemedic.checks.nvidia.nvml.load_pynvml", lambda: FakeNvml(default_gpus(4)))
    monkeypatch.setattr(torch_allreduce, "run_torch_allreduce", lambda nproc, *a, **kw: calls.append(nproc))
    monkeypatch.setattr(torch_allreduce, "torch_available", lambda: True)
    bare = NodeContext("n1")
    assert diag.visible_gpus() == 4
    cfg = config(**{"deep_checks.nccl.binary": "/nonexistent/all_reduce_perf"})
    next(t for t in build_plan(cfg, bare, 2) if t.name == "nccl.all_reduce").run()
    monkeypatch.setattr("nodemedic.checks.nvidia.nvml.load_pynvml", lambda: (_ for _ in ()).throw(ImportError()))
    next(t for t in build_plan(cfg, bare, 2) if t.name == "nccl.all_reduce").run()
    assert calls == [4, 2]  # four GPUs; no NVML: two gloo ranks on CPU
