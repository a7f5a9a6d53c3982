"""Leftover-process checks: what a test started and left running, not what the test process already had."""

from __future__ import annotations

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
