"""Log-storm throughput: a realistic mix (10 % fault lines) through the classifier, then through the watcher."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

from corpus import mixed_pool
from harness import Result, Sizes, check, info, rate

from nodemedic.checks.kernel_log import KernelLogWatcher
from nodemedic.checks.kernel_log.parser import KernelLogClassifier
from nodemedic.checks.kernel_log.sources import FileSource
from nodemedic.model import Finding

NAME = "throughput"
TARGET_LINES_PER_S = 200_000
POOL = 10_000                # distinct lines, repeated to the requested count
WATCH_TIMEOUT_S = 120.0


def _classify(pool: list[str], repeats: int) -> tuple[int, float]:
    """(findings, seconds) for classifying the pool `repeats` times."""
    classify = KernelLogClassifier().classify
    now = time.time()
    found = 0
    started = time.perf_counter()
    for _ in range(repeats):
        for line in pool:
            if classify(line, now) is not None:
                found += 1
    return found, time.perf_counter() - started


def _write(path: Path, pool: list[str], repeats: int) -> None:
    blob = ("\n".join(pool) + "\n").encode()
    with open(path, "wb") as fh:
        for _ in range(repeats):
            fh.write(blob)


def _watch(path: Path, expected: int) -> tuple[int, float]:
    """(findings, seconds) for KernelLogWatcher to read the file from its start until `expected` findings."""
    stop = threading.Event()
    count = 0

    def emit(_finding: Finding) -> None:
        nonlocal count
        count += 1
        if count >= expected:
            stop.set()

    watchdog_timer = threading.Timer(WATCH_TIMEOUT_S, stop.set)
    watchdog_timer.start()
    watcher = KernelLogWatcher(source=FileSource(path, from_start=True))
    started = time.perf_counter()
    try:
        watcher.watch(emit, stop)
    finally:
        watchdog_timer.cancel()
    return count, time.perf_counter() - started


def run(sizes: Sizes) -> list[Result]:
    pool = mixed_pool(POOL)
    repeats = max(1, sizes.throughput_lines // POOL)
    total = repeats * POOL
    faults = total // 10
    found, seconds = _classify(pool, repeats)
    lps = total / seconds
    results = [
        check(NAME, "classifier: fault lines recognised", f"{found:,}/{faults:,}", f"{faults:,}", found == faults),
        check(NAME, f"classifier: {total:,} lines, 10% faults", rate(total, seconds),
              f">= {TARGET_LINES_PER_S:,} lines/s", lps >= TARGET_LINES_PER_S),
    ]
    tmp = Path(tempfile.mkdtemp(prefix="nodemedic-bench-"))
    try:
        path = tmp / "kern.log"
        _write(path, pool, repeats)
        watched, seconds = _watch(path, faults)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results += [
        check(NAME, "watcher: findings emitted", f"{watched:,}/{faults:,}", f"{faults:,}", watched == faults),
        info(NAME, "watcher: file -> findings", rate(total, seconds)),
    ]
    return results
