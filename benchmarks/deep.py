"""Deep-check runner: how fast a cancel leaves no process behind, what the runner adds per test, and the hold.

Cancel: a real stress-ng CPU run (forked workers in its own process group) and a launcher with a grandchild are
cancelled mid-run; the figure is the time from cancel to the test returning with none of their processes alive.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from harness import Result, Sizes, check, info, ms, percentile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

NAME = "deep"
TARGET_CANCEL_S = 5.0          # stress-ng and launchers get SIGTERM, then SIGKILL after 3 s
TARGET_OVERHEAD_S = 0.05       # per test, on top of the test's own work
TARGET_HOLD_S = 1.0            # run requested -> the node's verdict held (local backend applied)


def _alive(pids: set[int]) -> bool:
    return any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def _timed_cancel(args: list[str]) -> float:
    """Seconds from cancel.set() to run_test returning with every process of the tool gone."""
    from nodemedic.checks.active.base import DeepCheckResult, Status
    from nodemedic.checks.tools import run_tool
    from nodemedic.diag import DeepTest, run_test

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    cancel = threading.Event()
    marks: dict[str, float] = {}
    seen: set[int] = set()

    def run() -> DeepCheckResult:
        run_tool(args, 120)
        return DeepCheckResult("bench", Status.PASSED, "")

    def trigger() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            kids = {p.pid for p in me.children(recursive=True)} - before
            if len(kids) >= 2:
                time.sleep(0.3)  # let the workers get going
                seen.update({p.pid for p in me.children(recursive=True)} - before)
                break
            time.sleep(0.01)
        marks["cancel"] = time.monotonic()
        cancel.set()

    t = threading.Thread(target=trigger, daemon=True)
    t.start()
    result = run_test(DeepTest("bench", run, 120), cancel)
    returned = time.monotonic()
    t.join()
    if result.status is not Status.ERROR or _alive(seen):
        raise AssertionError(f"cancel left {result.status} with processes {seen}")
    return returned - marks["cancel"]


def _overhead(tests: int) -> float:
    from nodemedic.checks.active.base import DeepCheckResult, Status
    from nodemedic.diag import DeepTest, DiagRun, run_plan
    from nodemedic.telemetry.deep_log import DeepCheckLog

    plan = [DeepTest(f"t{i}", lambda i=i: DeepCheckResult(f"t{i}", Status.PASSED, "ok"), 10) for i in range(tests)]
    with tempfile.TemporaryDirectory() as tmp:
        log = DeepCheckLog(Path(tmp) / "deep.log", "bench")
        run = DiagRun("bench", 2, "bench", time.time())
        started = time.perf_counter()
        run_plan(plan, run, threading.Event(), log)
        elapsed = time.perf_counter() - started
        log.close()
    return elapsed / tests


def _hold_latency(samples: int) -> list[float]:
    from nodemedic.config import load_config
    from nodemedic.daemon import Agent

    from fakes.agent import QueueWatcher, running, wait_for

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(env={}, path="/dev/null", overrides={
            "state_dir": tmp, "metrics.enabled": False, "imds.enabled": False, "recovery.enabled": False,
            "actions.backend": "local", "deep_checks.log_path": f"{tmp}/deep.log"})
        agent = Agent(cfg, checks=[QueueWatcher()], boot_id="b")
        with running(agent):
            for i in range(samples):
                started = time.perf_counter()
                agent.command({"command": "deep_check_begin", "run": {"run_id": f"r{i}", "started": time.time(),
                                                                      "expires": time.time() + 60}})
                wait_for(lambda: agent.state.verdict.deep_check == "InProgress" and agent.dispatcher.wait_idle(0),
                         10, "held")
                out.append(time.perf_counter() - started)
                agent.command({"command": "deep_check_end", "run_id": f"r{i}", "status": "Passed"})
                wait_for(lambda: agent.state.verdict.deep_check == "Passed", 10, "released")
    return out


def run(sizes: Sizes) -> list[Result]:
    rounds = 3 if sizes.injections < 100 else 5
    results: list[Result] = []
    launcher = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"]
    cancels = [_timed_cancel(launcher) for _ in range(rounds)]
    results.append(check(NAME, f"cancel -> launcher and grandchild gone (max of {rounds})", ms(max(cancels)),
                         f"< {TARGET_CANCEL_S:g} s", max(cancels) < TARGET_CANCEL_S))
    if shutil.which("stress-ng"):
        stress = [_timed_cancel(["stress-ng", "--cpu", "2", "--timeout", "120"]) for _ in range(rounds)]
        results.append(check(NAME, f"cancel -> stress-ng and its workers gone (max of {rounds})", ms(max(stress)),
                             f"< {TARGET_CANCEL_S:g} s", max(stress) < TARGET_CANCEL_S))
    else:
        results.append(info(NAME, "stress-ng cancel", "skipped: stress-ng not installed"))
    per_test = _overhead(200)
    results.append(check(NAME, "runner overhead per test (thread, log record)", ms(per_test),
                         f"< {TARGET_OVERHEAD_S * 1000:g} ms", per_test < TARGET_OVERHEAD_S))
    holds = _hold_latency(20)
    p99 = percentile(holds, 99)
    results.append(check(NAME, "run begins -> node held (local backend), p99", ms(p99), f"< {TARGET_HOLD_S:g} s",
                         p99 < TARGET_HOLD_S))
    return results
