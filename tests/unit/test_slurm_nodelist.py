"""`nodemedic slurm nodelist`: parsing recorded Slurm 22.05 output, resolving through a fake scontrol, printing."""

from __future__ import annotations

import json
import re
import subprocess
from argparse import Namespace

import pytest

from nodemedic import slurm_nodelist as sn
from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import ToolResult

# `scontrol show job 4242` for a running two-node GPU job, Slurm 22.05 (HyperPod-style node names).
JOB_RUNNING = """\
JobId=4242 JobName=train
   UserId=ubuntu(1000) GroupId=ubuntu(1000) MCS_label=N/A
   Priority=4294901756 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=01:02:03 TimeLimit=UNLIMITED TimeMin=N/A
   SubmitTime=2024-05-02T09:14:11 EligibleTime=2024-05-02T09:14:11
   AccrueTime=2024-05-02T09:14:11
   StartTime=2024-05-02T09:14:12 EndTime=Unknown Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2024-05-02T09:14:12 Scheduler=Main
   Partition=dev AllocNode:Sid=ip-10-1-0-10:31337
   ReqNodeList=(null) ExcNodeList=ip-10-1-7
   NodeList=ip-10-1-[2-3]
   BatchHost=ip-10-1-2
   NumNodes=2 NumCPUs=384 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=384,mem=3900000M,node=2,billing=384,gres/gpu=16
   Socks/Node=* NtasksPerN:B:S:C=1:0:*:* CoreSpec=*
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   OverSubscribe=NO Contiguous=0 Licenses=(null) Network=(null)
   Command=/fsx/ubuntu/train.sbatch
   WorkDir=/fsx/ubuntu
   StdErr=/fsx/ubuntu/train-4242.out
   StdIn=/dev/null
   StdOut=/fsx/ubuntu/train-4242.out
   Power=
   TresPerNode=gres:gpu:8
   

"""

# The same job with `scontrol -o show job 4242`: one line per record.
JOB_RUNNING_ONELINE = " ".join(JOB_RUNNING.split()) + " \n"

# Slurm 22.05 prints an empty NodeList= for a job that has not started (older releases print (null)).
JOB_PENDING = """\
JobId=4243 JobName=train
   UserId=ubuntu(1000) GroupId=ubuntu(1000) MCS_label=N/A
   Priority=4294901755 Nice=0 Account=(null) QOS=(null)
   JobState=PENDING Reason=Resources Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A
   SubmitTime=2024-05-02T10:00:00 EligibleTime=2024-05-02T10:00:00
   AccrueTime=2024-05-02T10:00:00
   StartTime=Unknown EndTime=Unknown Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2024-05-02T10:00:01 Scheduler=Main
   Partition=dev AllocNode:Sid=ip-10-1-0-10:31337
   ReqNodeList=(null) ExcNodeList=(null)
   NodeList=
   NumNodes=2-2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=2,mem=3900000M,node=2,billing=2,gres/gpu=16
   Socks/Node=* NtasksPerN:B:S:C=1:0:*:* CoreSpec=*
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   OverSubscribe=NO Contiguous=0 Licenses=(null) Network=(null)
   Command=/fsx/ubuntu/train.sbatch
   WorkDir=/fsx/ubuntu
   StdErr=/fsx/ubuntu/train-4243.out
   StdIn=/dev/null
   StdOut=/fsx/ubuntu/train-4243.out
   Power=
   TresPerNode=gres:gpu:8
   

"""

# `scontrol show job 4300` of an array: one record per task, the job's own last.
JOB_ARRAY_ONELINE = (
    "JobId=4301 ArrayJobId=4300 ArrayTaskId=1 JobName=sweep JobState=RUNNING Reason=None "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=ip-10-1-5 BatchHost=ip-10-1-5 NumNodes=1 \n"
    "JobId=4300 ArrayJobId=4300 ArrayTaskId=0 JobName=sweep JobState=RUNNING Reason=None "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=ip-10-1-4 BatchHost=ip-10-1-4 NumNodes=1 \n"
)

# `scontrol show node ip-10-1-2`, Slurm 22.05.
NODE = """\
NodeName=ip-10-1-2 Arch=x86_64 CoresPerSocket=48 
   CPUAlloc=192 CPUEfctv=192 CPUTot=192 CPULoad=54.20
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres=gpu:8
   NodeAddr=10.1.0.2 NodeHostName=ip-10-1-2 Version=22.05.8
   OS=Linux 5.15.0-1051-aws #56~20.04.1-Ubuntu SMP Tue Nov 28 15:43:31 UTC 2023 
   RealMemory=1950000 AllocMem=1950000 FreeMem=1812345 Sockets=2 Boards=1
   State=ALLOCATED ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=dev 
   BootTime=2024-05-01T08:00:00 SlurmdStartTime=2024-05-01T08:01:00
   LastBusyTime=2024-05-02T09:14:12
   CfgTRES=cpu=192,mem=1950000M,billing=192,gres/gpu=8
   AllocTRES=cpu=192,mem=1950000M,gres/gpu=8
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
   

"""


def keys(text: str) -> list[str]:
    """The field names of a scontrol record, in order: its shape, whatever the values."""
    return re.findall(r"(?:^|\s)([A-Za-z][\w/:]*)=", text)


def is_subsequence(small: list[str], big: list[str]) -> bool:
    it = iter(big)
    return all(k in it for k in small)


class FakeScontrol:
    """Stands in for run_tool: answers scontrol calls from a table, records them."""

    def __init__(self, answers: dict[tuple[str, ...], tuple[int, str, str] | Exception]):
        self.answers = answers
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> ToolResult:
        self.calls.append((args, timeout_s))
        answer = self.answers[tuple(args)]
        if isinstance(answer, Exception):
            raise answer
        rc, out, err = answer
        return ToolResult(tuple(args), rc, out, err)


HOSTNAMES = (0, "ip-10-1-2\nip-10-1-3\n", "")


@pytest.fixture
def scontrol(monkeypatch):
    fake = FakeScontrol({
        ("scontrol", "show", "job", "4242"): (0, JOB_RUNNING, ""),
        ("scontrol", "show", "hostnames", "ip-10-1-[2-3]"): HOSTNAMES,
        ("scontrol", "show", "node", "ip-10-1-2"): (0, NODE, ""),
    })
    monkeypatch.setattr(sn, "run_tool", fake)
    monkeypatch.setenv("SLURMD_NODENAME", "ip-10-1-3")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return fake


# -- parsing ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [JOB_RUNNING, JOB_RUNNING_ONELINE], ids=["multiline", "oneliner"])
def test_nodelist_of_a_running_job(text):
    # ExcNodeList=ip-10-1-7 sits just before NodeList=: only the exact key counts.
    assert sn.parse_job_nodelist(text, "4242") == "ip-10-1-[2-3]"


def test_req_nodelist_is_not_the_nodelist():
    text = JOB_RUNNING.replace("ReqNodeList=(null)", "ReqNodeList=ip-10-1-9")
    assert sn.parse_job_nodelist(text, "4242") == "ip-10-1-[2-3]"


@pytest.mark.parametrize("text", [JOB_PENDING, JOB_PENDING.replace("NodeList=\n", "NodeList=(null)\n")],
                         ids=["empty", "null"])
def test_pending_job_has_no_nodes(text):
    with pytest.raises(sn.NodeListError, match=r"no nodes allocated yet \(JobState=PENDING Reason=Resources\)"):
        sn.parse_job_nodelist(text, "4243")


def test_requeued_pending_job_with_its_old_nodes_is_refused():
    text = JOB_RUNNING.replace("JobState=RUNNING Reason=None", "JobState=PENDING Reason=BeginTime")
    with pytest.raises(sn.NodeListError, match="PENDING"):
        sn.parse_job_nodelist(text, "4242")


def test_array_job_picks_its_own_record():
    assert sn.parse_job_nodelist(JOB_ARRAY_ONELINE, "4300") == "ip-10-1-4"
    assert sn.parse_job_nodelist(JOB_ARRAY_ONELINE, "4301") == "ip-10-1-5"
    assert sn.parse_job_nodelist(JOB_ARRAY_ONELINE, "4300_1") == "ip-10-1-5"  # no JobId match: the first record


def test_no_record():
    with pytest.raises(sn.NodeListError, match="no record"):
        sn.parse_job_nodelist("\n", "1")


def test_node_addr():
    assert sn.parse_node_addr(NODE) == "10.1.0.2"
    assert sn.parse_node_addr(" ".join(NODE.split())) == "10.1.0.2"
    assert sn.parse_node_addr(NODE.replace("NodeAddr=10.1.0.2 ", "")) is None


def test_hostnames_keep_slurm_order():
    assert sn.parse_hostnames("b\na\n\nc\n") == ["b", "a", "c"]


def test_node_rank():
    assert sn.node_rank(["a", "b", "c"], ["c"]) == 2
    assert sn.node_rank(["a", "b"], ["x", "b"]) == 1
    assert sn.node_rank(["a", "b"], ["login"]) is None


# -- resolve --------------------------------------------------------------------------------------------------------
def test_resolve(scontrol):
    jn = sn.resolve("4242", 7.5)
    assert jn == sn.JobNodes(job_id="4242", nodes=["ip-10-1-2", "ip-10-1-3"], master="ip-10-1-2",
                             master_addr="10.1.0.2", num_nodes=2, node_rank=1)
    assert [c[0][1:3] for c in scontrol.calls] == [["show", "job"], ["show", "hostnames"], ["show", "node"]]
    assert {c[1] for c in scontrol.calls} == {7.5}


def test_master_addr_falls_back_to_the_name(scontrol):
    scontrol.answers[("scontrol", "show", "node", "ip-10-1-2")] = (1, "Node ip-10-1-2 not found\n", "")
    assert sn.resolve("4242", 5).master_addr == "ip-10-1-2"
    scontrol.answers[("scontrol", "show", "node", "ip-10-1-2")] = (0, NODE.replace("NodeAddr=10.1.0.2 ", ""), "")
    assert sn.resolve("4242", 5).master_addr == "ip-10-1-2"


def test_rank_from_short_hostname(scontrol, monkeypatch):
    monkeypatch.delenv("SLURMD_NODENAME")
    monkeypatch.setattr(sn.socket, "gethostname", lambda: "ip-10-1-2.ec2.internal")
    assert sn.resolve("4242", 5).node_rank == 0
    monkeypatch.setattr(sn.socket, "gethostname", lambda: "login-1")
    assert sn.resolve("4242", 5).node_rank is None


def test_scontrol_errors(scontrol):
    scontrol.answers[("scontrol", "show", "job", "4242")] = (
        1, "", "slurm_load_jobs error: Invalid job id specified\n")
    with pytest.raises(sn.NodeListError, match="exited 1: slurm_load_jobs error: Invalid job id specified"):
        sn.resolve("4242", 5)
    scontrol.answers[("scontrol", "show", "job", "4242")] = CheckUnavailable("scontrol timed out after 5s")
    with pytest.raises(sn.NodeListError, match="timed out"):
        sn.resolve("4242", 5)


# -- main -----------------------------------------------------------------------------------------------------------
def args(**kw) -> Namespace:
    return Namespace(**{"job": "4242", "format": "shell", "timeout": 30.0, **kw})


def test_main_shell(scontrol, capsys):
    assert sn.main(args()) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "export NODEMEDIC_NODES=ip-10-1-2,ip-10-1-3",
        "export NODEMEDIC_NUM_NODES=2",
        "export NODEMEDIC_MASTER_ADDR=10.1.0.2",
        "export NODEMEDIC_NODE_RANK=1",
        "export MASTER_ADDR=10.1.0.2",
    ]


def test_shell_output_is_quoted_for_eval():
    jn = sn.JobNodes(job_id="1", nodes=["a", "b"], master="a", master_addr="x'; touch /tmp/pwned; '$(id)",
                     num_nodes=2, node_rank=None)
    script = "\n".join([*sn.shell_lines(jn),
                        'printf "%s|%s|%s" "$MASTER_ADDR" "$NODEMEDIC_NODE_RANK" "$NODEMEDIC_NODES"'])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out == "x'; touch /tmp/pwned; '$(id)||a,b"


def test_main_json_and_hosts(scontrol, capsys):
    assert sn.main(args(format="json")) == 0
    assert json.loads(capsys.readouterr().out) == {
        "job_id": "4242", "nodes": ["ip-10-1-2", "ip-10-1-3"], "master": "ip-10-1-2", "master_addr": "10.1.0.2",
        "num_nodes": 2, "node_rank": 1}
    assert sn.main(args(format="hosts")) == 0
    assert capsys.readouterr().out == "ip-10-1-2\nip-10-1-3\n"


def test_main_job_from_environment(scontrol, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert sn.main(args(job=None, format="hosts")) == 0
    assert capsys.readouterr().out == "ip-10-1-2\nip-10-1-3\n"


def test_main_without_a_job(scontrol, capsys):
    assert sn.main(args(job=None)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "SLURM_JOB_ID is unset" in captured.err and "--job" in captured.err
    assert scontrol.calls == []


def test_main_scontrol_failure(scontrol, capsys):
    scontrol.answers[("scontrol", "show", "job", "4242")] = CheckUnavailable("scontrol not found")
    assert sn.main(args()) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "nodemedic: job 4242: scontrol not found\n"


def test_main_pending(monkeypatch, capsys):
    monkeypatch.setattr(sn, "run_tool", FakeScontrol({("scontrol", "show", "job", "4243"): (0, JOB_PENDING, "")}))
    assert sn.main(args(job="4243")) == 2
    assert "no nodes allocated yet (JobState=PENDING Reason=Resources)" in capsys.readouterr().err


# -- the recorded samples have the real cluster's shape ---------------------------------------------------------------
@pytest.mark.integration
def test_samples_match_real_scontrol_output(slurm):
    """Every field the real 22.05 cluster prints appears in the samples, in the same order, in both output styles."""
    real = slurm.run("srun", "-N1", "bash", "-c",
                     "scontrol show job $SLURM_JOB_ID; echo ---; scontrol -o show job $SLURM_JOB_ID",
                     timeout=60).stdout
    multi, one = real.split("---\n")
    assert len(one.strip().splitlines()) == 1
    for real_text, sample in ((multi, JOB_RUNNING), (one, JOB_RUNNING_ONELINE)):
        assert is_subsequence(keys(real_text), keys(sample)), (keys(real_text), keys(sample))
        job_id = re.search(r"JobId=(\d+)", real_text).group(1)
        assert sn.parse_job_nodelist(real_text, job_id) == slurm.node

    node = slurm.scontrol("show", "node", slurm.node).stdout
    assert is_subsequence(keys(node), keys(NODE)), (keys(node), keys(NODE))
    assert sn.parse_node_addr(node) == "127.0.0.1"

    held = slurm.run("sbatch", "--hold", "-o", "/dev/null", "--parsable", "--wrap", "true").stdout.strip()
    try:
        pending = slurm.scontrol("show", "job", held).stdout
        assert is_subsequence(keys(pending), keys(JOB_PENDING)), (keys(pending), keys(JOB_PENDING))
        with pytest.raises(sn.NodeListError, match="JobState=PENDING"):
            sn.parse_job_nodelist(pending, held)
    finally:
        slurm.run("scancel", held, check=False)
