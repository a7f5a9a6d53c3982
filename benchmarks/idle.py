"""Idle footprint: CPU and memory of an agent following a quiet kernel log."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from harness import MIB, AgentProcess, Result, Sizes, check, info, mib

NAME = "idle"
TARGET_CPU_PCT = 0.2
TARGET_RSS = 64 * MIB


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _switches(pid: int) -> int:
    """Context switches of every thread: psutil's count covers only the main thread on Linux."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        total += sum(int(line.split()[1]) for line in text.splitlines() if "ctxt_switches" in line)
    return total


def run(sizes: Sizes) -> list[Result]:
    with AgentProcess() as agent:
        time.sleep(sizes.settle_s)
        proc = agent.process()
        cpu0, sw0, t0 = _cpu_s(proc), _switches(proc.pid), time.monotonic()
        time.sleep(sizes.idle_s)
        cpu1, sw1, t1 = _cpu_s(proc), _switches(proc.pid), time.monotonic()
        rss = proc.memory_info().rss
        threads = proc.num_threads()
    wall = t1 - t0
    cpu_pct = 100.0 * (cpu1 - cpu0) / wall
    return [
        check(NAME, f"CPU over {wall:.0f} s (% of one core)", f"{cpu_pct:.3f} %", f"<= {TARGET_CPU_PCT} %",
              cpu_pct <= TARGET_CPU_PCT),
        check(NAME, "RSS", mib(rss), f"<= {mib(TARGET_RSS)}", rss <= TARGET_RSS),
        info(NAME, "wake-ups (context switches, all threads)", f"{(sw1 - sw0) / wall:.1f} /s"),
        info(NAME, "threads", str(threads)),
    ]
