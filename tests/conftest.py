from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from nodemedic.catalog import load_catalog
from nodemedic.model import Finding, Severity
from nodemedic.policy import Policy, PolicyConfig, PolicyState

# Every test's leftover-process checks count only what that test started (see fakes/processes.py).
from fakes.processes import existing_children  # noqa: E402,F401 (an autouse fixture)

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent
BIN = Path(sys.executable).parent


class FakeClock:
    def __init__(self, start: float = 1_700_000_000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def catalog():
    return load_catalog()


@pytest.fixture
def policy(catalog) -> Policy:
    return Policy(catalog, PolicyConfig())


@pytest.fixture
def state() -> PolicyState:
    return PolicyState()


def finding(code: str, component: str = "gpu:0000:3b:00.0", *, check: str = "kernel_log", healthy: bool = False,
            **kw) -> Finding:
    return Finding(check=check, component=component, code=code, message=kw.pop("message", code),
                   severity=kw.pop("severity", Severity.ERROR), healthy=healthy, **kw)


def kernel_samples() -> list[dict]:
    return yaml.safe_load((FIXTURES / "kernel_log" / "samples.yaml").read_text())


@pytest.fixture
def agent_env(tmp_path) -> dict[str, str]:
    """Environment for a nodemedic subprocess: no IMDS lookups, no config file from the host."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODEMEDIC_")}
    env.update(NODEMEDIC_IMDS__ENABLED="false", NODEMEDIC_CONFIG=str(tmp_path / "empty.yaml"),
               NODEMEDIC_RECOVERY__SOCKET=str(tmp_path / "run" / "recovery.sock"), PYTHONUNBUFFERED="1")
    (tmp_path / "empty.yaml").write_text("{}\n")
    return env


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """One real slurmctld + slurmd for the whole session (Debian's slurm-wlm, auth/none, localhost)."""
    from slurm_cluster import SlurmCluster, available

    why = available()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm(slurm_cluster):
    """The cluster, with its node idle and reason-free before and after the test."""
    slurm_cluster.reset_node()
    yield slurm_cluster
    slurm_cluster.reset_node()
