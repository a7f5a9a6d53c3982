"""Storm of one repeated Xid: one decision, bounded memory — in-process, then through the running agent."""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass

from corpus import component, syslog, xid_79
from harness import MIB, AgentProcess, Result, RssSampler, Sizes, append_fd, check, info, mib, rate

from nodemedic.catalog import load_catalog
from nodemedic.checks.kernel_log.parser import KernelLogClassifier
from nodemedic.policy import Policy, PolicyState

NAME = "storm"
TARGET_GROWTH = 32 * MIB
CHUNK_LINES = 10_000         # lines per write: a storm arrives in bursts far bigger than one line
AGENT_TIMEOUT_S = 180.0
POLL_S = 0.25
QUIET_S = 1.0                # after the storm, wait this long for a late (wrong) second decision
DOMAIN, BUS = 0x00aa, 0x3b
CANARY = (0x00bb, 0x3b)      # a different GPU's fault, appended behind the storm


def _in_process(lines: int) -> tuple[int, float, RssSampler]:
    """(decisions, seconds, RSS) for classifier + policy over `lines` copies of one Xid 79 line."""
    line = syslog(xid_79(DOMAIN, BUS))
    classify = KernelLogClassifier().classify
    policy, state = Policy(load_catalog()), PolicyState()
    decisions = 0
    gc.collect()
    with RssSampler() as rss:
        started = time.perf_counter()
        for _ in range(lines):
            now = time.time()
            finding = classify(line, now)
            if finding is not None and policy.observe(state, finding, now) is not None:
                decisions += 1
        seconds = time.perf_counter() - started
    return decisions, seconds, rss


class StormWriter(threading.Thread):
    """Appends `lines` identical Xid lines in CHUNK_LINES-line writes, then one line for a different GPU."""

    def __init__(self, path: os.PathLike[str], lines: int):
        super().__init__(name="storm-writer", daemon=True)
        self.path = path
        self.lines = lines
        self.error: BaseException | None = None
        self.canary_written: float | None = None  # perf_counter time the different GPU's line was appended

    def run(self) -> None:
        chunk = ((syslog(xid_79(DOMAIN, BUS)) + "\n") * CHUNK_LINES).encode()
        per_line = len(chunk) // CHUNK_LINES
        try:
            fd = append_fd(self.path)
            try:
                for start in range(0, self.lines, CHUNK_LINES):
                    os.write(fd, chunk[: per_line * min(CHUNK_LINES, self.lines - start)])
                os.write(fd, (syslog(xid_79(*CANARY)) + "\n").encode())
                self.canary_written = time.perf_counter()
            finally:
                os.close(fd)
        except BaseException as exc:  # reported by the caller, which polls the agent meanwhile
            self.error = exc


def _wait_findings(agent: AgentProcess, lines: int) -> float | None:
    """Poll the agent's findings counter until it reaches `lines`; the seconds that took, or None on timeout."""
    started = time.perf_counter()
    deadline = started + AGENT_TIMEOUT_S
    while time.perf_counter() < deadline and agent.alive:
        if agent.metric_sum("nodemedic_findings_total", code="XID_79") >= lines:
            return time.perf_counter() - started
        time.sleep(POLL_S)
    return None


@dataclass
class AgentStorm:
    """What the storm through the agent produced."""

    events: int                  # detection events for the storming GPU
    seconds: float               # until the agent had counted every storm line as a finding
    canary_s: float | None       # append-to-detection of the other GPU's fault that queued behind the storm
    rss: RssSampler


def _through_agent(lines: int) -> AgentStorm:
    """Append the storm to the followed log and watch the agent's stdout, metrics and RSS."""
    with AgentProcess() as agent:
        with RssSampler(agent.pid, interval_s=0.05) as rss:
            writer = StormWriter(agent.kernel_log, lines)
            writer.start()
            seconds = _wait_findings(agent, lines)
            writer.join()
            canary = agent.wait_detection(component(*CANARY), AGENT_TIMEOUT_S if seconds else 0)
            time.sleep(QUIET_S)
        if writer.error is not None:
            raise writer.error
        if seconds is None:
            raise RuntimeError(f"the agent did not count {lines:,} findings within {AGENT_TIMEOUT_S:g}s: "
                               f"{agent.diagnostics()}")
        events = sum(1 for _, e in agent.detections if e.get("component") == component(DOMAIN, BUS))
    canary_s = None if canary is None or writer.canary_written is None else canary - writer.canary_written
    return AgentStorm(events, seconds, canary_s, rss)


def run(sizes: Sizes) -> list[Result]:
    n = sizes.storm_lines
    decisions, seconds, rss = _in_process(n)
    results = [
        check(NAME, f"in-process: decisions from {n:,} lines", str(decisions), "1", decisions == 1),
        info(NAME, "in-process: classifier + policy", rate(n, seconds)),
        check(NAME, "in-process: peak RSS growth", mib(rss.growth), f"<= {mib(TARGET_GROWTH)}",
              rss.growth <= TARGET_GROWTH),
    ]
    a = _through_agent(n)
    return results + [
        check(NAME, "agent: detection events", str(a.events), "1", a.events == 1),
        info(NAME, f"agent: time to count {n:,} findings", f"{a.seconds:.1f} s ({rate(n, a.seconds)})"),
        info(NAME, "agent: other GPU's fault behind the storm",
             "not detected" if a.canary_s is None else f"detected after {a.canary_s:.1f} s"),
        info(NAME, "agent: peak RSS", mib(a.rss.peak)),
        check(NAME, "agent: peak RSS growth", mib(a.rss.growth), f"<= {mib(TARGET_GROWTH)}",
              a.rss.growth <= TARGET_GROWTH),
    ]
