"""In-process recovery vs a full process restart: 4 gloo ranks of a small model on CPU.

In-process: the (fake) node agent sends `fault` to every rank; measured from just before the send until every rank
is back in its training loop (re-initialised process group, state agreed), as each rank stamps it in the job's store.
Process restart: SIGKILL every rank, relaunch them, init the process group, load the state from a checkpoint file;
measured from just before the kill until every new rank is in its training loop.
The ranks are this file run as a script: `python recovery.py <inproc|restart> <rank> <world> <port> <dir> <tag> <sock>`.
"""

from __future__ import annotations

import importlib.util

import datetime
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Result, Sizes, check, info, ms

NAME = "recovery"
WORLD = 4
TARGET_INPROC_S = 1.0
TARGET_RATIO = 10.0


# -- the rank --------------------------------------------------------------------------------------------------------

def _worker(mode: str, rank: int, world: int, port: int, workdir: Path, tag: int, sock: str) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    state = {"step": 0}
    ckpt = workdir / "ckpt.pt"

    def train_step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(flat)
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / world)
            offset += p.numel()

    def loop(generation: int, atomic) -> None:
        store.set(f"bench/back/{generation}/{rank}", repr(time.time()))
        while not store.check(["bench/stop"]):
            train_step()
            with atomic():
                opt.step()
                state["step"] += 1
            if mode == "restart" and rank == 0 and state["step"] == 5 and not ckpt.exists():
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": state["step"]}, ckpt)
                store.set("bench/ckpt", "1")

    if mode == "restart":
        dist.init_process_group("gloo", store=dist.PrefixStore(f"launch/{tag}", store), rank=rank, world_size=world)
        if ckpt.exists():
            saved = torch.load(ckpt)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state["step"] = saved["step"]
        import contextlib
        loop(tag, contextlib.nullcontext)
        dist.destroy_process_group()
        return

    from nodemedic.recovery import Wrapper

    @Wrapper(store=store, rank=rank, world_size=world, socket_path=sock, hard_timeout_s=30, max_restarts=100)
    def train(ctx):
        ctx.init_process_group("gloo")
        step = torch.tensor([state["step"]])
        dist.all_reduce(step, op=dist.ReduceOp.MIN)  # agree on the step to continue from (state is in memory)
        state["step"] = int(step)
        loop(ctx.iteration, ctx.atomic)
        dist.destroy_process_group()

    train()


# -- the driver ------------------------------------------------------------------------------------------------------

class _Job:
    def __init__(self, workdir: Path, mode: str, sock: str = ""):
        import torch.distributed as dist

        self.workdir, self.mode, self.sock = workdir, mode, sock
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.procs: list[subprocess.Popen] = []

    def launch(self, tag: int) -> None:
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        env.pop("NODEMEDIC_RECOVERY_SOCKET", None)
        self.procs = [subprocess.Popen([sys.executable, __file__, self.mode, str(r), str(WORLD), str(self.store.port),
                                        str(self.workdir), str(tag), self.sock],
                                       stdout=subprocess.DEVNULL, stderr=open(self.workdir / f"{self.mode}-{r}.log", "a"),
                                       env=env) for r in range(WORLD)]

    def wait_back(self, generation: int, timeout: float = 120) -> float:
        """When the last rank stamped that it is back in its training loop (epoch seconds)."""
        keys = [f"bench/back/{generation}/{r}" for r in range(WORLD)]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in self.procs):
                raise RuntimeError(f"{self.mode} ranks did not come back for generation {generation}")
            time.sleep(0.002)
        return max(float(self.store.get(k).decode()) for k in keys)

    def wait_key(self, key: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {key}")
            time.sleep(0.01)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(30)

    def finish(self) -> None:
        self.store.set("bench/stop", "1")
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def _in_process(workdir: Path, faults: int) -> list[float]:
    from nodemedic.recovery_server import RecoveryServer  # the agent's own socket server, not a stand-in

    agent = RecoveryServer(str(workdir / "agent.sock"))
    agent.start()
    job = _Job(workdir, "inproc", str(agent.path))
    try:
        job.launch(0)
        job.wait_back(0)
        deadline = time.monotonic() + 30
        while len(agent.ranks()) < WORLD:
            if time.monotonic() > deadline:
                raise RuntimeError("ranks did not register with the agent")
            time.sleep(0.01)
        samples = []
        for generation in range(1, faults + 1):
            time.sleep(0.3)  # some training between faults
            sent = time.time()
            agent.broadcast_fault("BENCH", "gpu:0", "benchmark fault")
            samples.append(job.wait_back(generation) - sent)
        job.finish()
        return samples
    finally:
        job.kill()
        agent.stop()


def _process_restart(workdir: Path, restarts: int) -> list[float]:
    job = _Job(workdir, "restart")
    try:
        job.launch(0)
        job.wait_back(0)
        job.wait_key("bench/ckpt")
        samples = []
        for tag in range(1, restarts + 1):
            sent = time.time()
            job.kill()
            job.launch(tag)
            samples.append(job.wait_back(tag) - sent)
        job.finish()
        return samples
    finally:
        job.kill()


def run(sizes: Sizes) -> list[Result]:
    if importlib.util.find_spec("torch") is None:
        return [info(NAME, "skipped", "torch is not installed (pip install 'nodemedic[torch]')")]
    faults = 5 if sizes.injections >= 100 else 3
    with tempfile.TemporaryDirectory() as tmp:
        inproc = _in_process(Path(tmp), faults)
    with tempfile.TemporaryDirectory() as tmp:
        restart = _process_restart(Path(tmp), 2)
    inproc_s, restart_s = statistics.median(inproc), statistics.median(restart)
    ratio = restart_s / inproc_s if inproc_s > 0 else float("inf")
    return [
        check(NAME, f"in-process recovery, {WORLD} gloo ranks (median of {faults})", ms(inproc_s),
              f"<= {ms(TARGET_INPROC_S)}", inproc_s <= TARGET_INPROC_S),
        info(NAME, "in-process recovery, worst", ms(max(inproc))),
        info(NAME, f"process restart + checkpoint reload (median of {len(restart)})", ms(restart_s)),
        check(NAME, "process restart / in-process", f"{ratio:.1f}x", f">= {TARGET_RATIO:g}x", ratio >= TARGET_RATIO),
    ]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("inproc", "restart"):
        m, r_, w_, p_, d_, t_, s_ = sys.argv[1:8]
        _worker(m, int(r_), int(w_), int(p_), Path(d_), int(t_), s_)
    else:
        from harness import QUICK

        for row in run(QUICK):
            print(row)
