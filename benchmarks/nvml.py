"""NVML checks through the fake pynvml (tests/fakes/nvml.py): event-to-finding latency, poller CPU per cycle."""

from __future__ import annotations

import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import Result, Sizes, check, info, ms, percentile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakes import nvml as fake_mod  # noqa: E402
from fakes.nvml import FakeNvml  # noqa: E402
from fakes.sysfs import hgx_node  # noqa: E402

from nodemedic.checks.nvidia.nvml import NvmlEventWatcher, NvmlPoller  # noqa: E402

NAME = "nvml"
TARGET_P99_S = 0.050
POLL_INTERVAL_S = 30.0  # the poller's default period, to express its cost as a share of one core


def _event_latencies(events: int) -> list[float]:
    nvml = FakeNvml()
    arrived: queue.Queue[float] = queue.Queue()
    watcher = NvmlEventWatcher(nvml)
    stop = threading.Event()
    t = threading.Thread(target=watcher.watch, args=(lambda f: arrived.put(time.perf_counter()), stop), daemon=True)
    t.start()
    if not watcher.wait_ready(5):
        raise RuntimeError("NVML event watcher did not start")
    samples = []
    for i in range(events):
        sent = time.perf_counter()
        nvml.post_event(i % 8, fake_mod.nvmlEventTypeXidCriticalError, 79)
        samples.append(arrived.get(timeout=5) - sent)
        time.sleep(0.001)
    stop.set()
    t.join(5)
    return samples


def _poll_cpu(cycles: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        hgx_node(Path(tmp))
        poller = NvmlPoller(FakeNvml(), expected_gpus=8, nvlinks_per_gpu=18, sysfs_root=tmp)
        poller.run()
        started = time.process_time()
        for _ in range(cycles):
            poller.run()
        return (time.process_time() - started) / cycles


def run(sizes: Sizes) -> list[Result]:
    events = max(200, sizes.injections * 5)
    samples = _event_latencies(events)
    p99 = percentile(samples, 99)
    per_cycle = _poll_cpu(200)
    return [
        info(NAME, f"event -> finding latency p50 ({events} events)", ms(percentile(samples, 50))),
        check(NAME, "event -> finding latency p99", ms(p99), f"<= {ms(TARGET_P99_S)}", p99 <= TARGET_P99_S),
        info(NAME, "poller CPU per cycle, 8 GPUs", f"{per_cycle * 1000:.2f} ms"),
        info(NAME, f"poller CPU at a {POLL_INTERVAL_S:g} s period", f"{per_cycle / POLL_INTERVAL_S * 100:.4f} % of a core"),
    ]
