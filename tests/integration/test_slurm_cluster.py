"""The real Slurm cluster the Slurm tests use comes up, drains and runs jobs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_cluster_runs_jobs_and_drains(slurm):
    assert slurm.node_state() == ("idle", "none")
    out = slurm.run("srun", "-N1", "hostname", timeout=60)
    assert out.stdout.strip() == slurm.node
    slurm.scontrol("update", f"nodename={slurm.node}", "state=drain", "reason=test drain")
    assert slurm.wait_state(("drained",)) == ("drained", "test drain")
