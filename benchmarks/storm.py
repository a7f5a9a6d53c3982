"""Storm of one repeated Xid: one decision, bounded memory — in-process, then through the running agent."""

from __future__ import annotations

import gc
import os
import threading
import time

from corpus import component, syslog, xid_79
from harness import MIB, AgentProcess, Result, RssSampler, Sizes, check, info, mib, rate

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


def _append_storm(path: os.PathLike[str], lines: int, errors: list[BaseException]) -> None:
    """Append `lines` identical Xid lines in CHUNK_LINES-line writes."""
    chunk = ((syslog(xid_79(DOMAIN, BUS)) + "\n") * CHUNK_LINES).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            for start in range(0, lines, CHUNK_LINES):
                n = min(CHUNK_LINES, lines - start)
                os.write(fd, chunk if n == CHUNK_LINES else chunk[: len(chunk) // CHUNK_LINES * n])
        finally:
            os.close(fd)
    except BaseException as exc:  # reported by the caller, which is polling the agent meanwhile
        errors.append(exc)


def _wait_findings(agent: AgentProcess, lines: int) -> float | None:
    """Poll the agent's findings counter until it reaches `lines`; the seconds that took, or None on timeout."""
    started = time.perf_counter()
    deadline = started + AGENT_TIMEOUT_S
    while time.perf_counter() < deadline and agent.alive:
        if agent.metric_sum("nodemedic_findings_total", code="XID_79") >= lines:
            return time.perf_counter() - started
        time.sleep(POLL_S)
    return None


def _through_agent(lines: int) -> tuple[int, float | None, RssSampler]:
    """(detection events, seconds until all findings were counted, RSS) for the storm through the agent."""
    with AgentProcess() as agent:
        time.sleep(1.0)  # let the file watcher open the log: lines before that are never read
        errors: list[BaseException] = []
        with RssSampler(agent.pid, interval_s=0.05) as rss:
            writer = threading.Thread(target=_append_storm, args=(agent.kernel_log, lines, errors), daemon=True)
            writer.start()
            seconds = _wait_findings(agent, lines)
            writer.join()
            time.sleep(QUIET_S)
        if errors:
            raise errors[0]
        if seconds is None:
            raise RuntimeError(f"the agent did not count {lines:,} findings within {AGENT_TIMEOUT_S:g}s: "
                               f"{agent.diagnostics()}")
        events = sum(1 for _, e in agent.detections if e.get("component") == component(DOMAIN, BUS))
    return events, seconds, rss


def run(sizes: Sizes) -> list[Result]:
    n = sizes.storm_lines
    decisions, seconds, rss = _in_process(n)
    results = [
        check(NAME, f"in-process: decisions from {n:,} lines", str(decisions), "1", decisions == 1),
        info(NAME, "in-process: classifier + policy", rate(n, seconds)),
        check(NAME, "in-process: peak RSS growth", mib(rss.growth), f"<= {mib(TARGET_GROWTH)}",
              rss.growth <= TARGET_GROWTH),
    ]
    events, agent_s, agent_rss = _through_agent(n)
    assert agent_s is not None
    return results + [
        check(NAME, "agent: detection events", str(events), "1", events == 1),
        info(NAME, f"agent: time to count {n:,} findings", f"{agent_s:.1f} s ({rate(n, agent_s)})"),
        info(NAME, "agent: peak RSS", mib(agent_rss.peak)),
        check(NAME, "agent: peak RSS growth", mib(agent_rss.growth), f"<= {mib(TARGET_GROWTH)}",
              agent_rss.growth <= TARGET_GROWTH),
    ]
