"""The built-in torch.distributed all-reduce test: real gloo runs in 2-4 processes, judged by the nccl-tests verdict."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from nodemedic.checks.active import torch_allreduce as ta
from nodemedic.checks.active.base import Status
from nodemedic.checks.active.nccl import BUSBW_LOW, CHECK, WRONG_RESULTS, parse_allreduce

from fakes.processes import assert_nothing_left, cancelled_after, new_children, process_tag  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not ta.torch_available(), reason="torch not installed")

RECORD_KEYS = {"NcclMaxAlgoBw", "NcclAvgAlgoBw", "NcclThresholdAlgoBw", "NcclOutOfBoundError", "NcclOperations",
               "NcclTotalDevices", "NcclNodes"}
SMALL = {"backend": "gloo", "min_bytes": "4K", "max_bytes": "1M", "iters": 3, "warmup": 1}


@pytest.fixture(autouse=True)
def tag(process_tag, monkeypatch) -> str:
    """Every process a test starts carries the tag (fakes.processes), so leftovers are found wherever they went."""
    monkeypatch.delenv(ta.FAULT_ENV, raising=False)
    return process_tag


# -- sizes, ranks and the output format ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("4096", 4096), ("64K", 65536), ("1M", 1 << 20), ("2g", 2 << 30),
                                         ("16MB", 16 << 20)])
def test_sizes_use_nccl_tests_suffixes(text, value):
    assert ta.parse_size(text) == value


def test_bad_size_is_refused():
    with pytest.raises(ValueError):
        ta.parse_size("1T")


def test_sizes_step_by_the_factor():
    assert ta.sizes(4096, 65536, 2) == [4096, 8192, 16384, 32768, 65536]
    assert ta.sizes(1 << 20, 64 << 20, 4) == [1 << 20, 4 << 20, 16 << 20, 64 << 20]


def test_bandwidth_follows_nccl_tests():
    algbw, busbw = ta.bandwidth(1 << 30, 1e6, 8)   # 1 GiB in one second on 8 ranks
    assert algbw == pytest.approx(1.073741824)
    assert busbw == pytest.approx(algbw * 2 * 7 / 8)


def test_ranking_prefers_torchrun_variables_then_slurm():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node-a", "MASTER_PORT": "1234",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert ta.ranking(env) == ta.Ranking(3, 8, 1, "node-a", 1234)
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5"}
    assert ta.ranking(slurm, "10.0.0.1", 29600) == ta.Ranking(5, 16, 5, "10.0.0.1", 29600)
    assert ta.ranking({}) == ta.Ranking(0, 1, 0, "127.0.0.1", 29500)
    assert ta.ranking(slurm, "fe80::1", 1).init_method == "tcp://[fe80::1]:1"
    with pytest.raises(ValueError, match="master address"):
        ta.ranking(slurm)


def test_formatted_lines_parse_as_all_reduce_perf_output():
    info = {"pid": 4242, "host": "node-a", "device": 0, "bus": "cpu", "name": "gloo cpu"}
    oop, ip = ta.Half(12345.6, 0.34, 0.51, 0), ta.Half(99.5, 0.0123, 0.0185, None)
    text = "\n".join([*ta.format_header(4096, 8192, 2, 5, 20, True), ta.format_rank(0, info), *ta.TABLE_HEAD,
                      ta.format_row(4096, oop, ip), *ta.format_footer(0, 0.25)])
    run = parse_allreduce(text)
    [row], [rank] = run.rows, run.ranks
    assert (row.size, row.count, row.type, row.redop, row.root) == (4096, 1024, "float", "sum", -1)
    assert (row.oop_time_us, row.oop_busbw, row.oop_wrong) == (12345.6, 0.51, 0)
    assert (row.ip_time_us, row.ip_busbw, row.ip_wrong) == (99.5, 0.0185, None)
    assert (rank.rank, rank.pid, rank.host, rank.device, rank.bus, rank.name) == (0, 4242, "node-a", 0, "cpu",
                                                                                  "gloo cpu")
    assert run.header == {"nThread": 1, "nGpus": 1, "minBytes": 4096, "maxBytes": 8192, "validation": 1}
    assert (run.out_of_bounds, run.out_of_bounds_status, run.avg_busbw) == (0, "OK", 0.25)
    assert run.complete and not run.failures and not run.legacy


# -- real gloo runs through the launcher --------------------------------------------------------------------------

def launcher(*extra: str) -> list[str]:
    return [sys.executable, "-m", ta.MODULE, "--backend", "gloo", "--min-bytes", "4K", "--max-bytes", "256K",
            "--iters", "3", "--warmup", "1", *extra]


@pytest.mark.timeout(180)
def test_launcher_output_parses_completely(tag):
    proc = subprocess.run(launcher("--nproc", "2"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = parse_allreduce(proc.stdout)
    assert [r.size for r in run.rows] == [4096 << i for i in range(7)]
    assert all(r.count == r.size // 4 and r.oop_wrong == 0 and r.ip_wrong == 0 for r in run.rows)
    assert [r.rank for r in run.ranks] == [0, 1] and all(r.bus == "cpu" and r.pid for r in run.ranks)
    assert run.header["minBytes"] == 4096 and run.header["maxBytes"] == 262144 and run.header["validation"] == 1
    assert (run.out_of_bounds, run.out_of_bounds_status) == (0, "OK") and run.avg_busbw is not None
    assert run.complete and not run.failures and (run.devices, run.nodes) == (2, 1)
    assert all(r.busbw == pytest.approx(r.algbw, rel=0.02, abs=1e-4) for r in run.rows)  # 2(n-1)/n = 1 for n=2
    assert_nothing_left(tag)


@pytest.mark.timeout(180)
def test_no_check_prints_na(tag):
    proc = subprocess.run(launcher("--nproc", "2", "--no-check", "--max-bytes", "8K"), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = parse_allreduce(proc.stdout)
    assert len(run.rows) == 2 and all(r.oop_wrong is None and r.ip_wrong is None for r in run.rows)
    assert run.header["validation"] == 0 and run.complete


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_real_gloo_run_passes(nproc, tag):
    result = ta.run_torch_allreduce(nproc, timeout_s=100, **SMALL)
    assert result.status is Status.PASSED, (result.summary, result.evidence)
    assert result.name == CHECK and RECORD_KEYS <= result.metrics.keys()
    m = result.metrics
    assert (m["NcclTotalDevices"], m["NcclNodes"], m["NcclOutOfBoundError"], m["wrong"]) == (nproc, 1, "OK", 0)
    assert m["NcclOperations"] == "torch.distributed.all_reduce (gloo)"
    assert m["largest_size_bytes"] == 1 << 20 and m["NcclMaxAlgoBw"] > 0 and m["NcclAvgAlgoBw"] > 0
    assert m["NcclThresholdAlgoBw"] is None and "bandwidth not judged" in result.summary
    assert len(parse_allreduce(result.evidence["output_tail"]).rows) == 9
    assert result.evidence["returncode"] == 0 and result.evidence["command"][:3] == [sys.executable, "-m", ta.MODULE]
    assert_nothing_left(tag)


@pytest.mark.timeout(180)
def test_threshold_far_above_cpu_gloo_fails_low_bandwidth(tag):
    result = ta.run_torch_allreduce(2, timeout_s=60, threshold_busbw_gbs=10_000.0, **SMALL)
    assert result.status is Status.FAILED
    [finding] = result.findings
    assert finding.code == BUSBW_LOW and finding.evidence["threshold_gbs"] == 10_000.0
    assert result.metrics["NcclThresholdAlgoBw"] == 10_000.0
    assert_nothing_left(tag)


@pytest.mark.timeout(180)
def test_wrong_values_fail_with_exit_one(monkeypatch, tag):
    monkeypatch.setenv(ta.FAULT_ENV, "wrong:1")
    result = ta.run_torch_allreduce(2, timeout_s=60, **{**SMALL, "max_bytes": "16K"})
    assert result.status is Status.FAILED and result.evidence["returncode"] == ta.EXIT_WRONG
    [finding] = result.findings
    assert finding.code == WRONG_RESULTS and finding.evidence["wrong"] == 3      # one per size, out-of-place
    assert result.metrics["NcclOutOfBoundError"] == "FAILED"
    assert_nothing_left(tag)


# -- failures leave nothing behind --------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_timeout_is_error_and_leaves_no_process(monkeypatch, tag):
    monkeypatch.setenv(ta.FAULT_ENV, "hang:1")
    started = time.monotonic()
    result = ta.run_torch_allreduce(2, timeout_s=8, **SMALL)
    assert result.status is Status.ERROR, result.summary
    assert result.evidence["returncode"] == ta.EXIT_TIMEOUT and "timed out" in result.summary
    assert time.monotonic() - started < 30
    assert_nothing_left(tag)


@pytest.mark.timeout(180)
def test_tiny_timeout_before_the_ranks_start_is_error(tag):
    result = ta.run_torch_allreduce(2, timeout_s=0.3, **{**SMALL, "max_bytes": "64M"})
    assert result.status is Status.ERROR
    assert_nothing_left(tag)


@pytest.mark.timeout(180)
def test_cancel_stops_the_run_quickly(monkeypatch, tag):
    monkeypatch.setenv(ta.FAULT_ENV, "hang:1")
    started = time.monotonic()
    with cancelled_after(4.0):
        result = ta.run_torch_allreduce(2, timeout_s=100, **SMALL)
    assert result.status is Status.ERROR and "cancelled" in result.summary
    assert time.monotonic() - started < 15
    assert_nothing_left(tag)


@pytest.mark.timeout(180)
def test_a_rank_dying_mid_run_is_error_never_passed(monkeypatch, tag):
    monkeypatch.setenv(ta.FAULT_ENV, "exit:1")
    started = time.monotonic()
    result = ta.run_torch_allreduce(3, timeout_s=100, **SMALL)
    assert result.status is Status.ERROR, result.summary
    assert result.evidence["returncode"] == ta.EXIT_ERROR
    assert f"rank 1 status {ta.EXIT_FAULT}" in result.evidence["output_tail"]
    assert time.monotonic() - started < 45
    assert_nothing_left(tag)


@pytest.mark.timeout(180)
def test_sigterm_to_the_launchers_group_leaves_nothing(monkeypatch, tag):
    monkeypatch.setenv(ta.FAULT_ENV, "hang:1")
    proc = subprocess.Popen(launcher("--nproc", "3", "--timeout-s", "100"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()   # rank 0 printed the header: every rank is up and rendezvoused
    assert first.startswith("# nThread 1 nGpus 1")
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode != 0
    assert_nothing_left(tag)


@pytest.mark.timeout(180)
def test_sigkill_of_the_launcher_takes_the_ranks_with_it(monkeypatch, tag):
    monkeypatch.setenv(ta.FAULT_ENV, "hang:1")
    proc = subprocess.Popen(launcher("--nproc", "2", "--timeout-s", "100"), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("# nThread")
    proc.kill()   # no handler runs: the ranks' parent-death signal must stop them
    proc.wait(timeout=10)
    proc.stdout.close()
    assert_nothing_left(tag)


def test_missing_torch_is_skipped(monkeypatch):
    monkeypatch.setattr(ta, "torch_available", lambda: False)
    result = ta.run_torch_allreduce(2, **SMALL)
    assert result.status is Status.SKIPPED and "torch" in result.summary
    assert new_children() == []


# -- one rank per process, as torchrun or srun start it -----------------------------------------------------------

def run_ranks(envs: list[dict[str, str]], *extra: str) -> list[subprocess.CompletedProcess[str]]:
    base = {k: v for k, v in os.environ.items()
            if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
            and not k.startswith("SLURM_")}
    procs = [subprocess.Popen(launcher("--timeout-s", "60", *extra), env={**base, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in envs]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def check_single_rank_runs(results: list[subprocess.CompletedProcess[str]]) -> None:
    lead, other = results
    assert lead.returncode == 0 and other.returncode == 0, (lead.stdout, lead.stderr, other.stderr)
    run = parse_allreduce(lead.stdout)
    assert run.complete and len(run.rows) == 7 and [r.rank for r in run.ranks] == [0, 1]
    assert run.wrong == 0 and run.out_of_bounds_status == "OK" and not run.failures
    assert other.stdout == ""


@pytest.mark.timeout(180)
def test_torchrun_style_environment_makes_one_rank_each(tag):
    port = str(ta._free_port())
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    check_single_rank_runs(run_ranks([{**common, "RANK": "0", "LOCAL_RANK": "0"},
                                      {**common, "RANK": "1", "LOCAL_RANK": "1"}]))
    assert_nothing_left(tag)


@pytest.mark.timeout(180)
def test_slurm_environment_with_master_flags_makes_one_rank_each(tag):
    port = str(ta._free_port())
    check_single_rank_runs(run_ranks([{"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r)}
                                      for r in range(2)], "--master-addr", "127.0.0.1", "--master-port", port))
    assert_nothing_left(tag)


@pytest.mark.timeout(60)
def test_missing_master_address_is_a_failure_line(tag):
    [result] = run_ranks([{"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}])
    assert result.returncode == ta.EXIT_ERROR
    [failure] = parse_allreduce(result.stdout).failures
    assert "no master address" in failure
