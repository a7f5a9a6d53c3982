"""Neuron deep checks: parsers on every recorded output, the run functions through fakes replaying them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from nodemedic.checks.active.base import Status
from nodemedic.checks.active.neuron import (
    DEFAULT_ROOT_COMM_PORT,
    DEVICE_COUNT_LOW,
    HW_CHECK_FAILED,
    NCCOM_BUSBW_LOW,
    NCCOM_WRONG_RESULTS,
    NeuronDevice,
    judge_nccom,
    nccom_command,
    parse_nccom,
    parse_neuron_ls,
    run_hw_check,
    run_nccom,
    run_neuron_ls_count,
)
from nodemedic.catalog import load_catalog
from nodemedic.model import Action, Severity

from fakes.processes import assert_nothing_left, cancelled_after, process_tag  # noqa: F401 (a fixture)
from fakes.replay import replay

FIXTURES = Path(__file__).parent.parent / "fixtures" / "neuron"
FAKE_BIN = Path(__file__).parent.parent / "fakes" / "bin"
GIB = 1024 ** 3


def text(name: str) -> str:
    return (FIXTURES / name).read_text(errors="replace")


def listing(name: str):
    return parse_neuron_ls(text(name))


def nccom(name: str):
    return parse_nccom(text(name))


def trn2_devices(indexes) -> list[NeuronDevice]:
    """Some of the 16 trn2 devices, to keep the per-device runs few."""
    devices = listing("ls_trn2_16dev_synthetic.json").devices  # type: ignore[union-attr]
    return [devices[i] for i in indexes]


@pytest.fixture(autouse=True)
def tag(process_tag, monkeypatch) -> str:
    """Every process a test starts carries the tag (fakes.processes), so leftovers are found wherever they went."""
    monkeypatch.delenv("NEURON_RT_ROOT_COMM_ID", raising=False)
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    return process_tag


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKE_BIN}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.fixture
def ls(monkeypatch, tmp_path, on_path):
    (tmp_path / "ls").mkdir()
    return replay(monkeypatch, tmp_path / "ls", "NEURON_LS_FAKE")


@pytest.fixture
def nc(monkeypatch, tmp_path, on_path):
    (tmp_path / "nc").mkdir()
    use = replay(monkeypatch, tmp_path / "nc", "NCCOM_TEST_FAKE")
    env_log = tmp_path / "nc" / "env.log"
    monkeypatch.setenv("NCCOM_TEST_FAKE_ENV_LOG", str(env_log))
    use.envs = lambda: [json.loads(line) for line in env_log.read_text().splitlines()]  # type: ignore[attr-defined]
    return use


# -- neuron-ls: parser on every listing ---------------------------------------------------------------------------

def test_trn2_doc_table():
    ls_ = listing("ls_trn2_16dev_doc_text.txt")
    assert ls_ is not None and ls_.format == "table" and ls_.count == 16
    first, last = ls_.devices[0], ls_.devices[-1]
    assert (first.index, first.cores, first.logical_cores, first.memory_bytes) == (0, 8, 4, 96 * GIB)
    assert first.connected_to == (12, 3, 4, 1) and first.bdf == "cc:00.0"
    # The table gives a core count only: the runtime's (logical) cores are numbered device by device.
    assert first.core_ids == (0, 1, 2, 3) and last.core_ids == (60, 61, 62, 63) and first.runtime_cores == 4
    assert last.index == 15 and last.bdf == "f7:00.0"


def test_trn2_newer_table_with_process_continuation_row():
    ls_ = listing("ls_trn2_48xl_1dev_newformat_text.txt")
    assert ls_ is not None and ls_.count == 1  # the second PID's row is no device
    assert (ls_.instance_type, ls_.instance_id) == ("trn2.48xlarge", "i-0dcf246b9a7d5f066")
    dev = ls_.devices[0]
    assert (dev.cores, dev.core_ids, dev.bdf, dev.connected_to) == (4, (0, 1, 2, 3), "0000:e1:00.0", (12, 1, 9, 14))


def test_table_and_json_of_the_same_device_agree():
    table, js = listing("ls_trn2_48xl_1dev_newformat_text.txt"), listing("ls_trn2_48xl_1dev.json")
    assert table is not None and js is not None and js.format == "json"
    assert table.devices == js.devices
    assert js.instance_type == "trn2.48xlarge"


def test_trn1_2xl_json_old_shape():
    ls_ = listing("ls_trn1_2xl.json")
    assert ls_ is not None and ls_.format == "json" and ls_.count == 1 and ls_.instance_type is None
    dev = ls_.devices[0]
    assert (dev.cores, dev.core_ids, dev.memory_bytes, dev.connected_to) == (2, (0, 1), 32 * GIB, ())


def test_trn1_32xl_topology_table_ignores_the_torus_art():
    ls_ = listing("ls_trn1_32xl_topology_doc_text.txt")
    assert ls_ is not None and ls_.count == 16 and ls_.instance_type == "trn1.32xlarge"
    assert [d.index for d in ls_.devices] == list(range(16))
    assert ls_.devices[5].core_ids == (10, 11) and ls_.devices[5].memory_bytes == 32 * GIB
    assert ls_.devices[15].connected_to == (11, 14, 3, 12)


@pytest.mark.parametrize("name", ["ls_trn2_15dev_missing7_synthetic_text.txt", "ls_trn2_15dev_missing7_synthetic.json"])
def test_missing_device(name):
    ls_ = listing(name)
    assert ls_ is not None and ls_.count == 15 and 7 not in [d.index for d in ls_.devices]


def test_synthetic_json_matches_the_doc_table_it_was_built_from():
    js, table = listing("ls_trn2_16dev_synthetic.json"), listing("ls_trn2_16dev_doc_text.txt")
    assert js is not None and table is not None
    assert [(d.index, d.connected_to, d.core_ids) for d in js.devices] == \
        [(d.index, d.connected_to, d.core_ids) for d in table.devices]


@pytest.mark.parametrize("name", ["ls_garbage_synthetic.txt", "ls_trn2_cut_short_synthetic.json"])
def test_garbage_and_cut_short_listings_are_unparseable(name):
    assert listing(name) is None


@pytest.mark.parametrize("raw, count", [("[]", 0), ("$ neuron-ls --json-output\n[{\"neuron_device\": 3}]", 1),
                                        ('{"neuron_devices": [{"neuron_device": 0}]}', 1),
                                        ('WARNING: something\n[{"neuron_device": 0, "command": "x +--- y"}]', 1)])
def test_json_edge_shapes(raw, count):
    ls_ = parse_neuron_ls(raw)
    assert ls_ is not None and ls_.count == count


@pytest.mark.parametrize("raw", ["", "[{\"bdf\": \"00:1e.0\"}]", "[1, 2]", "null", "neuron-ls: command failed"])
def test_not_a_listing(raw):
    assert parse_neuron_ls(raw) is None


# -- nccom-test: parser on every capture --------------------------------------------------------------------------

@pytest.mark.parametrize("name, rows, avg, max_bw, largest", [
    ("nccom_r2_allr_fp32_doc.txt", 11, 23.6671, 52.83, 1073741824),
    ("nccom_r32_allg_check_doc.txt", 4, 0.7731, 2.64, 524288),
    ("nccom_2node_r64_allr_doc.txt", 28, 9.3924, 47.09, 1073741824),
    ("nccom_r16_allr_show_algorithm_doc.txt", 8, 16.6181, 103.89, 536870912),
    ("nccom_r8_allg_stats_doc.txt", 4, 9.1966, 30.92, 524288),
    ("nccom_r32_allg_io_size_doc.txt", 4, 7.7715, 21.93, 524288),
    ("nccom_r2_allr_spinner_synthetic.txt", 1, 40.6901, 40.69, 33554432),
])
def test_complete_runs(name, rows, avg, max_bw, largest):
    run = nccom(name)
    assert (len(run.rows), run.avg_busbw, run.max_busbw) == (rows, avg, max_bw)
    assert run.largest is not None and run.largest.size == largest
    assert run.complete and not run.failures and not run.wrong and run.errors_found is None


def test_columns_are_read_by_header_name():
    first = nccom("nccom_r2_allr_fp32_doc.txt").rows[0]
    assert (first.size, first.count, first.type, first.time_us, first.algbw, first.busbw) == \
        (1024, 256, "fp32", 58.0, 0.02, 0.02)
    algo = nccom("nccom_r16_allr_show_algorithm_doc.txt").rows
    assert [r.algorithm for r in algo][-3:] == ["rdh", "kangaring", "kangaring"] and algo[-1].time_us == 9689.51
    stats = nccom("nccom_r8_allg_stats_doc.txt").rows[1]
    assert (stats.time_us, stats.algbw, stats.busbw) == (10.22, 0.80, 0.70)  # avg is the first time column
    io = nccom("nccom_r32_allg_io_size_doc.txt").rows[0]
    assert (io.size, io.count, io.type, io.busbw) == (1024, 256, "fp32", 0.16)


def test_bench_failure():
    run = nccom("nccom_bench_failure_doc.txt")
    assert not run.rows and run.errors_found == 1
    assert run.failures == ["33554432    Failure running neuron-bench - log file /tmp/nccom_test_log_7pqpdfjf.log"]


def test_driver_not_running():
    run = nccom("nccom_driver_not_running_doc.txt")
    assert not run.rows and run.failures[0].startswith("Neuron DKMS Driver is not running!")


def test_wrong_results_and_cut_short_and_garbage():
    wrong = nccom("nccom_r32_allg_check_wrong_synthetic.txt")
    assert len(wrong.rows) == 3 and wrong.wrong and "65536" in wrong.wrong[0] and wrong.errors_found == 1
    cut = nccom("nccom_2node_r64_cut_short_synthetic.txt")
    assert len(cut.rows) == 16 and cut.avg_busbw is None and not cut.complete
    garbage = nccom("nccom_garbage_synthetic.txt")
    assert not garbage.rows and garbage.avg_busbw is None


# -- nccom-test: the verdict --------------------------------------------------------------------------------------

def test_judge_pass_and_threshold_edges():
    run = nccom("nccom_r2_allr_fp32_doc.txt")
    ok = judge_nccom(run, 52.83, ranks=2)
    assert ok.status is Status.PASSED and not ok.findings and ok.metrics["largest_size_busbw_gbs"] == 52.83
    low = judge_nccom(run, 52.84, ranks=2)
    assert low.status is Status.FAILED
    [finding] = low.findings
    assert (finding.code, finding.component, finding.check, finding.severity) == \
        (NCCOM_BUSBW_LOW, "node", "neuron.nccom", Severity.ERROR)
    json.dumps(low.record())


def test_judge_largest_size_must_clear_the_threshold_too():
    run = nccom("nccom_r2_allr_low_busbw_synthetic.txt")
    assert run.max_busbw == 36.51 and run.largest is not None and run.largest.busbw == 12.10
    result = judge_nccom(run, 30.0)
    assert result.status is Status.FAILED and result.findings[0].code == NCCOM_BUSBW_LOW


def test_judge_without_threshold_is_not_judged():
    result = judge_nccom(nccom("nccom_2node_r64_allr_doc.txt"), None, ranks=64, nodes=2)
    assert result.status is Status.PASSED and "not judged" in result.summary
    assert (result.metrics["nodes"], result.metrics["ranks"]) == (2, 64)


def test_judge_wrong_results_is_a_failure_with_a_finding():
    result = judge_nccom(nccom("nccom_r32_allg_check_wrong_synthetic.txt"), 0.1)
    assert result.status is Status.FAILED
    [finding] = result.findings
    assert finding.code == NCCOM_WRONG_RESULTS and finding.severity is Severity.CRITICAL


@pytest.mark.parametrize("name", ["nccom_bench_failure_doc.txt", "nccom_driver_not_running_doc.txt",
                                  "nccom_2node_r64_cut_short_synthetic.txt", "nccom_garbage_synthetic.txt"])
def test_judge_runs_that_could_not_finish_are_errors_without_findings(name):
    result = judge_nccom(nccom(name), 1.0)
    assert result.status is Status.ERROR and not result.findings


# -- device count through the fake --------------------------------------------------------------------------------

def test_count_pass(ls):
    ls("ls_trn2_16dev_synthetic.json")
    result = run_neuron_ls_count(16, timeout_s=30)
    assert result.status is Status.PASSED and result.metrics["devices"] == 16 and result.metrics["cores"] == 64
    assert ls.calls() == [["--json-output"]]
    assert result.evidence["returncode"] == 0 and result.duration_s > 0


@pytest.mark.parametrize("name", ["ls_trn2_15dev_missing7_synthetic.json", "ls_trn2_15dev_missing7_synthetic_text.txt"])
def test_count_low(ls, name):
    ls(name)
    result = run_neuron_ls_count(16, timeout_s=30)
    assert result.status is Status.FAILED
    [finding] = result.findings
    assert (finding.code, finding.component, finding.check) == (DEVICE_COUNT_LOW, "node", "neuron.device_count")
    assert finding.severity is Severity.CRITICAL and finding.recommended_action is None  # the catalog names it
    assert load_catalog().get(DEVICE_COUNT_LOW).action is Action.REBOOT
    assert (finding.evidence["found"], finding.evidence["expected"], finding.evidence["missing"]) == (15, 16, [7])


def test_count_real_container_listing_against_the_trn2_profile(ls):
    from nodemedic.checks.platform.profiles import profile_for
    ls("ls_trn2_48xl_1dev.json")
    expected = profile_for("ml.trn2.48xlarge").neuron_devices  # type: ignore[union-attr]
    assert run_neuron_ls_count(expected, timeout_s=30).status is Status.FAILED


def test_count_without_expectation_is_not_judged(ls):
    ls("ls_trn1_2xl.json")
    result = run_neuron_ls_count(None, timeout_s=30)
    assert result.status is Status.PASSED and "not judged" in result.summary and not result.findings


@pytest.mark.parametrize("name, exit_code, returncode", [("ls_garbage_synthetic.txt", None, 0),
                                                          ("ls_trn2_cut_short_synthetic.json", None, -9),
                                                          ("ls_trn2_16dev_synthetic.json", "1", 1)])
def test_count_errors(ls, monkeypatch, name, exit_code, returncode):
    ls(name)
    if exit_code:
        monkeypatch.setenv("NEURON_LS_FAKE_EXIT", exit_code)
    result = run_neuron_ls_count(16, timeout_s=30)
    assert result.status is Status.ERROR and not result.findings
    assert result.evidence["returncode"] == returncode


def test_count_missing_tool_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = run_neuron_ls_count(16, timeout_s=5)
    assert result.status is Status.SKIPPED and not result.findings
    assert run_neuron_ls_count(16, binary=str(tmp_path / "neuron-ls")).status is Status.SKIPPED


def test_count_timeout_is_an_error_and_leaves_nothing(ls, monkeypatch, tag):
    ls("ls_trn2_16dev_synthetic.json")
    monkeypatch.setenv("NEURON_LS_FAKE_SLEEP", "30")
    started = time.monotonic()
    result = run_neuron_ls_count(16, timeout_s=0.5)
    assert result.status is Status.ERROR and "timed out" in result.summary
    assert time.monotonic() - started < 10
    assert_nothing_left(tag)


# -- nccom-test through the fake ----------------------------------------------------------------------------------

def test_nccom_command_forms():
    assert nccom_command(32, max_bytes="1G") == ["nccom-test", "-r", "32", "-b", "8", "-e", "1G", "-f", "2", "-d",
                                                 "fp32", "--check", "--non-interactive", "allr"]
    cluster = nccom_command(64, nodes=2, hosts=["10.0.0.1", "10.0.0.2"], check=False, non_interactive=False)
    assert cluster[:5] == ["nccom-test", "-r", "64", "-N", "2"]
    assert cluster[-4:] == ["allr", "--hosts", "10.0.0.1", "10.0.0.2"]  # --hosts takes the rest of the line


def test_nccom_local_sizes_ranks_from_neuron_ls(ls, nc):
    ls("ls_trn2_16dev_synthetic.json")
    nc("nccom_r2_allr_fp32_doc.txt")
    result = run_nccom(threshold_busbw_gbs=50.0, timeout_s=30)
    assert result.status is Status.PASSED, result.summary
    [args] = nc.calls()
    assert args[:2] == ["-r", "64"] and args[-1] == "allr" and "--check" in args
    assert "NEURON_RT_ROOT_COMM_ID" not in nc.envs()[0]
    assert result.metrics["max_busbw_gbs"] == 52.83 and result.evidence["returncode"] == 0


def test_nccom_low_bandwidth(nc):
    nc("nccom_r2_allr_low_busbw_synthetic.txt")
    result = run_nccom(ranks=2, threshold_busbw_gbs=40.0, timeout_s=30)
    assert result.status is Status.FAILED and result.findings[0].code == NCCOM_BUSBW_LOW


def test_nccom_wrong_results_exit_1_is_a_failure(nc):
    nc("nccom_r32_allg_check_wrong_synthetic.txt")
    result = run_nccom(ranks=32, operation="allg", timeout_s=30)
    assert result.status is Status.FAILED and result.findings[0].code == NCCOM_WRONG_RESULTS
    assert result.evidence["returncode"] == 1


@pytest.mark.parametrize("name, returncode", [("nccom_bench_failure_doc.txt", 1),
                                              ("nccom_driver_not_running_doc.txt", 1),
                                              ("nccom_2node_r64_cut_short_synthetic.txt", -9),
                                              ("nccom_garbage_synthetic.txt", 0)])
def test_nccom_errors(nc, name, returncode):
    nc(name)
    result = run_nccom(ranks=2, threshold_busbw_gbs=1.0, timeout_s=30)
    assert result.status is Status.ERROR, result.summary
    assert result.evidence["returncode"] == returncode and not result.findings


def test_nccom_nonzero_exit_never_passes(nc, monkeypatch):
    nc("nccom_r2_allr_fp32_doc.txt")
    monkeypatch.setenv("NCCOM_TEST_FAKE_EXIT", "2")
    result = run_nccom(ranks=2, threshold_busbw_gbs=1.0, timeout_s=30)
    assert result.status is Status.ERROR and "exited 2" in result.summary


def test_nccom_cluster_sets_the_rendezvous(nc):
    nc("nccom_2node_r64_allr_doc.txt")
    result = run_nccom(ranks=64, nodes=2, hosts=["10.1.4.145", "10.1.4.138"], threshold_busbw_gbs=45.0, timeout_s=30)
    assert result.status is Status.PASSED, result.summary
    [args] = nc.calls()
    assert args[2:4] == ["-N", "2"] and args[-3:] == ["--hosts", "10.1.4.145", "10.1.4.138"]
    assert nc.envs()[0]["NEURON_RT_ROOT_COMM_ID"] == f"10.1.4.145:{DEFAULT_ROOT_COMM_PORT}"
    assert result.metrics["nodes"] == 2 and result.metrics["largest_size_busbw_gbs"] == 47.09


def test_nccom_cluster_keeps_an_operator_rendezvous(nc, monkeypatch):
    nc("nccom_2node_r64_allr_doc.txt")
    monkeypatch.setenv("NEURON_RT_ROOT_COMM_ID", "10.9.9.9:5000")
    run_nccom(ranks=64, nodes=2, hosts=["10.1.4.145", "10.1.4.138"], timeout_s=30)
    assert nc.envs()[0]["NEURON_RT_ROOT_COMM_ID"] == "10.9.9.9:5000"


def test_nccom_without_a_listing_to_size_it_is_an_error(ls, nc, tmp_path):
    ls("ls_garbage_synthetic.txt")
    result = run_nccom(timeout_s=10)
    assert result.status is Status.ERROR and not (tmp_path / "nc" / "calls.log").exists()


def test_nccom_missing_tools_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run_nccom(ranks=2, timeout_s=5).status is Status.SKIPPED
    assert run_nccom(timeout_s=5).status is Status.SKIPPED  # no neuron-ls to size the run either


@pytest.mark.timeout(60)
def test_nccom_timeout_is_an_error_and_leaves_no_worker(nc, monkeypatch, tag):
    nc("nccom_r2_allr_fp32_doc.txt")
    monkeypatch.setenv("NCCOM_TEST_FAKE_SLEEP", "30")
    started = time.monotonic()
    result = run_nccom(ranks=2, timeout_s=1.0)
    assert result.status is Status.ERROR and "timed out" in result.summary and not result.findings
    assert time.monotonic() - started < 10
    assert_nothing_left(tag)


@pytest.mark.timeout(60)
def test_nccom_cancel_is_an_error_quickly(nc, monkeypatch, tag):
    nc("nccom_r2_allr_fp32_doc.txt")
    monkeypatch.setenv("NCCOM_TEST_FAKE_SLEEP", "30")
    started = time.monotonic()
    with cancelled_after(0.5):
        result = run_nccom(ranks=2, timeout_s=100)
    assert result.status is Status.ERROR and "cancelled" in result.summary
    assert time.monotonic() - started < 10
    assert_nothing_left(tag)


# -- the hardware check through the fakes -------------------------------------------------------------------------

def test_hw_check_every_device_on_its_own_cores(ls, nc):
    ls("ls_trn2_16dev_synthetic.json")
    nc("nccom_r2_allr_fp32_doc.txt")
    result = run_hw_check(timeout_s=60)
    assert result.status is Status.PASSED, result.summary
    calls = nc.calls()
    assert len(calls) == 16 and all(c[:2] == ["-r", "4"] and "--check" in c and c[-1] == "allr" for c in calls)
    assert [e["NEURON_RT_VISIBLE_CORES"] for e in nc.envs()] == [f"{4 * i}-{4 * i + 3}" for i in range(16)]
    assert result.metrics["passed"] == list(range(16)) and result.metrics["devices_tested"] == 16


def test_hw_check_names_the_device_that_corrupts_data(nc, monkeypatch):
    nc("nccom_r2_allr_fp32_doc.txt")
    monkeypatch.setenv("NCCOM_TEST_FAKE_BY_CORES", "20-23=nccom_r32_allg_check_wrong_synthetic.txt")
    result = run_hw_check(trn2_devices(range(8)), timeout_s=60)
    assert result.status is Status.FAILED
    [finding] = result.findings
    assert (finding.code, finding.component, finding.check) == (HW_CHECK_FAILED, "neuron:5", "neuron.hw_check")
    assert finding.severity is Severity.CRITICAL and finding.evidence["device"] == 5
    assert result.metrics["failed"] == [5] and result.metrics["passed"] == [0, 1, 2, 3, 4, 6, 7]
    json.dumps(result.record())


def test_hw_check_a_device_that_cannot_run_is_an_error_not_a_fault(nc, monkeypatch):
    nc("nccom_r2_allr_fp32_doc.txt")
    monkeypatch.setenv("NCCOM_TEST_FAKE_BY_CORES", "12-15=nccom_bench_failure_doc.txt")
    result = run_hw_check(trn2_devices(range(5)), timeout_s=60)
    assert result.status is Status.ERROR and not result.findings
    assert result.metrics["errors"] == [3] and "device 3" in result.summary


def test_hw_check_failure_outranks_errors(nc, monkeypatch):
    nc("nccom_r2_allr_fp32_doc.txt")
    monkeypatch.setenv("NCCOM_TEST_FAKE_BY_CORES", "0-3=nccom_garbage_synthetic.txt;"
                                                   "60-63=nccom_r32_allg_check_wrong_synthetic.txt")
    result = run_hw_check(trn2_devices([0, 9, 15]), timeout_s=60)
    assert result.status is Status.FAILED and [f.component for f in result.findings] == ["neuron:15"]
    assert result.metrics["errors"] == [0] and "could not test device(s) [0]" in result.summary


def test_hw_check_on_given_devices_without_neuron_ls(nc, tmp_path):
    nc("nccom_r2_allr_fp32_doc.txt")
    devices = listing("ls_trn1_32xl_topology_doc_text.txt").devices[:2]  # type: ignore[union-attr]
    result = run_hw_check(devices, neuron_ls_binary=str(tmp_path / "absent"), timeout_s=30)
    assert result.status is Status.PASSED
    assert [c[:2] for c in nc.calls()] == [["-r", "2"], ["-r", "2"]]
    assert [e["NEURON_RT_VISIBLE_CORES"] for e in nc.envs()] == ["0-1", "2-3"]


def test_hw_check_skips(tmp_path, monkeypatch, ls):
    ls("ls_trn1_2xl.json")
    assert run_hw_check(binary=str(tmp_path / "nccom-test"), timeout_s=10).status is Status.SKIPPED
    assert run_hw_check(neuron_ls_binary=str(tmp_path / "neuron-ls"), timeout_s=10).status is Status.SKIPPED
    assert run_hw_check([], timeout_s=10).status is Status.SKIPPED
    assert run_hw_check([NeuronDevice(0, cores=1)], timeout_s=10).status is Status.SKIPPED


def test_hw_check_unreadable_listing_is_an_error(ls, tmp_path):
    ls("ls_garbage_synthetic.txt")
    result = run_hw_check(binary=str(tmp_path / "never-run"), timeout_s=10)
    assert result.status is Status.ERROR and not result.findings


@pytest.mark.timeout(60)
def test_hw_check_timeout_covers_all_devices_and_leaves_nothing(ls, nc, monkeypatch, tag):
    ls("ls_trn2_16dev_synthetic.json")
    nc("nccom_r2_allr_fp32_doc.txt")
    monkeypatch.setenv("NCCOM_TEST_FAKE_SLEEP", "30")
    started = time.monotonic()
    result = run_hw_check(timeout_s=1.5)
    assert result.status is Status.ERROR and "timed out" in result.summary and not result.findings
    assert time.monotonic() - started < 10
    assert len(nc.calls()) == 1
    assert_nothing_left(tag)


@pytest.mark.timeout(60)
def test_hw_check_cancel(ls, nc, monkeypatch, tag):
    ls("ls_trn2_16dev_synthetic.json")
    nc("nccom_r2_allr_fp32_doc.txt")
    monkeypatch.setenv("NCCOM_TEST_FAKE_SLEEP", "30")
    started = time.monotonic()
    with cancelled_after(0.5):
        result = run_hw_check(timeout_s=600)
    assert result.status is Status.ERROR and "cancelled" in result.summary
    assert time.monotonic() - started < 10
    assert_nothing_left(tag)
