"""Driving the agent in-process: a watcher tests feed findings into, and the agent's loop in a thread."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Callable, Iterator

from nodemedic.checks.base import Watcher


class QueueWatcher(Watcher):
    """Stands in for the kernel-log watcher: whatever is put on `q` is emitted as the check's finding."""

    name = "kernel_log"

    def __init__(self) -> None:
        self.q: queue.Queue[Any] = queue.Queue()

    def watch(self, emit, stop) -> None:  # type: ignore[no-untyped-def]
        while not stop.is_set():
            try:
                emit(self.q.get(timeout=0.05))
            except queue.Empty:
                pass


@contextlib.contextmanager
def running(agent: Any) -> Iterator[Any]:
    """The agent started, its loop in a thread, stopped on the way out."""
    agent.start()
    t = threading.Thread(target=agent.loop, daemon=True)
    t.start()
    try:
        yield agent
    finally:
        agent._stop.set()
        t.join(5)
        agent.stop()


def wait_for(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} not met in {timeout:g}s")
