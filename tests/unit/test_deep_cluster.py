"""The multi-node NCCL check: hostlists, the srun command, bisection into pairs, the Kubernetes Indexed Job."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterable

import pytest
import yaml

from nodemedic.checks.active import cluster, nccl
from nodemedic.checks.active.base import DeepCheckResult, Status
from nodemedic.checks.active.cluster import (
    CHECK,
    bisect,
    build_srun_command,
    compress_hostlist,
    dump_yaml,
    expand_hostlist,
    parse_hostlist,
    render_k8s_job,
    run_cluster,
    run_group,
)
from nodemedic.model import Finding, Severity

FAKE = str(Path(__file__).parent.parent / "fakes" / "bin" / "all_reduce_perf")
FIXTURES = Path(__file__).parent.parent / "fixtures" / "nccl"


# -- hostlists ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expr, hosts", [
    ("node01", ["node01"]),
    ("node[01-04],gpu7", ["node01", "node02", "node03", "node04", "gpu7"]),
    ("ip-10-1-[2-3]", ["ip-10-1-2", "ip-10-1-3"]),
    ("n[1,3,8-10]", ["n1", "n3", "n8", "n9", "n10"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[01-3]", ["n01", "n02", "n03"]),      # scontrol: the lower bound's padding
    ("n[9-011]", ["n9", "n10", "n11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    (" a1 , a2,a1 ", ["a1", "a2"]),
])
def test_parse_hostlist(expr, hosts):
    assert parse_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", ["", "n[1-", "n1]", "n[a-b]", "n[3-1]", "n[1-2]]"])
def test_parse_hostlist_rejects(expr):
    with pytest.raises(ValueError):
        parse_hostlist(expr)


def test_expand_hostlist_falls_back_without_scontrol():
    assert expand_hostlist("node[1-2]", scontrol="nodemedic-no-such-scontrol") == ["node1", "node2"]
    assert expand_hostlist(["a1", "b[1-2]"], scontrol="nodemedic-no-such-scontrol") == ["a1", "b1", "b2"]


def test_expand_hostlist_prefers_scontrol(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 9\necho from-scontrol-1\necho x2\n")
    fake.chmod(0o755)
    assert expand_hostlist("n[1-2]", scontrol=str(fake)) == ["from-scontrol-1", "x2"]
    fake.write_text("#!/bin/sh\necho 'scontrol: error: bad' >&2\nexit 1\n")
    assert expand_hostlist("n[1-2]", scontrol=str(fake)) == ["n1", "n2"]


@pytest.mark.parametrize("hosts, expr", [
    (["node01", "node02", "node03", "gpu7"], "node[01-03],gpu7"),
    (["n1", "n3", "n8", "n9", "n10"], "n[1,3,8-10]"),
    (["ip-10-1-2", "ip-10-1-3"], "ip-10-1-[2-3]"),
    (["login"], "login"),
    (["a5"], "a5"),
])
def test_compress_hostlist_round_trips(hosts, expr):
    assert compress_hostlist(hosts) == expr
    assert parse_hostlist(expr) == hosts


# -- the srun command ---------------------------------------------------------------------------------------------

def test_srun_command_with_nccl_tests():
    args = build_srun_command(["node01", "node02"], 8, binary=FAKE, min_bytes="256M", max_bytes="2G", mpi="pmix",
                              extra_srun_args=["--reservation=deep"], time_limit_s=300)
    i = args.index(FAKE)
    assert args[0] == "srun"
    assert set(args[1:i]) == {"--nodes=2", "--nodelist=node[01-02]", "--ntasks-per-node=8", "--ntasks=16",
                              "--kill-on-bad-exit=1", "--label", f"--job-name={cluster.JOB_NAME}", "--time=5",
                              "--gpus-per-task=1", "--mpi=pmix", "--reservation=deep"}
    assert args[i + 1:] == ["-b", "256M", "-e", "2G", "-f", "2", "-g", "1"]  # MPI build: one GPU per rank


def test_srun_command_falls_back_to_the_torch_worker():
    args = build_srun_command(["a", "b"], 2, binary="nodemedic-no-such-all_reduce_perf", gpus_per_task=0,
                              master_port=29999, python="/opt/py/bin/python", backend="gloo")
    i = args.index("/opt/py/bin/python")
    assert not any(a.startswith("--gpus") or a.startswith("--mpi") or a.startswith("--time") for a in args[:i])
    assert args[i:] == ["/opt/py/bin/python", "-m", "nodemedic.checks.active.torch_allreduce", "--backend", "gloo",
                        "--min-bytes", "1G", "--max-bytes", "16G", "--factor", "2",
                        "--master-addr", "a", "--master-port", "29999"]
    assert build_srun_command(["a"], 1, binary=None)[build_srun_command(["a"], 1, binary=None).index("-m") + 1] \
        == cluster.WORKER_MODULE
    assert "127.0.0.1" in build_srun_command(["a"], 1, binary=None, master_addr="127.0.0.1")
    timed = build_srun_command(["a"], 1, binary=None, time_limit_s=90)
    assert "--time=2" in timed and timed[timed.index("--timeout-s") + 1] == "90"
    assert build_srun_command(["a"], 1, binary=None)[-4:-2] == ["--master-addr", "a"]


def test_srun_command_rejects_nonsense():
    with pytest.raises(ValueError):
        build_srun_command([], 1)
    with pytest.raises(ValueError):
        build_srun_command(["a"], 0)


def test_run_group_without_srun_is_skipped():
    result = run_group(["a", "b"], tasks_per_node=1, srun="nodemedic-no-such-srun", binary=FAKE, timeout_s=5)
    assert result.status is Status.SKIPPED and result.name == CHECK and not result.findings
    assert "not found" in result.summary


@pytest.fixture
def fake_srun(tmp_path, monkeypatch):
    """An `srun` that runs the task once as SLURM_PROCID 0 of SLURM_NTASKS, with srun --label's prefix."""
    srun = tmp_path / "srun"
    srun.write_text(f"""#!{sys.executable}
import os, subprocess, sys
args = sys.argv[1:]
first = next(i for i, a in enumerate(args) if not a.startswith("--"))
opts, task = args[:first], args[first:]
ntasks = next(a.split("=", 1)[1] for a in opts if a.startswith("--ntasks="))
env = {{**os.environ, "SLURM_PROCID": "0", "SLURM_NTASKS": ntasks}}
out = subprocess.run(task, env=env, capture_output=True, text=True)
sys.stdout.write("".join("0: " + line + "\\n" for line in out.stdout.splitlines()))
sys.stderr.write(out.stderr)
sys.exit(out.returncode)
""")
    srun.chmod(0o755)
    return str(srun)


@pytest.mark.parametrize("fixture, threshold, status, code", [
    ("h100_single_node_g8.txt", 400.0, Status.PASSED, None),
    ("h100_single_node_g8.txt", 500.0, Status.FAILED, nccl.BUSBW_LOW),
    ("h100_g8_wrong_synthetic.txt", 400.0, Status.FAILED, nccl.WRONG_RESULTS),
    ("init_failure_internal_error.txt", 400.0, Status.ERROR, None),
    ("h100_g8_cut_short_synthetic.txt", 400.0, Status.ERROR, None),
])
def test_run_group_judges_rank_0(fake_srun, monkeypatch, fixture, threshold, status, code):
    monkeypatch.setenv("ALL_REDUCE_PERF_FAKE_OUTPUT", fixture)
    result = run_group(["n1", "n2"], tasks_per_node=2, srun=fake_srun, binary=FAKE, threshold_busbw_gbs=threshold,
                       timeout_s=30)
    assert result.status is status, result.summary
    assert [f.code for f in result.findings] == ([code] if code else [])
    assert result.name == CHECK and result.summary.startswith("2 node(s) n[1-2] x 2 rank(s)")
    if status is not Status.ERROR:
        assert result.metrics["NcclTotalDevices"] == 4 and result.metrics["NcclNodes"] == 2
    assert result.evidence["command"][0] == fake_srun


def test_run_group_nonzero_exit_is_never_a_pass(fake_srun, monkeypatch):
    monkeypatch.setenv("ALL_REDUCE_PERF_FAKE_EXIT", "1")
    result = run_group(["n1"], tasks_per_node=2, srun=fake_srun, binary=FAKE, threshold_busbw_gbs=1.0, timeout_s=30)
    assert result.status is Status.ERROR and "srun exited 1" in result.summary
    assert not result.findings


def test_run_group_worker_without_torch_is_skipped(fake_srun, tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho \"$(hostname): Test failure torch_allreduce.py:1 cannot import torch: "
                      "No module named 'torch'\" >&2\nexit 4\n")
    python.chmod(0o755)
    result = run_group(["n1"], tasks_per_node=2, srun=fake_srun, binary=None, python=str(python), timeout_s=30)
    assert result.status is Status.SKIPPED and "torch is not installed" in result.summary, result.summary
    assert not result.findings


def test_step_env_drops_the_callers_rank_variables(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("NODEMEDIC_KEEP", "yes")
    env = cluster.step_env(None)
    assert "RANK" not in env and "WORLD_SIZE" not in env and env["NODEMEDIC_KEEP"] == "yes"
    assert cluster.step_env({"MASTER_PORT": "1", "PATH": "/bin"}) == {"PATH": "/bin"}


def test_run_group_timeout_is_an_error(fake_srun, monkeypatch):
    monkeypatch.setenv("ALL_REDUCE_PERF_FAKE_SLEEP", "30")
    result = run_group(["n1"], tasks_per_node=1, srun=fake_srun, binary=FAKE, threshold_busbw_gbs=1.0, timeout_s=0.5)
    assert result.status is Status.ERROR and "timed out" in result.summary and not result.findings


# -- bisection ----------------------------------------------------------------------------------------------------

class Script:
    """A scripted run_group: a run fails when it includes a bad node, errors when it includes a broken one."""

    def __init__(self, bad: Iterable[str] = (), broken: Iterable[str] = (), wrong: Iterable[str] = (),
                 all_slow: bool = False):
        self.bad, self.broken, self.wrong, self.all_slow = set(bad), set(broken), set(wrong), all_slow
        self.calls: list[list[str]] = []

    def __call__(self, nodes: list[str]) -> DeepCheckResult:
        self.calls.append(list(nodes))
        metrics = {"NcclMaxAlgoBw": 100.0, "NcclThresholdAlgoBw": 400.0}
        if self.broken & set(nodes):
            return DeepCheckResult(CHECK, Status.ERROR, "srun exited 1: NCCL init failed", metrics={})
        if self.wrong & set(nodes):
            return self._failed(nodes, nccl.WRONG_RESULTS, Severity.CRITICAL, metrics)
        if self.all_slow or self.bad & set(nodes):
            return self._failed(nodes, nccl.BUSBW_LOW, Severity.ERROR, metrics)
        return DeepCheckResult(CHECK, Status.PASSED, "ok", metrics={**metrics, "NcclMaxAlgoBw": 480.0})

    @staticmethod
    def _failed(nodes, code, severity, metrics) -> DeepCheckResult:
        finding = Finding(nccl.CHECK, nccl.NODE, code, f"{code} on {nodes}", severity, {})
        return DeepCheckResult(CHECK, Status.FAILED, f"{code} on {','.join(nodes)}", [finding], metrics)


def nodes(n: int) -> list[str]:
    return [f"n{i}" for i in range(n)]


@pytest.mark.parametrize("count, bad", [(2, "n1"), (4, "n2"), (4, "n1"), (5, "n3"), (5, "n4"), (6, "n5")])
def test_bisect_names_one_bad_node(count, bad):
    script = Script(bad=[bad])
    out = bisect(nodes(count), script)
    if count == 2:
        # One pair and no other: no known-good node to compare with, so no single node is blamed.
        assert out.bad_nodes == [] and out.findings == []
        assert "no known-good node" in out.conclusion
        return
    assert out.bad_nodes == [bad]
    assert set(out.good_nodes) == set(nodes(count)) - {bad}
    assert out.unverified == []
    [finding] = out.findings
    assert finding.component == f"node:{bad}" and finding.code == nccl.BUSBW_LOW and finding.check == CHECK
    assert finding.evidence["vs_known_good"]["nodes"][0] == bad
    assert finding.evidence["known_good"] in out.good_nodes
    # Every pair first, then each member of the failing pair (or the odd one) against a known-good node.
    pairs = [nodes(count)[i:i + 2] for i in range(0, count - 1, 2)]
    assert script.calls[:len(pairs)] == pairs
    assert all(len(c) == 2 for c in script.calls)
    assert len(script.calls) <= len(pairs) + 2 + count % 2
    assert [r.to_dict()["nodes"] for r in out.runs] == script.calls


def test_bisect_odd_one_out_is_tested_against_a_good_node():
    script = Script(bad=["n4"])
    out = bisect(nodes(5), script)
    assert out.bad_nodes == ["n4"]
    assert script.calls[-1] == ["n4", "n0"]
    assert out.runs[-1].purpose == "odd-one-out"
    assert "pair" not in out.findings[0].evidence  # it was in no failing pair


def test_bisect_two_bad_nodes():
    # Both in one pair, and spread over two pairs with a third pair passing as the reference.
    out = bisect(nodes(6), Script(bad=["n2", "n3"]))
    assert out.bad_nodes == ["n2", "n3"]
    out = bisect(nodes(6), Script(bad=["n1", "n4"]))
    assert out.bad_nodes == ["n1", "n4"] and set(out.good_nodes) == {"n0", "n2", "n3", "n5"}
    assert {f.component for f in out.findings} == {"node:n1", "node:n4"}


def test_bisect_all_slow_blames_no_single_node():
    script = Script(all_slow=True)
    out = bisect(nodes(4), script)
    assert out.bad_nodes == [] and out.findings == []
    assert out.unverified == nodes(4)
    assert "no pair passed" in out.conclusion and "no single node is blamed" in out.conclusion
    assert script.calls == [["n0", "n1"], ["n2", "n3"]]  # nothing to test against: no further runs


def test_bisect_error_is_never_blame():
    # n3 cannot run at all (its pair errors): it is unverified, not bad; n1 is slow and named.
    out = bisect(nodes(6), Script(bad=["n1"], broken=["n3"]))
    assert out.bad_nodes == ["n1"]
    assert "n3" not in out.bad_nodes and {"n2", "n3"} <= set(out.unverified)
    assert "no verdict" in out.conclusion
    # An error in a member's own test against the reference does not blame it either.
    script = Script(bad=["n2"], broken=["n3"])
    out = bisect(nodes(4), script)
    assert out.bad_nodes == [] and set(out.unverified) == {"n2", "n3"}


def test_bisect_wrong_results_keep_their_code():
    out = bisect(nodes(4), Script(wrong=["n3"]))
    assert out.bad_nodes == ["n3"]
    assert out.findings[0].code == nccl.WRONG_RESULTS and out.findings[0].severity is Severity.CRITICAL


def test_bisect_pair_that_passes_separately_is_not_blamed():
    class Flaky(Script):
        def __call__(self, nodes):
            if sorted(nodes) == ["n2", "n3"]:
                self.calls.append(list(nodes))
                return self._failed(nodes, nccl.BUSBW_LOW, Severity.ERROR, {})
            return super().__call__(nodes)

    out = bisect(nodes(4), Flaky())
    assert out.bad_nodes == [] and "not blamed: n2,n3" in out.conclusion


def test_bisect_reuses_the_group_result_for_a_single_pair():
    script = Script(bad=["n1"])
    group = script(["n0", "n1"])
    script.calls.clear()
    out = bisect(["n0", "n1"], script, group=group)
    assert script.calls == [] and out.runs[0].status is Status.FAILED


# -- run_cluster --------------------------------------------------------------------------------------------------

def scripted_run(script: Script, thresholds: list[float | None]):
    def run(hosts, *, tasks_per_node, threshold_busbw_gbs, timeout_s, env, **command):
        thresholds.append(threshold_busbw_gbs)
        return script(list(hosts))
    return run


def test_run_cluster_names_the_bad_node():
    thresholds: list[float | None] = []
    result = run_cluster("n[0-4]", instance_type="p5.48xlarge", run=scripted_run(Script(bad=["n3"]), thresholds),
                         timeout_s=60)
    assert result.bad_nodes == ["n3"]
    assert result.result.name == CHECK and result.result.status is Status.FAILED
    assert [f.component for f in result.result.findings] == ["node:n3"]
    assert "bisection names n3" in result.result.summary
    # The group and the pairs are judged against the multi-node threshold of p5.48xlarge.
    assert set(thresholds) == {nccl.threshold_for("p5.48xlarge", 2)}
    record = json.loads(json.dumps(result.record()))
    assert record["bad_nodes"] == ["n3"] and record["status"] == "failed"
    assert record["bisection"]["runs"][0]["nodes"] == ["n0", "n1"]
    assert record["group"]["status"] == "failed"


def test_run_cluster_all_slow_fails_the_group_not_a_node():
    result = run_cluster(["a", "b", "c", "d"], threshold_busbw_gbs=400.0, run=scripted_run(Script(all_slow=True), []))
    assert result.result.status is Status.FAILED and result.bad_nodes == []
    [finding] = result.result.findings
    assert finding.component == "nodes:a,b,c,d" and finding.code == nccl.BUSBW_LOW
    assert "no pair passed" in finding.message


def test_run_cluster_passes_and_errors_are_not_bisected():
    script = Script()
    result = run_cluster(["a", "b", "c"], threshold_busbw_gbs=1.0, run=scripted_run(script, []))
    assert result.result.status is Status.PASSED and result.bisection is None and script.calls == [["a", "b", "c"]]
    script = Script(broken=["b"])
    result = run_cluster(["a", "b", "c"], threshold_busbw_gbs=1.0, run=scripted_run(script, []))
    assert result.result.status is Status.ERROR and result.bisection is None and not result.result.findings
    result = run_cluster(["a", "b", "c"], threshold_busbw_gbs=1.0, bisect_on_failure=False,
                         run=scripted_run(Script(bad=["a"]), []))
    assert result.result.status is Status.FAILED and result.bisection is None
    assert result.result.findings[0].component == "nodes:a,b,c"


def test_run_cluster_pair_threshold_defaults():
    thresholds: list[float | None] = []
    run_cluster(["a", "b", "c", "d"], threshold_busbw_gbs=300.0, run=scripted_run(Script(bad=["d"]), thresholds))
    assert set(thresholds) == {300.0}
    thresholds.clear()
    run_cluster(["a", "b", "c", "d"], threshold_busbw_gbs=300.0, pair_threshold_busbw_gbs=350.0,
                run=scripted_run(Script(bad=["d"]), thresholds))
    assert thresholds == [300.0, 350.0, 350.0, 350.0, 350.0]


# -- Kubernetes ---------------------------------------------------------------------------------------------------

K8S_VERSIONS = ["1.30.0", "latest"]


@pytest.fixture
def rendered():
    return render_k8s_job("gpu[01-03]", image="registry.example/nodemedic:1.0", namespace="health",
                          gpus_per_node=8, efa_per_node=32, threshold_busbw_gbs=438.0, service_account="nodemedic")


def test_k8s_job_validates(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for version in K8S_VERSIONS:
        version = kv.latest_version() if version == "latest" else version
        for obj in rendered:
            kv.validate(obj, version, strict=True)
    assert [d for d in yaml.safe_load_all(dump_yaml(rendered))] == rendered


def test_k8s_job_shape(rendered):
    service, job = rendered
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    spec = job["spec"]
    assert job["metadata"] == {"name": cluster.JOB_NAME, "namespace": "health", "labels": job["metadata"]["labels"]}
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 3
    assert spec["backoffLimit"] == 0 and spec["ttlSecondsAfterFinished"] > 0
    pod = spec["template"]["spec"]
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["subdomain"] == service["metadata"]["name"] and pod["restartPolicy"] == "Never"
    assert pod["serviceAccountName"] == "nodemedic"
    [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "In",
                                         "values": ["gpu01", "gpu02", "gpu03"]}]
    [anti] = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert {"key": "nodemedic.io/node-health-status", "operator": "Exists", "effect": "NoSchedule"} \
        in pod["tolerations"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["WORLD_SIZE"]["value"] == "24"
    assert env["MASTER_ADDR"]["value"] == f"{cluster.JOB_NAME}-0.{service['metadata']['name']}"
    assert env["MASTER_PORT"]["value"] == str(cluster.DEFAULT_PORT)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    script = container["command"][-1]
    assert "-m nodemedic.checks.active.torch_allreduce --backend nccl" in script
    assert "T=8" in script and "RANK=$((NODE_RANK * T + i))" in script
    assert "--threshold 438" in script and "--devices 24" in script


def test_k8s_job_hyperpod_prefix_and_minimal():
    _, job = render_k8s_job(["a"], image="img", taint_prefix="sagemaker.amazonaws.com/", gpus_per_node=0,
                            tasks_per_node=1)
    pod = job["spec"]["template"]["spec"]
    assert pod["tolerations"][0]["key"] == "sagemaker.amazonaws.com/node-health-status"
    assert "serviceAccountName" not in pod and pod["containers"][0]["resources"] == {}


def test_k8s_pod_script_runs_each_rank_and_judges(tmp_path):
    """The pod's shell script, run here with a stand-in worker: ranks numbered per node, the verdict is the exit."""
    _, job = render_k8s_job(["a", "b"], image="img", tasks_per_node=2, threshold_busbw_gbs=400.0,
                            python=sys.executable)
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    worker = shlex.join([sys.executable, "-m", cluster.WORKER_MODULE, "--backend", "nccl", "--min-bytes", "1G",
                         "--max-bytes", "16G", "--factor", "2"])
    fixture = FIXTURES / "h100_single_node_g8.txt"
    stand_in = (f'sh -c \'echo "rank $RANK local $LOCAL_RANK" >&2; '
                f'if [ "$RANK" = 0 ]; then sed -n "1,8p;13,99p" {fixture}; fi\'')
    script = script.replace(worker, stand_in).replace("/tmp/rank-", f"{tmp_path}/rank-")
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                         env={"NODE_RANK": "0", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert "rank 0 local 0" in out.stdout and "rank 1 local 1" in out.stdout
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, out.stdout + out.stderr
    assert record["status"] == "passed" and record["metrics"]["NcclTotalDevices"] == 4
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                         env={"NODE_RANK": "1", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 0 and "rank 2 local 0" in out.stdout and "rank 3 local 1" in out.stdout


def test_judge_cli(tmp_path, capsys):
    path = tmp_path / "out.txt"
    path.write_text((FIXTURES / "h100_g8_wrong_synthetic.txt").read_text())
    assert cluster.main(["judge", str(path), "--nodes", "1", "--devices", "8", "--threshold", "1"]) == 1
    assert json.loads(capsys.readouterr().out)["findings"][0]["code"] == nccl.WRONG_RESULTS
    assert cluster.main(["judge", str(tmp_path / "none"), "--nodes", "1", "--devices", "8"]) == 2
    path.write_text((FIXTURES / "h100_single_node_g8.txt").read_text())
    assert cluster.main(["judge", str(path), "--nodes", "1", "--devices", "8", "--returncode", "3"]) == 2
    assert cluster.main(["judge", str(path), "--nodes", "1", "--devices", "8"]) == 0
