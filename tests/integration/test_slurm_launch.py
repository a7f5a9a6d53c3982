"""The job's node list and the torchrun launcher, inside real job steps of the one-node test cluster."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import BIN, REPO

pytestmark = pytest.mark.integration

NODEMEDIC = str(BIN / "nodemedic")
LAUNCH = str(REPO / "slurm" / "nodemedic-launch")


@pytest.fixture
def env(slurm) -> dict[str, str]:
    """The cluster's client environment, with no job of the runner's own and nodemedic on PATH."""
    env = {k: v for k, v in slurm.env.items()
           if not (k.startswith("SLURM_") and k != "SLURM_CONF") and not k.startswith("NODEMEDIC_")}
    env["PATH"] = f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def run(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    if args[0] == "srun":
        # Slurm 22.05: a node listing made while the job ran (scontrol show node) leaves slurmctld's cached
        # allocation behind, and `sinfo -n NODE` (the fixture's node_state) then shows the node `mixed` after the
        # job has ended. A full listing recomputes it.
        subprocess.run(["sinfo", "-N"], capture_output=True, env=env, timeout=30, check=True)
    return out


def test_nodelist_inside_a_job_step(slurm, env):
    out = run(["srun", "-N1", NODEMEDIC, "slurm", "nodelist", "--format", "json"], env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["job_id"].isdigit()
    assert got["nodes"] == [slurm.node]
    assert got["master"] == slurm.node
    assert got["master_addr"] == "127.0.0.1"  # the cluster's NodeAddr, not the name
    assert got["num_nodes"] == 1
    assert got["node_rank"] == 0


def test_nodelist_shell_evaluates_inside_a_job_step(slurm, env):
    script = f'eval "$({NODEMEDIC} slurm nodelist)" && echo "$NODEMEDIC_NODES $NODEMEDIC_NUM_NODES ' \
             '$NODEMEDIC_MASTER_ADDR $NODEMEDIC_NODE_RANK $MASTER_ADDR"'
    out = run(["srun", "-N1", "bash", "-c", script], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [slurm.node, "1", "127.0.0.1", "0", "127.0.0.1"]


@pytest.mark.parametrize("extra, nproc, port", [({}, "gpu", "29500"),
                                                ({"NPROC_PER_NODE": "2", "MASTER_PORT": "29611"}, "2", "29611")])
def test_launcher_runs_torchrun_on_the_current_nodes(slurm, env, tmp_path, extra, nproc, port):
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/sh\necho "$SLURM_JOB_ID"\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {**env, "TORCHRUN": str(fake), **extra}
    out = run(["srun", "-N1", LAUNCH, "train.py", "--lr", "1e-4", "two words"], env)
    assert out.returncode == 0, out.stderr
    job_id, *argv = out.stdout.splitlines()
    assert job_id.isdigit()
    assert argv == ["--nnodes", "1", "--node_rank", "0", "--nproc_per_node", nproc,
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", job_id,
                    "train.py", "--lr", "1e-4", "two words"]


def test_outside_a_job(slurm, env):
    out = run([NODEMEDIC, "slurm", "nodelist"], env)
    assert out.returncode == 2
    assert out.stdout == ""
    assert "no job" in out.stderr and "SLURM_JOB_ID is unset" in out.stderr

    out = run([LAUNCH, "train.py"], env)
    assert out.returncode == 2
    assert "not inside a Slurm job" in out.stderr


def test_unknown_and_pending_jobs(slurm, env):
    out = run([NODEMEDIC, "slurm", "nodelist", "--job", "987654"], env)
    assert out.returncode == 2
    assert "Invalid job id specified" in out.stderr

    held = slurm.run("sbatch", "--hold", "-o", "/dev/null", "--parsable", "--wrap", "true").stdout.strip()
    try:
        out = run([NODEMEDIC, "slurm", "nodelist", "--job", held], env)
        assert out.returncode == 2
        assert f"job {held}: no nodes allocated yet (JobState=PENDING Reason=JobHeldUser)" in out.stderr
    finally:
        slurm.run("scancel", held, check=False)
