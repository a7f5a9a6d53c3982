"""In-process recovery with real torch.distributed gloo groups in several processes (CPU).

The test process hosts the job's TCPStore (so no rank owns it and any rank may die) and, where needed, a fake node agent
on a Unix socket; the ranks are this file run as a script (`python test_recovery_gloo.py <scenario> ...`).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from nodemedic.recovery import RESTART_EXIT_CODE, Wrapper  # noqa: E402
from nodemedic.recovery_server import RecoveryServer  # noqa: E402

pytestmark = pytest.mark.integration
STEPS = 6
WIDTH = 4


# -- the rank (run as a script) --------------------------------------------------------------------------------------

def expected_weights(world: int, steps: int = STEPS) -> list[int]:
    """What a fault-free run ends with: each step adds sum over ranks of (rank + 1) * (step + 1)."""
    per_step = sum(r + 1 for r in range(world))
    return [per_step * sum(s + 1 for s in range(steps))] * WIDTH


def worker(scenario: str, rank: int, world: int, port: int, out: Path, sock: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    shrink = scenario == "kill-shrink"
    wrapper = Wrapper(store=store, rank=rank, world_size=world, socket_path=sock or False, hard_timeout_s=20,
                      barrier_timeout_s=1.5, shrink=shrink, max_restarts=2, abort_timeout_s=3)
    # training state lives in memory across re-executions: weights after every applied step
    history = {0: torch.zeros(WIDTH, dtype=torch.int64)}
    last = {"step": 0}

    @wrapper
    def train(ctx):
        ctx.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
        step = torch.tensor([last["step"]])
        if ctx.iteration:  # agree on the last step every rank applied, roll back to it
            dist.all_reduce(step, op=dist.ReduceOp.MIN)
        step = int(step)
        weights = history[step].clone()
        for s in range(step, STEPS):
            grad = torch.full((WIDTH,), (ctx.initial_rank + 1) * (s + 1), dtype=torch.int64)
            if ctx.iteration == 0 and s == 2:
                misbehave(scenario, ctx, store)
            dist.all_reduce(grad)
            with ctx.atomic():
                weights += grad
                history[s + 1] = weights.clone()
                last["step"] = s + 1
        dist.destroy_process_group()  # on faults the wrapper's abort tears the groups down
        return weights.tolist(), ctx.iteration, ctx.rank, ctx.world_size

    weights, iteration, new_rank, new_world = train()
    (out / f"{rank}.json").write_text(json.dumps({
        "weights": weights, "iteration": iteration, "rank": new_rank, "world": new_world,
        "sources": [f.source for f in wrapper.faults], "deliveries": wrapper.deliveries}))


def misbehave(scenario: str, ctx, store) -> None:
    r = ctx.initial_rank
    if scenario == "raise" and r == 1:
        raise RuntimeError("rank 1 lost its data loader")
    if scenario == "agent":
        if r == 0:
            store.set("test/blocked", "1")  # and then blocks in the all_reduce: rank 1 never joins it
        else:
            store.set("test/computing", "1")
            end = time.monotonic() + 15
            while time.monotonic() < end:  # "computes" until the fault is injected
                sum(range(1000))
            raise AssertionError("fault never delivered")
    if scenario.startswith("kill") and r == ctx.initial_world_size - 1:
        store.set("test/victim", str(os.getpid()))
        time.sleep(60)  # SIGKILLed here


# -- the test side ---------------------------------------------------------------------------------------------------

class Job:
    def __init__(self, tmp_path: Path, scenario: str, world: int, agent: RecoveryServer | None = None):
        self.out = tmp_path
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("NODEMEDIC_RECOVERY_SOCKET", None)
        self.procs = [subprocess.Popen(
            [sys.executable, __file__, scenario, str(r), str(world), str(self.store.port), str(tmp_path),
             str(agent.path) if agent else ""],
            stdout=open(tmp_path / f"{r}.log", "w"), stderr=subprocess.STDOUT, env=env) for r in range(world)]

    def wait_key(self, key: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while not self.store.check([key]):
            assert time.monotonic() < deadline, f"no {key}: {self.logs()}"
            assert all(p.poll() is None for p in self.procs), f"a rank exited early: {self.logs()}"
            time.sleep(0.01)
        return self.store.get(key).decode()

    def wait(self, timeout: float = 45) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(max(0.1, deadline - time.monotonic())) for p in self.procs]

    def result(self, rank: int) -> dict:
        return json.loads((self.out / f"{rank}.json").read_text())

    def logs(self) -> str:
        return "\n".join(f"--- rank {p}\n" + p.read_text()[-3000:] for p in sorted(self.out.glob("*.log")))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        del self.store


@pytest.fixture
def job(tmp_path):
    jobs = []

    def start(*args, **kw) -> Job:
        jobs.append(Job(tmp_path, *args, **kw))
        return jobs[-1]

    yield start
    for j in jobs:
        j.close()


def test_rank_raises_all_reexecute_and_match_a_fault_free_run(job):
    j = job("raise", 3)
    assert j.wait() == [0, 0, 0], j.logs()
    results = [j.result(r) for r in range(3)]
    assert all(r["weights"] == expected_weights(3) for r in results), results
    assert all(r["iteration"] == 1 for r in results)
    assert results[1]["sources"] == ["local"]


def test_agent_fault_reaches_a_rank_blocked_in_all_reduce_and_a_computing_one(job, tmp_path):
    agent = RecoveryServer(str(tmp_path / "agent.sock"))  # the agent's own socket server
    agent.start()
    try:
        j = job("agent", 2, agent)
        j.wait_key("test/blocked")
        j.wait_key("test/computing")
        time.sleep(0.2)  # rank 0 is inside the all_reduce by now
        deadline = time.monotonic() + 10
        while len(agent.ranks()) < 2:
            assert time.monotonic() < deadline, j.logs()
            time.sleep(0.01)
        agent.broadcast_fault("XID_13", "gpu:0", "graphics engine exception")
        assert j.wait() == [0, 0], j.logs()
    finally:
        agent.stop()
    results = [j.result(r) for r in range(2)]
    assert all(r["iteration"] == 1 and r["weights"] == expected_weights(2) for r in results), results
    assert all(r["sources"][0] in ("agent", "store") for r in results)
    assert results[1]["deliveries"] == 1  # the computing rank got exactly one injected exception


def test_sigkilled_peer_survivors_exit_with_restart_code(job):
    j = job("kill-exit", 2)
    os.kill(int(j.wait_key("test/victim")), signal.SIGKILL)
    assert j.wait() == [RESTART_EXIT_CODE, -signal.SIGKILL], j.logs()


def test_sigkilled_peer_survivors_shrink_and_reexecute(job):
    j = job("kill-shrink", 3)
    os.kill(int(j.wait_key("test/victim")), signal.SIGKILL)
    assert j.wait() == [0, 0, -signal.SIGKILL], j.logs()
    a, b = j.result(0), j.result(1)
    assert (a["rank"], a["world"], b["rank"], b["world"]) == (0, 2, 1, 2)
    assert a["weights"] == b["weights"] and a["iteration"] == b["iteration"] == 1


if __name__ == "__main__":
    name, rank_, world_, port_, out_, sock_ = sys.argv[1:7]
    worker(name, int(rank_), int(world_), int(port_), Path(out_), sock_)
