from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodemedic.checks.active.base import Status
from nodemedic.checks.active.nccl import (
    BUSBW_LOW,
    WRONG_RESULTS,
    judge,
    load_thresholds,
    parse_allreduce,
    run_allreduce,
    threshold_for,
)

from fakes.replay import replay

FIXTURES = Path(__file__).parent.parent / "fixtures" / "nccl"
FAKE = str(Path(__file__).parent.parent / "fakes" / "bin" / "all_reduce_perf")
RECORD_KEYS = {"NcclMaxAlgoBw", "NcclAvgAlgoBw", "NcclThresholdAlgoBw", "NcclOutOfBoundError", "NcclOperations",
               "NcclTotalDevices", "NcclNodes"}


def run_of(name: str):
    return parse_allreduce((FIXTURES / name).read_text())


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return replay(monkeypatch, tmp_path, "ALL_REDUCE_PERF_FAKE")


# -- parser on the real captures ----------------------------------------------------------------------------------

def test_single_node_h100():
    run = run_of("h100_single_node_g8.txt")
    assert [r.size for r in run.rows] == [268435456, 536870912, 1073741824, 2147483648]
    first = run.rows[0]
    assert (first.count, first.type, first.redop, first.root) == (67108864, "float", "sum", -1)
    assert (first.oop_time_us, first.oop_algbw, first.oop_busbw, first.oop_wrong) == (1119.8, 239.71, 419.49, 0)
    assert (first.ip_time_us, first.ip_algbw, first.ip_busbw, first.ip_wrong) == (1117.4, 240.24, 420.42, 0)
    assert run.avg_busbw == 448.212
    assert run.max_busbw == 470.73 and run.max_algbw == 268.99
    assert run.largest is not None and run.largest.busbw == 470.73
    assert (run.out_of_bounds, run.out_of_bounds_status, run.wrong) == (0, "OK", 0)
    assert (run.devices, run.nodes) == (8, 1)
    assert run.header["nGpus"] == 8 and run.header["maxBytes"] == 2147483648
    assert run.complete and not run.failures and not run.legacy


def test_two_node_h100_trailing_spaces():
    run = run_of("h100_2node_16gpu.txt")
    assert len(run.rows) == 5
    assert run.avg_busbw == 194.675
    assert run.max_busbw == 196.52
    assert run.rows[1].oop_time_us == 10314.0
    assert (run.devices, run.nodes, run.wrong, run.out_of_bounds_status) == (16, 2, 0, "OK")
    assert run.ranks[8].host == "nccl-tests-h100-worker-1" and run.ranks[8].bus == "0x19"


def test_two_node_a100_with_launcher_noise():
    run = run_of("a100_2node_oke.txt")
    assert len(run.rows) == 31
    assert run.rows[0].size == 8 and run.rows[-1].size == 8589934592
    assert run.avg_busbw == 66.4834
    assert run.max_busbw == 237.94
    assert run.largest is not None and run.largest.ip_busbw == 237.52
    assert (run.devices, run.nodes, run.wrong) == (16, 2, 0)
    assert run.complete


def test_open_mpi_tagged_lines_parse_like_the_plain_capture():
    tagged, plain = run_of("h100_2node_mpi_tagged_synthetic.txt"), run_of("h100_2node_16gpu.txt")
    assert tagged.rows == plain.rows
    assert (tagged.avg_busbw, tagged.devices, tagged.nodes) == (194.675, 16, 2)


def test_init_failure_is_an_error_not_a_pass():
    run = run_of("init_failure_internal_error.txt")
    assert not run.rows and not run.complete
    assert "Test NCCL failure common.cu:959 'internal error" in run.failures[0]
    assert run.header["validation"] == 0 and run.devices == 4 and run.nodes == 2
    result = judge(run, 10.0)
    assert result.status is Status.ERROR and "internal error" in result.summary
    assert not result.findings


def test_legacy_nccl1_failure():
    run = run_of("legacy_nccl1_failure.txt")
    assert run.legacy
    assert run.header["nGpus"] == 8
    assert run.devices == 8 and run.ranks[0].host == "node03" and run.ranks[0].name == "Tesla P100-PCIE-16GB"
    assert run.failures == ["NCCL failure all_reduce.cu:95 'unhandled cuda error'"]
    assert judge(run, 10.0).status is Status.ERROR


def test_legacy_rows_and_footer_without_hash():
    text = ("nThread 1 nGpus 2 minBytes 8 maxBytes 16 step: 2(factor) warmup iters: 5 iters: 20 validation: 1\n"
            "           8             2   float     sum    0.045   0.00   0.00    0e+00"
            "    0.045   0.00   0.00    0e+00\n"
            "          16             4   float     sum    0.046   0.00   0.00    0e+00"
            "    0.046   0.00   0.00    0e+00\n"
            " Out of bounds values : 0 OK\n Avg bus bandwidth    : 0.001 \n")
    run = parse_allreduce(text)
    assert run.legacy and len(run.rows) == 2 and run.rows[0].root is None and run.rows[0].oop_wrong is None
    assert (run.out_of_bounds_status, run.avg_busbw) == ("OK", 0.001)


def test_validation_off_prints_na():
    row = ("  1073741824     268435456     float     sum      -1    10314  104.11  195.20    N/A"
           "    10339  103.85  194.73    N/A")
    run = parse_allreduce(row + "\n# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 194.9 \n")
    assert run.rows[0].oop_wrong is None and run.wrong == 0 and run.complete


def test_cut_short_run_is_an_error():
    run = run_of("h100_g8_cut_short_synthetic.txt")
    assert len(run.rows) == 2 and not run.complete
    result = judge(run, 100.0)
    assert result.status is Status.ERROR and "footer" in result.summary


@pytest.mark.parametrize("name", ["garbage_synthetic.txt", "libnccl_missing_synthetic.txt"])
def test_garbage_is_an_error(name):
    run = run_of(name)
    assert not run.rows
    assert judge(run, 1.0).status is Status.ERROR


# -- judge --------------------------------------------------------------------------------------------------------

def test_judge_pass_and_record_keys():
    result = judge(run_of("h100_single_node_g8.txt"), 414.0, nodes=1, devices=8)
    assert result.status is Status.PASSED and not result.findings
    assert RECORD_KEYS <= result.metrics.keys()
    assert result.metrics["NcclMaxAlgoBw"] == 470.73
    assert result.metrics["NcclAvgAlgoBw"] == 448.212
    assert result.metrics["NcclThresholdAlgoBw"] == 414.0
    assert result.metrics["NcclOutOfBoundError"] == "OK"
    assert result.metrics["NcclOperations"] == "all_reduce_perf"
    assert (result.metrics["NcclTotalDevices"], result.metrics["NcclNodes"]) == (8, 1)
    json.dumps(result.record())


def test_judge_threshold_edges():
    run = run_of("h100_single_node_g8.txt")
    assert judge(run, 470.73).status is Status.PASSED  # equal passes
    low = judge(run, 470.74)
    assert low.status is Status.FAILED
    [finding] = low.findings
    assert (finding.code, finding.component, finding.check) == (BUSBW_LOW, "node", "nccl.all_reduce")
    assert finding.evidence["max_busbw_gbs"] == 470.73


def test_judge_largest_size_must_also_clear_the_threshold():
    text = (FIXTURES / "h100_single_node_g8.txt").read_text().replace(
        "7983.5  268.99  470.73      0   7985.2  268.93  470.63",
        "9983.5  215.10  376.43      0   9985.2  215.06  376.36")
    run = parse_allreduce(text)
    assert run.max_busbw == 466.57 and run.largest is not None and run.largest.busbw == 376.43
    result = judge(run, 414.0)
    assert result.status is Status.FAILED and result.findings[0].code == BUSBW_LOW
    assert result.metrics["largest_size_busbw_gbs"] == 376.43


def test_judge_multi_node_capture_against_p5_threshold():
    run = run_of("h100_2node_16gpu.txt")
    result = judge(run, threshold_for("p5.48xlarge", nodes=2))
    assert result.status is Status.FAILED and result.metrics["NcclNodes"] == 2
    assert result.metrics["NcclTotalDevices"] == 16


def test_judge_wrong_results():
    run = run_of("h100_g8_wrong_synthetic.txt")
    assert run.wrong == 12 and run.rows[2].ip_wrong == 12
    assert (run.out_of_bounds, run.out_of_bounds_status) == (12, "FAILED")
    result = judge(run, 100.0)
    assert result.status is Status.FAILED
    [finding] = result.findings
    assert finding.code == WRONG_RESULTS and finding.component == "node"
    assert finding.evidence["wrong_sizes"] == [1073741824]
    assert result.metrics["NcclOutOfBoundError"] == "FAILED"


def test_judge_device_count_mismatch_is_an_error():
    assert judge(run_of("h100_single_node_g8.txt"), 100.0, nodes=1, devices=16).status is Status.ERROR


def test_judge_without_threshold_checks_correctness_only():
    result = judge(run_of("h100_single_node_g8.txt"), None)
    assert result.status is Status.PASSED and "not judged" in result.summary
    assert result.metrics["NcclThresholdAlgoBw"] is None


# -- thresholds ---------------------------------------------------------------------------------------------------

def test_thresholds_below_reference():
    table = load_thresholds()
    assert table["p5.48xlarge"]["single_node"] < 460
    assert threshold_for("p5.48xlarge") == threshold_for("ml.p5.48xlarge") == threshold_for(" ML.P5.48XLARGE ")
    assert 400 <= threshold_for("p5.48xlarge") < 460  # type: ignore[operator]
    assert 420 <= threshold_for("p5en.48xlarge") < 480  # type: ignore[operator]
    assert 190 <= threshold_for("p4d.24xlarge") < 228  # type: ignore[operator]
    assert threshold_for("p5.48xlarge", nodes=2) < 487  # type: ignore[operator]
    assert threshold_for("p4d.24xlarge", nodes=2) is None
    assert threshold_for("g5.xlarge") is None and threshold_for(None) is None


def test_real_captures_clear_their_own_thresholds():
    # The healthy 8xH100 capture clears the p5 threshold with margin, as the threshold comment claims.
    assert judge(run_of("h100_single_node_g8.txt"), threshold_for("p5.48xlarge")).status is Status.PASSED


# -- runner through the fake --------------------------------------------------------------------------------------

def test_run_allreduce_pass(fake):
    fake("h100_single_node_g8.txt")
    result = run_allreduce(binary=FAKE, gpus=8, threshold_busbw_gbs=414.0, timeout_s=30)
    assert result.status is Status.PASSED, result.summary
    assert fake.calls() == [["-b", "1G", "-e", "16G", "-f", "2", "-g", "8"]]
    assert result.metrics["NcclAvgAlgoBw"] == 448.212
    assert result.evidence["returncode"] == 0 and result.evidence["command"][0] == FAKE
    assert result.duration_s > 0


def test_run_allreduce_low_bandwidth(fake):
    fake("h100_2node_16gpu.txt")
    result = run_allreduce(binary=FAKE, gpus=8, nodes=2, threshold_busbw_gbs=438.0, timeout_s=30)
    assert result.status is Status.FAILED and result.findings[0].code == BUSBW_LOW


def test_run_allreduce_wrong_results_exit_1(fake):
    fake("h100_g8_wrong_synthetic.txt")
    result = run_allreduce(binary=FAKE, threshold_busbw_gbs=100.0, timeout_s=30)
    assert result.status is Status.FAILED and result.findings[0].code == WRONG_RESULTS
    assert result.evidence["returncode"] == 1


@pytest.mark.parametrize("name, returncode", [("init_failure_internal_error.txt", 3),
                                              ("h100_g8_cut_short_synthetic.txt", -9),
                                              ("libnccl_missing_synthetic.txt", 127),
                                              ("garbage_synthetic.txt", 0)])
def test_run_allreduce_errors(fake, name, returncode):
    fake(name)
    result = run_allreduce(binary=FAKE, gpus=4 if name.startswith("init") else 8, threshold_busbw_gbs=1.0,
                           timeout_s=30)
    assert result.status is Status.ERROR, result.summary
    assert result.evidence["returncode"] == returncode
    assert not result.findings


def test_run_allreduce_nonzero_exit_never_passes(fake, monkeypatch):
    fake("h100_single_node_g8.txt")
    monkeypatch.setenv("ALL_REDUCE_PERF_FAKE_EXIT", "1")
    result = run_allreduce(binary=FAKE, threshold_busbw_gbs=100.0, timeout_s=30)
    assert result.status is Status.ERROR and "exited 1" in result.summary


def test_run_allreduce_timeout_is_an_error(fake, monkeypatch):
    fake("h100_single_node_g8.txt")
    monkeypatch.setenv("ALL_REDUCE_PERF_FAKE_SLEEP", "5")
    result = run_allreduce(binary=FAKE, threshold_busbw_gbs=100.0, timeout_s=0.5)
    assert result.status is Status.ERROR and "timed out" in result.summary


def test_run_allreduce_missing_binary_is_skipped(tmp_path):
    result = run_allreduce(binary=str(tmp_path / "all_reduce_perf"), timeout_s=5)
    assert result.status is Status.SKIPPED and not result.findings
    assert run_allreduce(binary="nodemedic-no-such-all_reduce_perf", timeout_s=5).status is Status.SKIPPED
