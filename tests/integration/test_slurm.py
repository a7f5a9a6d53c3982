"""The Slurm backend against a real slurmctld + slurmd (Debian's slurm-wlm) on localhost."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from nodemedic.config import load_config
from nodemedic.daemon import Agent, write_command
from nodemedic.model import Action, Health
from nodemedic.policy import Policy
from nodemedic.catalog import load_catalog
from nodemedic.state import StateStore

from conftest import BIN, finding
from fakes.agent import QueueWatcher, running, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def slurm_env(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setattr("nodemedic.config.DEFAULT_CONFIG_PATH", "/nonexistent/nodemedic.yaml")


def make_agent(tmp_path, slurm, **cfg):
    overrides = {"state_dir": str(tmp_path / "state"), "metrics.enabled": False, "imds.enabled": False, "recovery.enabled": False,
                 "actions.backend": "slurm", **cfg}
    w = QueueWatcher()
    agent = Agent(load_config(env={}, path=None, overrides=overrides), checks=[w], boot_id="b1")
    agent.dispatcher._max_backoff_s = 0.5
    return agent, w


def test_fault_drains_with_the_reason_and_recovery_resumes(tmp_path, slurm):
    agent, w = make_agent(tmp_path, slurm)
    with running(agent):
        w.q.put(finding("XID_79", "gpu:0000:3b:00.0"))
        state, reason = slurm.wait_state(("drained",))
        assert reason == "nodemedic: Xid 79 gpu 0000:3b:00.0 (reboot)"
        out = slurm.run("sinfo", "-N", "-o", "%N %T %E").stdout
        assert f"{slurm.node} drained nodemedic: Xid 79 gpu 0000:3b:00.0 (reboot)" in out
        write_command(tmp_path / "state", {"command": "clear", "code": "XID_79"})
        assert slurm.wait_state(("idle",)) == ("idle", "none")


def test_hyperpod_reasons_are_exact_and_a_running_job_finishes(tmp_path, slurm):
    job = slurm.run("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 4").stdout.strip()
    wait_for(lambda: slurm.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "RUNNING", 20)
    agent, w = make_agent(tmp_path, slurm, profile="hyperpod")
    with running(agent):
        w.q.put(finding("NEURON_HBM_UNCORRECTABLE_ERROR", "neuron:3", recommended_action=Action.REPLACE))
        wait_for(lambda: slurm.node_state()[1] == "Action:Replace", what="Action:Replace")
        assert slurm.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "RUNNING"  # not killed
        wait_for(lambda: slurm.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "", 30, "job ended")
        state, reason = slurm.node_state()
        assert reason == "Action:Replace" and state.startswith("fail")


def test_hyperpod_reboot_reason(tmp_path, slurm):
    agent, w = make_agent(tmp_path, slurm, profile="hyperpod")
    with running(agent):
        w.q.put(finding("XID_79"))
        assert slurm.wait_state(("fail",)) == ("fail", "Action:Reboot")


def test_a_foreign_drain_is_never_overwritten_nor_resumed(tmp_path, slurm):
    slurm.scontrol("update", f"nodename={slurm.node}", "state=drain", "reason=admin: bad DIMM, ticket 42")
    agent, w = make_agent(tmp_path, slurm)
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)
        agent.dispatcher.wait_idle(5)
        assert slurm.node_state() == ("drained", "admin: bad DIMM, ticket 42")
        record = json.loads((tmp_path / "state" / "slurm-owned.json").read_text())
        assert record["foreign_reason"] == "admin: bad DIMM, ticket 42"  # recorded, not touched
        write_command(tmp_path / "state", {"command": "clear", "code": "XID_79"})
        wait_for(lambda: agent.state.verdict.health is Health.SCHEDULABLE)
        agent.dispatcher.wait_idle(5)
        time.sleep(0.3)
        assert slurm.node_state() == ("drained", "admin: bad DIMM, ticket 42")


def test_decision_waits_for_slurmctld(tmp_path, slurm):
    agent, w = make_agent(tmp_path, slurm)
    with running(agent):
        slurm.stop_ctld()
        try:
            w.q.put(finding("XID_79"))
            wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT, what="decided while down")
            time.sleep(1.0)  # a few failed attempts
        finally:
            slurm.start_ctld()
        state, reason = slurm.wait_state(("drained",), 20)
        assert reason.startswith("nodemedic: Xid 79")


def test_dry_run_changes_nothing(tmp_path, slurm, caplog):
    agent, w = make_agent(tmp_path, slurm, **{"actions.dry_run": True})
    with running(agent):
        w.q.put(finding("XID_79"))
        wait_for(lambda: agent.state.verdict.health is Health.PENDING_REBOOT)
        agent.dispatcher.wait_idle(5)
    assert slurm.node_state() == ("idle", "none")
    assert f"dry run: would run scontrol update nodename={slurm.node} state=drain 'reason=nodemedic: Xid 79" \
        in caplog.text


def _unhealthy_state(tmp_path):
    from conftest import FakeClock
    state_dir = tmp_path / "state"
    policy = Policy(load_catalog())
    store = StateStore(state_dir)
    state = store.load()
    policy.observe(state, finding("XID_79"), FakeClock()())
    store.save(state)
    return state_dir


def _hook(slurm, state_dir, *args):
    env = dict(slurm.env, NODEMEDIC_STATE_DIR=str(state_dir), NODEMEDIC_IMDS__ENABLED="false",
               NODEMEDIC_CONFIG="/dev/null", SLURM_JOB_ID="77")
    started = time.monotonic()
    out = subprocess.run([str(BIN / "nodemedic"), "slurm", *args], capture_output=True, text=True, env=env,
                         timeout=60)
    return out, time.monotonic() - started


def test_healthcheck_hook_is_fast_and_drains(tmp_path, slurm):
    state_dir = _unhealthy_state(tmp_path)
    out, took = _hook(slurm, state_dir, "healthcheck")
    assert out.returncode == 1 and "UnschedulablePendingReboot" in out.stdout
    assert took < 1.0, f"healthcheck took {took:.2f}s"
    assert slurm.node_state()[0] == "drained"
    healthy, took = _hook(slurm, tmp_path / "nothing-here", "healthcheck")
    assert healthy.returncode == 0 and took < 1.0


def test_prolog_refuses_a_job_on_an_unhealthy_node_and_epilog_records(tmp_path, slurm):
    state_dir = _unhealthy_state(tmp_path)
    out, _ = _hook(slurm, state_dir, "prolog")
    assert out.returncode == 1 and "refusing job 77" in out.stderr
    assert slurm.node_state()[1].startswith("nodemedic:")
    ok, _ = _hook(slurm, tmp_path / "healthy", "prolog")
    assert ok.returncode == 0
    rec, _ = _hook(slurm, state_dir, "epilog")
    assert rec.returncode == 0
    line = (state_dir / "slurm-jobs.jsonl").read_text().splitlines()[-1]
    assert '"job_id": "77"' in line and "XID_79" in line


def test_manual_node_commands(tmp_path, slurm):
    env = dict(slurm.env, NODEMEDIC_STATE_DIR=str(tmp_path / "s"), NODEMEDIC_CONFIG="/dev/null",
               NODEMEDIC_PROFILE="hyperpod")
    nm = str(BIN / "nodemedic")
    assert subprocess.run([nm, "node", "reboot", slurm.node], env=env, capture_output=True).returncode == 0
    assert slurm.node_state() == ("fail", "Action:Reboot")
    refused = subprocess.run([nm, "node", "replace", slurm.node, "--force"], env=env, capture_output=True,
                             text=True, stdin=subprocess.DEVNULL)
    assert refused.returncode == 1 and "--yes" in refused.stderr
    assert subprocess.run([nm, "node", "replace", slurm.node], env=env, capture_output=True).returncode == 0
    assert slurm.node_state() == ("fail", "Action:Replace")
    assert subprocess.run([nm, "node", "resume", slurm.node], env=env, capture_output=True).returncode == 0
    slurm.wait_state(("idle",))
