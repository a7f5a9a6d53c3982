"""The multi-node NCCL check through a real `srun` on the one-node test cluster: several tasks on the one node.

The fake all_reduce_perf (tests/fakes/bin) plays nccl-tests' MPI build: only SLURM_PROCID 0 prints, one rank line
per task. With torch installed, the built-in torch.distributed worker runs a real gloo all-reduce across the tasks.
"""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO
from nodemedic.checks.active import nccl
from nodemedic.checks.active.base import Status
from nodemedic.checks.active.cluster import CHECK, JOB_NAME, expand_hostlist, parse_hostlist, run_cluster, run_group
from nodemedic.checks.tools import cancel_scope

pytestmark = pytest.mark.integration

FAKE = REPO / "tests" / "fakes" / "bin" / "all_reduce_perf"


@pytest.fixture
def env(slurm) -> dict[str, str]:
    """The cluster's client environment, with no job of the runner's own (a step would join it)."""
    return {k: v for k, v in slurm.env.items()
            if not (k.startswith("SLURM_") and k != "SLURM_CONF") and not k.startswith("ALL_REDUCE_PERF_FAKE")}


@pytest.fixture
def binary(tmp_path) -> Path:
    """The fake under a path unique to this test, so that its processes can be found by their command line."""
    marker = tmp_path / "nodemedic-cluster-marker"
    marker.mkdir()
    (marker / "all_reduce_perf").symlink_to(FAKE)
    return marker / "all_reduce_perf"


def settle(slurm) -> None:
    # Slurm 22.05 can keep a node `mixed` after a step until a full listing recomputes it (test_slurm_launch.py).
    slurm.run("sinfo", "-N", check=False)


def leftovers(marker: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = p.info["cmdline"] or []
        if any(marker in arg for arg in cmdline):
            found.append(f"{p.info['pid']}: {' '.join(cmdline)}")
    return found


def wait_clean(slurm, marker: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = leftovers(marker)
        jobs = slurm.run("squeue", "-h", "-n", JOB_NAME, "-o", "%i %T", check=False).stdout.strip()
        if not left and not jobs:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: processes {left}, jobs {jobs!r}")
        time.sleep(0.2)


def run_fake(slurm, env, binary, fixture: str, threshold: float, **kw):
    env = {**env, "ALL_REDUCE_PERF_FAKE_OUTPUT": fixture, **kw.pop("fake_env", {})}
    try:
        return run_group([slurm.node], tasks_per_node=2, binary=str(binary), gpus_per_task=0, env=env,
                         threshold_busbw_gbs=threshold, **{"timeout_s": 60, **kw})
    finally:
        settle(slurm)


@pytest.mark.timeout(120)
def test_srun_step_is_parsed_and_judged(slurm, env, binary):
    result = run_fake(slurm, env, binary, "h100_single_node_g8.txt", 400.0)
    assert result.status is Status.PASSED, result.summary + result.evidence.get("output_tail", "")
    assert result.name == CHECK
    assert result.metrics["NcclTotalDevices"] == 2 and result.metrics["NcclNodes"] == 1
    assert result.metrics["NcclMaxAlgoBw"] == 470.73
    assert result.evidence["returncode"] == 0
    # srun --label: every line is rank 0's, and the rank lines name the node the step ran on.
    tail = result.evidence["output_tail"].splitlines()
    # (srun's own notices, e.g. "job 1 queued and waiting for resources" just after a node is resumed, are not.)
    assert all(line.startswith(("0: ", "srun: ")) for line in tail if line), tail
    assert sum(f" on    {slurm.node} device" in line for line in tail) == 2
    wait_clean(slurm, str(binary.parent))


@pytest.mark.timeout(120)
def test_srun_step_wrong_results_and_low_bandwidth_fail(slurm, env, binary):
    result = run_fake(slurm, env, binary, "h100_g8_wrong_synthetic.txt", 400.0)
    assert result.status is Status.FAILED, result.summary
    assert [f.code for f in result.findings] == [nccl.WRONG_RESULTS]
    assert result.evidence["returncode"] != 0  # every rank exits EXIT_FAILURE, as nccl-tests does

    result = run_fake(slurm, env, binary, "h100_single_node_g8.txt", 500.0)
    assert result.status is Status.FAILED and [f.code for f in result.findings] == [nccl.BUSBW_LOW]


@pytest.mark.timeout(120)
def test_srun_step_that_dies_is_an_error(slurm, env, binary):
    result = run_fake(slurm, env, binary, "init_failure_internal_error.txt", 400.0)
    assert result.status is Status.ERROR and not result.findings
    result = run_fake(slurm, env, binary, "h100_single_node_g8.txt", 400.0, fake_env={"ALL_REDUCE_PERF_FAKE_EXIT": "2"})
    assert result.status is Status.ERROR and "srun exited" in result.summary and not result.findings
    wait_clean(slurm, str(binary.parent))


@pytest.mark.timeout(120)
def test_timeout_leaves_no_step_behind(slurm, env, binary):
    started = time.monotonic()
    result = run_fake(slurm, env, binary, "h100_single_node_g8.txt", 400.0, timeout_s=3,
                      fake_env={"ALL_REDUCE_PERF_FAKE_SLEEP": "300"})
    assert result.status is Status.ERROR and "timed out" in result.summary and not result.findings
    assert time.monotonic() - started < 30
    wait_clean(slurm, str(binary.parent))


@pytest.mark.timeout(120)
def test_cancel_leaves_no_step_behind(slurm, env, binary):
    cancel = threading.Event()
    timer = threading.Timer(2.0, cancel.set)
    timer.start()
    try:
        with cancel_scope(cancel):
            result = run_fake(slurm, env, binary, "h100_single_node_g8.txt", 400.0,
                              fake_env={"ALL_REDUCE_PERF_FAKE_SLEEP": "300"})
    finally:
        timer.cancel()
    assert result.status is Status.ERROR and "cancelled" in result.summary and not result.findings
    wait_clean(slurm, str(binary.parent))


@pytest.mark.timeout(120)
def test_run_cluster_on_the_one_node(slurm, env, binary):
    env = {**env, "ALL_REDUCE_PERF_FAKE_OUTPUT": "h100_single_node_g8.txt"}
    try:
        result = run_cluster(slurm.node, tasks_per_node=2, threshold_busbw_gbs=400.0, binary=str(binary),
                             gpus_per_task=0, env=env, timeout_s=60)
    finally:
        settle(slurm)
    assert result.result.status is Status.PASSED and result.bad_nodes == [] and result.bisection is None
    assert result.record()["group"]["metrics"]["NcclTotalDevices"] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("expr", ["node[01-04],gpu7", "n[1,3,8-10]", "n[098-101]", "r[1-2]n[1-2]", "ip-10-1-[2-3]",
                                  "n[01-3]", "n[1-03]", "n[9-011]", "gpu-[1-2],cpu-[01-02]"])
def test_fallback_parser_agrees_with_scontrol(slurm_cluster, expr):
    """Slurm's own hostlist parser is the oracle for the pure-Python fallback."""
    assert expand_hostlist(expr, env=slurm_cluster.env) == parse_hostlist(expr)
    out = slurm_cluster.run("scontrol", "show", "hostnames", expr)
    assert out.stdout.split() == parse_hostlist(expr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_gloo_allreduce_through_srun(slurm, env):
    if importlib.util.find_spec("nodemedic.checks.active.torch_allreduce") is None:
        pytest.skip("the built-in torch.distributed worker (checks/active/torch_allreduce.py) is not there")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install nodemedic[torch])")
    try:
        # binary=None: the torch worker, each srun task one rank (SLURM_PROCID/SLURM_NTASKS), meeting on node 0.
        result = run_group([slurm.node], tasks_per_node=2, binary=None, backend="gloo", gpus_per_task=0,
                           min_bytes="64K", max_bytes="1M", iters=5, master_addr="127.0.0.1",
                           master_port=_free_port(), threshold_busbw_gbs=1e-6, env=env, timeout_s=240)
    finally:
        settle(slurm)
    assert result.status is Status.PASSED, result.summary + "\n" + result.evidence.get("output_tail", "")
    assert result.metrics["NcclTotalDevices"] == 2 and result.metrics["NcclNodes"] == 1
    assert result.metrics["NcclMaxAlgoBw"] > 0 and result.metrics["wrong"] == 0
    assert "torch_allreduce" in " ".join(result.evidence["command"])


@pytest.mark.timeout(180)
def test_nodemedic_diag_cluster_command_through_srun(slurm, env, binary, tmp_path):
    """The operator's command end to end: srun on the test cluster, the verdict, the exit status, the log record."""
    import json
    import subprocess
    import sys

    config = tmp_path / "cfg.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\nimds: {{enabled: false}}\n"
                      f"deep_checks: {{log_path: {tmp_path / 'deep.log'}}}\n")
    base = [sys.executable, "-m", "nodemedic", "diag", "cluster", "--config", str(config), "--nodes", slurm.node,
            "--tasks-per-node", "2", "--gpus-per-task", "0", "--binary", str(binary), "--threshold", "100"]
    try:
        ok = subprocess.run([*base, "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        record = json.loads(ok.stdout)
        assert record["status"] == "passed" and record["metrics"]["NcclTotalDevices"] == 2
        bad = subprocess.run(base, env={**env, "ALL_REDUCE_PERF_FAKE_OUTPUT": "h100_g8_wrong_synthetic.txt"},
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1 and "NCCL_WRONG_RESULTS" in bad.stdout, bad.stdout + bad.stderr
    finally:
        settle(slurm)
    logged = [json.loads(line) for line in (tmp_path / "deep.log").read_text().splitlines()]
    assert [r["status"] for r in logged] == ["passed", "failed"]
    assert logged[0]["cluster"]["name"] == CHECK


def test_nodemedic_diag_cluster_kubernetes_manifest_validates(tmp_path):
    import subprocess
    import sys

    import kubernetes_validate
    import yaml

    out = subprocess.run([sys.executable, "-m", "nodemedic", "diag", "cluster", "--config", "/dev/null", "--nodes",
                          "gpu[01-04]", "--kubernetes", "--image", "registry.example/nodemedic:1", "--tasks-per-node",
                          "8", "--efa-per-node", "32"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    job = docs[1]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    assert job["spec"]["completionMode"] == "Indexed"
