"""The Kubernetes backend against the fake API server (tests/fakes/kube_apiserver): API traffic and latency."""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import Result, Sizes, check, info, ms, percentile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakes.agent import QueueWatcher  # noqa: E402
from fakes.kube_apiserver import FakeKubeApiServer  # noqa: E402

from nodemedic.config import load_config  # noqa: E402
from nodemedic.daemon import Agent, write_command  # noqa: E402
from nodemedic.model import Finding, Severity  # noqa: E402

NAME = "kube"
NODE = "bench-node"
KEY = "nodemedic.io/node-health-status"
TARGET_LATENCY_P99_S = 0.500
TARGET_WRITES_PER_FAULT = 3



def _xid79(bus: int) -> Finding:
    return Finding("kernel_log", f"gpu:0000:{bus:02x}:00.0", "XID_79", "Xid 79", Severity.CRITICAL)


def _tainted(api: FakeKubeApiServer) -> bool:
    return any(t.get("key") == KEY for t in api.node(NODE).get("spec", {}).get("taints") or [])


def _wait(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.001)
    return False


def run(sizes: Sizes) -> list[Result]:
    logging.getLogger("nodemedic").setLevel(logging.ERROR)  # the agent runs in-process: keep its log off the table
    faults = max(20, sizes.injections // 4)
    quiet_s = 10.0 if sizes.injections < 100 else 30.0
    with FakeKubeApiServer() as api, tempfile.TemporaryDirectory() as tmp:
        api.add_node(NODE)
        config = load_config(env={}, path="/dev/null", overrides={
            "state_dir": str(Path(tmp) / "state"), "node_name": NODE, "metrics.enabled": False,
            "imds.enabled": False, "recovery.enabled": False, "actions.backend": "kubernetes", "actions.kubernetes.api_url": api.url})
        inject = QueueWatcher()
        agent = Agent(config, checks=[inject], boot_id="bench")
        agent.start()
        loop = threading.Thread(target=agent.loop, daemon=True)
        loop.start()
        try:
            _wait(lambda: api.node(NODE)["metadata"].get("labels", {}).get(KEY) == "Schedulable")
            agent.dispatcher.wait_idle(10)
            api.reset_requests()
            time.sleep(quiet_s)
            healthy = list(api.requests)
            latencies, writes_per_fault = [], []
            for i in range(faults):
                api.reset_requests()
                sent = time.perf_counter()
                inject.q.put(_xid79(i % 256))
                if _wait(lambda: _tainted(api)):
                    latencies.append(time.perf_counter() - sent)
                agent.dispatcher.wait_idle(10)
                writes_per_fault.append(len(api.writes()))
                write_command(Path(tmp) / "state", {"command": "clear", "code": "XID_79"})
                _wait(lambda: not _tainted(api))
                agent.dispatcher.wait_idle(10)
        finally:
            agent._stop.set()
            loop.join(5)
            agent.stop()
    per_hour = 3600 / quiet_s
    healthy_writes = sum(1 for r in healthy if r.method != "GET")
    p99 = percentile(latencies, 99) if latencies else float("inf")
    worst = max(writes_per_fault) if writes_per_fault else 0
    return [
        check(NAME, "API writes per hour while healthy", f"{healthy_writes * per_hour:.0f}", "0",
              healthy_writes == 0),
        info(NAME, "API requests per hour while healthy, besides the node watch (one long poll, 60 s)",
             f"{len(healthy) * per_hour:.0f}"),
        check(NAME, f"API writes per fault (max of {faults})", str(worst), f"<= {TARGET_WRITES_PER_FAULT}",
              worst <= TARGET_WRITES_PER_FAULT),
        info(NAME, "detection -> taint latency p50", ms(percentile(latencies, 50)) if latencies else "n/a"),
        check(NAME, "detection -> taint latency p99", ms(p99), f"<= {ms(TARGET_LATENCY_P99_S)}",
              p99 <= TARGET_LATENCY_P99_S and len(latencies) == faults),
    ]
