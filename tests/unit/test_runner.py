"""Check isolation: a check that raises, hangs or lacks its tool becomes a CHECK_FAILED finding."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from nodemedic import runner as runner_mod
from nodemedic.checks.base import CheckUnavailable, Poller, Watcher
from nodemedic.model import CHECK_FAILED, Finding
from nodemedic.runner import CheckRunner

from conftest import finding


class Flaky(Watcher):
    name = "flaky"

    def __init__(self, failures: int, exc: BaseException):
        self.failures = failures
        self.exc = exc
        self.calls = 0

    def watch(self, emit, stop):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        emit(finding("XID_79"))
        stop.wait()


class Returns(Watcher):
    name = "returns"

    def watch(self, emit, stop):
        return None


class Slow(Poller):
    name = "slow"
    timeout_s = 0.2

    def __init__(self):
        self.release = threading.Event()

    def run(self):
        self.release.wait(10)
        return []


class Good(Poller):
    name = "good"

    def run(self):
        return [finding("XID_48")]


class Missing(Poller):
    name = "missing"

    def run(self):
        raise CheckUnavailable("dcgmi not found")


class Broken(Poller):
    name = "broken"

    def run(self):
        raise ZeroDivisionError("oops")


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(runner_mod, "STABLE_AFTER_S", 0.2)


def collect(q: queue.Queue, n: int, timeout: float = 10.0) -> list[Finding]:
    return [q.get(timeout=timeout) for _ in range(n)]


def test_crashing_watcher_is_reported_restarted_and_recovers():
    q: queue.Queue[Finding] = queue.Queue()
    stop = threading.Event()
    w = Flaky(1, RuntimeError("boom"))
    t = CheckRunner(q.put).start_watcher(w, stop)
    failed, fault, recovered = collect(q, 3)
    assert failed.code == CHECK_FAILED and failed.component == "check:flaky" and not failed.healthy
    assert "RuntimeError: boom" in failed.evidence["reason"]
    assert fault.code == "XID_79"
    assert recovered.code == CHECK_FAILED and recovered.healthy
    stop.set()
    t.join(5)
    assert not t.is_alive() and w.calls == 2


def test_unavailable_watcher_is_a_check_failure_not_a_crash():
    q: queue.Queue[Finding] = queue.Queue()
    stop = threading.Event()
    t = CheckRunner(q.put).start_watcher(Flaky(99, CheckUnavailable("no kernel log")), stop)
    f = q.get(timeout=5)
    assert f.code == CHECK_FAILED and f.evidence["reason"] == "no kernel log"
    stop.set()
    t.join(5)


def test_watcher_that_returns_is_restarted():
    q: queue.Queue[Finding] = queue.Queue()
    stop = threading.Event()
    t = CheckRunner(q.put).start_watcher(Returns(), stop)
    assert "stopped unexpectedly" in q.get(timeout=5).evidence["reason"]
    stop.set()
    t.join(5)


def test_poller_results_and_failures():
    durations = []
    r = CheckRunner(lambda f: None, lambda name, s: durations.append(name))
    ok = r.run_once(Good())
    assert [f.code for f in ok] == ["XID_48", CHECK_FAILED] and ok[1].healthy
    missing = r.run_once(Missing())
    assert missing[0].code == CHECK_FAILED and missing[0].evidence["reason"] == "dcgmi not found"
    broken = r.run_once(Broken())
    assert "ZeroDivisionError" in broken[0].evidence["reason"]
    assert durations == ["good", "missing", "broken"]


def test_hung_poller_times_out_and_is_not_run_twice():
    r = CheckRunner(lambda f: None)
    slow = Slow()
    started = time.monotonic()
    out = r.run_once(slow)
    assert time.monotonic() - started < 2
    assert out[0].code == CHECK_FAILED and "timed out after 0.2s" in out[0].evidence["reason"]
    again = r.run_once(slow)
    assert "still hung" in again[0].evidence["reason"]
    slow.release.set()
    time.sleep(0.1)
    assert r.run_once(slow)[-1].healthy
