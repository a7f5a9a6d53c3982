"""Running external tools: always an argument list, always a timeout, never a shell."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from nodemedic.checks.base import CheckUnavailable

MAX_OUTPUT = 16 * 1024 * 1024  # a runaway tool cannot make the agent hold more than this


@dataclass(frozen=True)
class ToolResult:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + ("\n" + self.stderr if self.stderr else "")


def find_tool(name: str, search_path: str | None = None) -> str | None:
    """Absolute path of `name` on PATH (or `search_path`), or None; an absolute name is checked as is."""
    if os.path.isabs(name):
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name, path=search_path)


def run_tool(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> ToolResult:
    """Run a tool to completion. A missing binary or a timeout raises CheckUnavailable; a non-zero exit does not."""
    exe = find_tool(args[0])
    if exe is None:
        raise CheckUnavailable(f"{args[0]} not found")
    try:
        proc = subprocess.run([exe, *args[1:]], capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                              env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        raise CheckUnavailable(f"{os.path.basename(exe)} timed out after {timeout_s:g}s") from exc
    except OSError as exc:
        raise CheckUnavailable(f"cannot run {exe}: {exc.strerror}") from exc
    return ToolResult(tuple(args), proc.returncode, proc.stdout[:MAX_OUTPUT].decode("utf-8", "replace"),
                      proc.stderr[:MAX_OUTPUT].decode("utf-8", "replace"))
