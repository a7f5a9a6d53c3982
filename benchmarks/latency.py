"""Detection latency: a fault line appended to the followed log, until its detection event is on stdout."""

from __future__ import annotations

import os
import random
import time

from corpus import component, syslog, xid_79
from harness import AgentProcess, Result, Sizes, append_fd, check, info, ms, percentile

NAME = "latency"
TARGET_P99_S = 0.100
WAIT_S = 5.0                 # a detection later than this counts as missed
SPACING_S = (0.020, 0.050)


def _gpu(i: int) -> tuple[int, int]:
    """A distinct (domain, bus) per measured injection, so each one is a new fault and a new decision."""
    return 1 + i // 256, i % 256


def _inject(agent: AgentProcess, fd: int, domain: int, bus: int, wait_s: float = WAIT_S) -> float | None:
    """Append one Xid 79 line; seconds until its detection arrived, or None if it never did."""
    os.write(fd, (syslog(xid_79(domain, bus)) + "\n").encode())
    written = time.perf_counter()
    arrived = agent.wait_detection(component(domain, bus), wait_s)
    return None if arrived is None else arrived - written


def run(sizes: Sizes) -> list[Result]:
    rng = random.Random(7)
    with AgentProcess() as agent:
        fd = append_fd(agent.kernel_log)
        try:
            samples, missed = [], 0
            for i in range(sizes.injections):
                time.sleep(rng.uniform(*SPACING_S))
                latency = _inject(agent, fd, *_gpu(i))
                if latency is None:
                    missed += 1
                else:
                    samples.append(latency)
        finally:
            os.close(fd)
    return _report(samples, missed, sizes.injections)


def _report(samples: list[float], missed: int, injected: int) -> list[Result]:
    if not samples:
        return [check(NAME, "detections received", f"0/{injected}", f"{injected}/{injected}", False)]
    p99 = percentile(samples, 99)
    return [
        check(NAME, "detections received", f"{len(samples)}/{injected}", f"{injected}/{injected}", missed == 0),
        info(NAME, "detection latency p50", ms(percentile(samples, 50))),
        check(NAME, "detection latency p99", ms(p99), f"<= {ms(TARGET_P99_S)}", p99 <= TARGET_P99_S),
        info(NAME, "detection latency max", ms(max(samples))),
    ]
