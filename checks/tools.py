"""Running external tools: always an argument list, always a timeout, never a shell."""

from __future__ import annotations

import contextlib
import contextvars
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from nodemedic.checks.base import CheckUnavailable

MAX_OUTPUT = 16 * 1024 * 1024  # a runaway tool cannot make the agent hold more than this
CANCEL_POLL_S = 0.1

# Set by whoever runs a cancellable piece of work (the deep-check runner); every tool started under it is stopped,
# with its whole process group, as soon as the event is set.
_CANCEL: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("nodemedic_cancel", default=None)


class ToolNotFound(CheckUnavailable):
    """The tool is not installed here: a deep check that needs it is skipped, not failed."""


class Cancelled(CheckUnavailable):
    """The run was cancelled: its tools were killed before they reached a result."""


@contextlib.contextmanager
def cancel_scope(event: threading.Event) -> Iterator[threading.Event]:
    """Tools run (in this thread or context) inside the block are killed once `event` is set."""
    token = _CANCEL.set(event)
    try:
        yield event
    finally:
        _CANCEL.reset(token)


def check_cancelled(what: str = "run") -> None:
    """Raise Cancelled if the current scope was cancelled (for loops between tools)."""
    event = _CANCEL.get()
    if event is not None and event.is_set():
        raise Cancelled(f"{what} cancelled")


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
    """Run a tool to completion. A missing binary or a timeout raises CheckUnavailable; a non-zero exit does not.

    The tool runs in its own process group, and a timeout or a cancel (see cancel_scope, which raises Cancelled)
    kills the whole group: launchers (mpirun, srun, stress-ng's workers) leave no grandchildren behind.
    """
    exe = find_tool(args[0])
    if exe is None:
        raise ToolNotFound(f"{args[0]} not found")
    cancel = _CANCEL.get()
    name = os.path.basename(exe)
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"{name} cancelled before it started")
    try:
        proc = subprocess.Popen([exe, *args[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    except OSError as exc:
        raise CheckUnavailable(f"cannot run {exe}: {exc.strerror}") from exc
    try:
        stdout, stderr = communicate(proc, timeout_s, name)
    except subprocess.TimeoutExpired as exc:
        _kill_group(proc)
        raise CheckUnavailable(f"{name} timed out after {timeout_s:g}s") from exc
    except BaseException:  # Cancelled, KeyboardInterrupt: the tool's group goes too
        if proc.poll() is None:
            _kill_group(proc)
        raise
    return ToolResult(tuple(args), proc.returncode, stdout[:MAX_OUTPUT].decode("utf-8", "replace"),
                      stderr[:MAX_OUTPUT].decode("utf-8", "replace"))


def communicate(proc: subprocess.Popen[bytes], timeout_s: float, name: str) -> tuple[bytes, bytes]:
    """proc.communicate() within `timeout_s`, prompt to the current cancel scope; the process is the caller's.

    Raises subprocess.TimeoutExpired past the deadline and Cancelled on a cancel, leaving `proc` running.
    """
    cancel = _CANCEL.get()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            # Waiting in slices keeps a cancel prompt; a retried communicate() loses no output.
            return proc.communicate(timeout=max(0.0, min(left, CANCEL_POLL_S) if cancel else left))
        except subprocess.TimeoutExpired as exc:
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"{name} cancelled") from exc
            if time.monotonic() >= deadline:
                raise


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """SIGTERM the group (stress-ng, mpirun and srun reap and clean up their own), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        try:
            proc.communicate(timeout=grace_s if sig is signal.SIGTERM else None)
            return
        except subprocess.TimeoutExpired:
            continue


class ToolExited(Exception):
    """A followed tool ended by itself; carries its exit status and its last lines, to say why."""

    def __init__(self, name: str, returncode: int, tail: list[str]):
        self.returncode = returncode
        self.tail = tail
        said = " | ".join(line.strip() for line in tail if line.strip())[:300] or "no output"
        super().__init__(f"{name} exited ({returncode}): {said}")


def follow_tool(args: list[str], stop: threading.Event, poll_s: float = 0.25,
                on_start: Callable[[subprocess.Popen[bytes]], None] | None = None) -> Iterator[list[str]]:
    """Run a long-lived tool and yield its output lines, a batch per read, and [] after each quiet `poll_s`.

    Returns once `stop` is set (the tool is terminated, then killed); raises ToolExited if it ends by itself.
    """
    exe = find_tool(args[0])
    if exe is None:
        raise CheckUnavailable(f"{args[0]} not found")
    proc = subprocess.Popen([exe, *args[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    if on_start is not None:
        on_start(proc)
    try:
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        partial = b""
        tail: list[str] = []
        while not stop.is_set():
            if not poller.poll(int(poll_s * 1000)):
                yield []
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                if partial:
                    tail.append(partial.decode("utf-8", "replace"))
                raise ToolExited(os.path.basename(exe), proc.wait(timeout=5), tail[-5:])
            raw_lines = (partial + chunk).split(b"\n")
            partial = raw_lines.pop()
            if raw_lines:
                lines = [raw.decode("utf-8", "replace") for raw in raw_lines]
                tail = (tail + lines)[-5:]
                yield lines
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
