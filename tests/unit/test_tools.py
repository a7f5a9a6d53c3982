from __future__ import annotations

import pytest

from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import run_tool


def test_run_tool_captures_output_and_exit_code():
    r = run_tool(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=5)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")


def test_missing_tool_and_timeout_are_unavailable():
    with pytest.raises(CheckUnavailable, match="not found"):
        run_tool(["no-such-tool-here"], timeout_s=1)
    with pytest.raises(CheckUnavailable, match="timed out after 0.2s"):
        run_tool(["sleep", "5"], timeout_s=0.2)


def test_follow_tool_batches_idle_ticks_stop_and_exit():
    import threading

    from nodemedic.checks.tools import ToolExited, follow_tool

    stop = threading.Event()
    seen: list[list[str]] = []
    for batch in follow_tool(["sh", "-c", "echo a; echo b; sleep 30"], stop, poll_s=0.05):
        seen.append(batch)
        if sum(len(b) for b in seen) >= 2 and [] in seen:  # both lines, then a quiet tick
            stop.set()
    assert [line for b in seen for line in b] == ["a", "b"]
    with pytest.raises(ToolExited) as exc:
        for _ in follow_tool(["sh", "-c", "echo bye; exit 4"], threading.Event(), poll_s=0.05):
            pass
    assert exc.value.returncode == 4 and exc.value.tail == ["bye"]


def test_timeout_kills_the_whole_process_group(tmp_path):
    import os
    import time

    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(CheckUnavailable, match="timed out"):
        run_tool(["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"], timeout_s=0.5)
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail("the tool's child outlived the timeout")


def test_cancel_scope_kills_the_tool_and_its_group():
    import threading
    import time

    from nodemedic.checks.tools import Cancelled, ToolNotFound, cancel_scope, check_cancelled

    from fakes.processes import new_children

    event = threading.Event()
    threading.Timer(0.3, event.set).start()
    started = time.monotonic()
    with cancel_scope(event), pytest.raises(Cancelled, match="sh cancelled"):
        run_tool(["sh", "-c", "sleep 60 & sleep 60; wait"], timeout_s=60)
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while new_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert new_children() == []
    with cancel_scope(event):
        with pytest.raises(Cancelled, match="before it started"):
            run_tool(["true"], timeout_s=5)
        with pytest.raises(Cancelled):
            check_cancelled("loop")
    check_cancelled("outside any scope")  # no scope: nothing to cancel
    assert run_tool(["true"], timeout_s=5).returncode == 0
    with pytest.raises(ToolNotFound):
        run_tool(["no-such-tool-here"], timeout_s=1)
