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
