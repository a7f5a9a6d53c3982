"""Leftover-process checks: what a test started and left running, not what the test process already had."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from typing import Iterator

import psutil
import pytest

_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def existing_children():
    """Processes this test process already had (the session's Slurm daemons) are not this test's leftovers."""
    _BEFORE.clear()
    _BEFORE.update(p.pid for p in psutil.Process().children(recursive=True))
    yield


def new_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in _BEFORE]


# Set in every process a test starts (it inherits the environment), so that a leftover is found even after it was
# re-parented to init, where children() no longer sees it. Not NODEMEDIC_*: the agent would read it as a setting.
TAG_ENV = "LEFTOVER_TEST_TAG"


@pytest.fixture
def process_tag(monkeypatch) -> str:
    value = uuid.uuid4().hex
    monkeypatch.setenv(TAG_ENV, value)
    return value


def tagged(value: str) -> list[psutil.Process]:
    """Live processes (not this one) whose environment carries the tag."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TAG_ENV) == value:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def assert_nothing_left(value: str, within_s: float = 10.0) -> None:
    """Neither a child of this test nor any tagged process is still alive (after up to `within_s` to exit)."""
    deadline = time.monotonic() + within_s
    while (new_children() or tagged(value)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert new_children() == []
    assert tagged(value) == []


@contextlib.contextmanager
def cancelled_after(seconds: float) -> Iterator[threading.Event]:
    """Run the block under a cancel scope that is cancelled `seconds` in (nodemedic.checks.tools.cancel_scope)."""
    from nodemedic.checks.tools import cancel_scope

    event = threading.Event()
    timer = threading.Timer(seconds, event.set)
    timer.start()
    try:
        with cancel_scope(event):
            yield event
    finally:
        timer.cancel()
