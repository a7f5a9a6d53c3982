"""Deep-check runs through the agent and `nodemedic diag`: the hold, the published status, findings into the policy,
cancellation that leaves no process, and the Kubernetes and Slurm faces of it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from nodemedic.config import load_config
from nodemedic.daemon import Agent
from nodemedic.model import Health
from nodemedic.policy import DeepCheckRun
from nodemedic.state import StateStore
from nodemedic.telemetry.deep_log import read_records

from conftest import REPO
from fakes.agent import QueueWatcher, running, wait_for
from fakes.kube_apiserver import FakeKubeApiServer
from fakes.processes import new_children

pytestmark = pytest.mark.integration
DCGMI = str(REPO / "tests" / "fakes" / "bin" / "dcgmi-diag")
NODE = "node-1"
KUBE_KEY = "nodemedic.io/node-health-status"
DEEP_LABEL = "nodemedic.io/deep-health-check-status"


@pytest.fixture(autouse=True)
def no_host_config(monkeypatch):
    monkeypatch.setattr("nodemedic.config.DEFAULT_CONFIG_PATH", "/nonexistent/nodemedic.yaml")


def deep_overrides(tmp_path, **cfg):
    """Only the fake DCGM diag and a short CPU stress run: real tools, seconds each."""
    return {"state_dir": str(tmp_path / "state"), "node_name": NODE, "metrics.enabled": False,
            "imds.enabled": False, "recovery.enabled": False, "actions.backend": "local",
            "deep_checks.log_path": str(tmp_path / "log" / "deep.log"), "deep_checks.dcgm.binary": DCGMI,
            "deep_checks.gpu_count.enabled": False, "deep_checks.nccl.enabled": False,
            "deep_checks.efa.enabled": False, "deep_checks.stress.kinds": ["cpu"],
            "deep_checks.stress.duration_s": 2, **cfg}


def make_agent(tmp_path, **cfg):
    agent = Agent(load_config(env={}, path=None, overrides=deep_overrides(tmp_path, **cfg)), checks=[QueueWatcher()],
                  boot_id="b1")
    agent.dispatcher._max_backoff_s = 0.2
    return agent


def local_actions(tmp_path) -> list[tuple[str, str | None]]:
    path = tmp_path / "state" / "local-actions.jsonl"
    return [(r["health"], r["deep_check"]) for r in map(json.loads, path.read_text().splitlines())]


def settled(agent) -> None:
    wait_for(lambda: agent._queue.empty() and agent.deep_run is None and agent.dispatcher.wait_idle(0), 20,
             "agent settled")


def test_a_passing_run_holds_the_node_then_restores_it(tmp_path):
    agent = make_agent(tmp_path)
    with running(agent):
        run = agent.run_deep_checks(2)
        settled(agent)
        assert [str(r.status) for r in run.results] == ["passed", "passed"] and run.status == "Passed"
        assert agent.state.verdict.health is Health.SCHEDULABLE and agent.state.verdict.deep_check == "Passed"
        assert agent.state.deep_run is None
        sample = agent.metrics.registry.get_sample_value
        assert sample("nodemedic_deep_check_runs_total", {"status": "Passed"}) == 1
        assert sample("nodemedic_deep_check_results_total", {"check": "stress.cpu", "status": "passed"}) == 1
    assert local_actions(tmp_path) == [("Schedulable", None), ("Unschedulable", "InProgress"),
                                       ("Schedulable", "Passed")]
    records = read_records(tmp_path / "log" / "deep.log")
    assert [r["event"] for r in records] == ["DeepHealthCheckStarted", "DeepHealthCheckResult",
                                             "DeepHealthCheckResult", "DeepHealthCheckCompleted"]
    assert records[1]["name"] == "dcgm.diag" and records[1]["evidence"]["command"][1:4] == ["diag", "-r", "2"]
    assert records[2]["metrics"]["bogo_ops"] > 0 and records[-1]["status"] == "Passed"


def test_a_failing_test_feeds_the_policy_and_a_later_pass_clears_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DCGMI_DIAG_FAKE_OUTPUT", "dcgm4_r2_fail_synthetic.json")
    agent = make_agent(tmp_path, **{"deep_checks.stress.enabled": False})
    with running(agent):
        run = agent.run_deep_checks(2)
        settled(agent)
        assert run.status == "Failed"
        v = agent.state.verdict
        assert v.deep_check == "Failed" and v.health in (Health.PENDING_REBOOT, Health.PENDING_REPLACEMENT)
        assert any(code.startswith("DCGM_DIAG_") for code in v.fault_reasons)
        monkeypatch.setenv("DCGMI_DIAG_FAKE_OUTPUT", "dcgm4_r2_pass_synthetic.json")
        assert agent.run_deep_checks(2).status == "Passed"
        settled(agent)
        assert not [k for k in agent.state.active if k.startswith("DCGM_DIAG_")]
        assert agent.state.verdict.health is Health.SCHEDULABLE and agent.state.verdict.deep_check == "Passed"


def test_an_aborted_diag_is_error_not_pass_and_not_a_fault(tmp_path, monkeypatch):
    monkeypatch.setenv("DCGMI_DIAG_FAKE_OUTPUT", "dcgm4_runtime_error_synthetic.json")
    agent = make_agent(tmp_path, **{"deep_checks.stress.enabled": False})
    with running(agent):
        run = agent.run_deep_checks(2)
        settled(agent)
        assert run.status == "Error" and agent.state.verdict.health is Health.SCHEDULABLE
        assert [f.code for f in agent.state.active.values()] == ["CHECK_FAILED"]


@pytest.mark.timeout(60)
def test_stopping_the_agent_cancels_the_run_and_leaves_no_process(tmp_path):
    agent = make_agent(tmp_path, **{"deep_checks.dcgm.enabled": False, "deep_checks.stress.duration_s": 60,
                                    "deep_checks.on_start": True})
    with running(agent):
        wait_for(lambda: any("stress-ng" in " ".join(p.cmdline()) for p in new_children()), 15, "stress-ng running")
        started = time.monotonic()
    assert time.monotonic() - started < 20
    wait_for(lambda: not new_children(), 5, "no child processes")
    state = StateStore(tmp_path / "state").load()
    assert state.deep_run is None and state.verdict.deep_check == "Error"
    assert state.verdict.health is Health.SCHEDULABLE
    assert read_records(tmp_path / "log" / "deep.log")[-1]["cancelled"] is True


def test_scheduled_runs_and_a_background_request(tmp_path):
    agent = make_agent(tmp_path, **{"deep_checks.stress.enabled": False, "deep_checks.interval_s": 0.5})
    with running(agent):
        wait_for(lambda: agent.deep_runs >= 2, 30, "two scheduled runs")
    triggers = {r["trigger"] for r in read_records(tmp_path / "log" / "deep.log") if r["event"].endswith("Started")}
    assert triggers == {"schedule"}

    agent = make_agent(tmp_path)
    with running(agent):
        out = cli(tmp_path, "--background", "--only", "dcgm")
        assert out.returncode == 0, out.stderr
        wait_for(lambda: agent.deep_runs == 1 and agent.deep_run is None, 30, "requested run")
        settled(agent)
        assert agent.state.verdict.deep_check == "Passed"
    last = [r for r in read_records(tmp_path / "log" / "deep.log") if r["event"].endswith("Started")][-1]
    assert (last["trigger"], last["tests"]) == ("request", ["dcgm.diag"])
    assert cli(tmp_path, "--background").returncode == 2  # no agent to ask


def test_a_run_interrupted_by_a_crash_is_ended_at_restart(tmp_path):
    store = StateStore(tmp_path / "state")
    store.ensure_dir()
    state = store.load()
    from nodemedic.catalog import load_catalog
    from nodemedic.policy import Policy
    Policy(load_catalog()).deep_check_begin(state, DeepCheckRun(run_id="old", started=0, expires=time.time() + 3600,
                                                                trigger="schedule"), time.time())
    store.save(state)
    agent = make_agent(tmp_path)
    with running(agent):
        assert agent.state.deep_run is None and agent.state.verdict.deep_check == "Error"
        assert agent.state.verdict.health is Health.SCHEDULABLE


def test_one_run_at_a_time(tmp_path):
    agent = make_agent(tmp_path)
    with running(agent):
        agent.command({"command": "deep_check_begin", "run": {"run_id": "cli-1", "started": time.time(),
                                                              "expires": time.time() + 600, "trigger": "cli"}})
        wait_for(lambda: agent.state.deep_run is not None, 5, "held")
        skipped = agent.run_deep_checks(2)
        assert skipped.status == "Error" and "cli-1" in skipped.note and not skipped.results
        out = cli(tmp_path, "--only", "dcgm")
        assert out.returncode == 2 and "cli-1" in out.stderr and "in progress" in out.stderr
        assert agent.state.deep_run.run_id == "cli-1"


def test_an_expired_cli_lease_lifts_the_hold(tmp_path):
    agent = make_agent(tmp_path)
    with running(agent):
        agent.command({"command": "deep_check_begin", "run": {"run_id": "cli-1", "started": time.time(),
                                                              "expires": time.time() + 1.5, "trigger": "cli"}})
        wait_for(lambda: agent.state.verdict.health is Health.UNSCHEDULABLE, 5, "held")
        wait_for(lambda: agent.state.verdict.deep_check == "Error", 10, "lease expired")
        assert agent.state.verdict.health is Health.SCHEDULABLE


def cli(tmp_path, *args, env_extra=None, timeout=120):
    env = {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "NODEMEDIC_CONFIG": str(tmp_path / "cfg.yaml"),
           **(env_extra or {})}
    cfg = {k: v for k, v in deep_overrides(tmp_path).items()}
    import yaml
    doc: dict = {}
    for dotted, value in cfg.items():
        node = doc
        *path, last = dotted.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(doc))
    return subprocess.run([sys.executable, "-m", "nodemedic", "diag", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_cli_diag_while_the_agent_runs_goes_through_its_inbox(tmp_path):
    agent = make_agent(tmp_path)
    with running(agent):
        out = cli(tmp_path, "--only", "stress", "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["status"] == "Passed" and list(report["tests"]) == ["stress.cpu"]
        settled(agent)
        assert agent.state.verdict.deep_check == "Passed" and agent.state.deep_run is None
    assert ("Unschedulable", "InProgress") in local_actions(tmp_path)


def test_cli_diag_without_an_agent_applies_itself_and_exit_codes(tmp_path):
    out = cli(tmp_path, "--only", "dcgm", env_extra={"DCGMI_DIAG_FAKE_OUTPUT": "dcgm4_r2_fail_synthetic.json"})
    assert out.returncode == 1, out.stderr
    assert "dcgm.diag" in out.stdout and "failed" in out.stdout and "Failed" in out.stdout
    state = StateStore(tmp_path / "state").load()
    assert state.verdict.deep_check == "Failed" and state.verdict.health is not Health.SCHEDULABLE
    out = cli(tmp_path, "--only", "dcgm", env_extra={"DCGMI_DIAG_FAKE_OUTPUT": "garbage_synthetic.txt"})
    assert out.returncode == 2 and "Error" in out.stdout
    out = cli(tmp_path, "--only", "nope")
    assert out.returncode == 2 and "unknown deep check" in out.stderr
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    out = cli(tmp_path, "--only", "dcgm", "--state-dir", str(blocker / "state"))
    assert out.returncode == 2 and "could not be held" in out.stdout and "cannot update the state" in out.stdout
    assert "Traceback" not in out.stderr


@pytest.mark.timeout(60)
def test_cli_diag_sigterm_cancels_and_reaps(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "NODEMEDIC_CONFIG": str(tmp_path / "cfg.yaml"),
           "NODEMEDIC_DEEP_CHECKS__STRESS__DURATION_S": "60"}
    cli(tmp_path, "--list")  # writes the config file
    proc = subprocess.Popen([sys.executable, "-m", "nodemedic", "diag", "--only", "stress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any("stress-ng" in " ".join(p.cmdline()) for p in new_children()), 20, "stress-ng running")
    proc.terminate()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    assert "cancelled" in out
    wait_for(lambda: not new_children(), 5, "no child processes")
    state = StateStore(tmp_path / "state").load()
    assert state.verdict.deep_check == "Error" and state.deep_run is None


# -- Kubernetes -----------------------------------------------------------------------------------------------------

@pytest.fixture
def api():
    with FakeKubeApiServer() as server:
        server.add_node(NODE)
        for i in range(9):
            server.add_node(f"other-{i}")
        yield server


def test_kubernetes_label_cordon_and_taint_during_the_run_then_restored(tmp_path, api, monkeypatch):
    # One of ten nodes already held out: a fault would meet the circuit breaker, a deep-check hold does not.
    api.set_node_labels("other-0", {KUBE_KEY: "UnschedulablePendingReboot"})
    monkeypatch.setenv("DCGMI_DIAG_FAKE_SLEEP", "2")
    agent = make_agent(tmp_path, **{"actions.backend": "kubernetes", "actions.kubernetes.api_url": api.url,
                                    "deep_checks.stress.enabled": False})
    seen: list[dict] = []

    def watch() -> None:
        while agent.deep_run is None:
            time.sleep(0.01)
        while agent.deep_run is not None:
            seen.append(api.node(NODE))
            time.sleep(0.05)

    with running(agent):
        t = threading.Thread(target=watch, daemon=True)
        t.start()
        run = agent.run_deep_checks(2)
        t.join(5)
        settled(agent)
        assert run.status == "Passed"
        held = [n for n in seen if n["metadata"]["labels"].get(DEEP_LABEL) == "InProgress"]
        assert held, "the InProgress label was never visible during the run"
        node = held[-1]
        condition = next(c for c in node["status"]["conditions"] if c["type"] == "AcceleratedHardwareReady")
        assert condition["message"] == "nodemedic: Unschedulable (deep health check InProgress)"
        assert node["metadata"]["labels"][KUBE_KEY] == "Unschedulable"
        assert {"key": KUBE_KEY, "value": "Unschedulable", "effect": "NoSchedule"} in node["spec"]["taints"]
        after = api.node(NODE)
        assert after["metadata"]["labels"][DEEP_LABEL] == "Passed"
        assert after["metadata"]["labels"][KUBE_KEY] == "Schedulable"
        assert not after["spec"].get("unschedulable") and not after["spec"].get("taints")


# -- Slurm ----------------------------------------------------------------------------------------------------------

def test_slurm_drain_reason_during_a_cli_run_then_resumed(tmp_path, slurm):
    env = {**slurm.env, "SLURM_CONF": str(slurm.conf), "DCGMI_DIAG_FAKE_SLEEP": "3",
           "NODEMEDIC_ACTIONS__BACKEND": "slurm"}
    cli(tmp_path, "--list")
    proc = subprocess.Popen([sys.executable, "-m", "nodemedic", "diag", "--only", "dcgm"],
                            env={**env, "NODEMEDIC_CONFIG": str(tmp_path / "cfg.yaml"), "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state, reason = slurm.wait_state(("drained", "draining", "drain"), timeout=20)
    assert reason == "nodemedic: deep health check InProgress"
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert slurm.wait_state(("idle",)) == ("idle", "none")
