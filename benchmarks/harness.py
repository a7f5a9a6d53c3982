"""Shared pieces: result rows, the agent as a subprocess, RSS sampling, percentiles."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Iterable

import psutil

DETECTION_MARKER = "HealthMonitoringAgentDetectionEvent"
MIB = 1024 * 1024
_METRICS_LINE = re.compile(r"metrics on http://[^:/]+:(\d+)/metrics")


@dataclass
class Result:
    """One row of the report; `passed` is None for figures printed for information only."""

    bench: str
    metric: str
    value: str
    target: str = ""
    passed: bool | None = None


def check(bench: str, metric: str, value: str, target: str, passed: bool) -> Result:
    """A row with a target."""
    return Result(bench, metric, value, target, passed)


def info(bench: str, metric: str, value: str) -> Result:
    """A row without a target."""
    return Result(bench, metric, value)


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil without floats
    return ordered[int(rank) - 1]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f} MiB"


def rate(count: int, seconds: float) -> str:
    return f"{count / seconds:,.0f} lines/s" if seconds > 0 else "n/a"


class RssSampler:
    """Samples a process's RSS in a background thread and keeps the peak."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.02):
        self._proc = psutil.Process(pid)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.baseline = self._proc.memory_info().rss
        self.peak = self.baseline

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.peak = max(self.peak, self._proc.memory_info().rss)
            except psutil.Error:
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.peak = max(self.peak, self._proc.memory_info().rss)
        except psutil.Error:
            pass

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


def nodemedic_command() -> list[str]:
    """The installed console script beside this interpreter, else `python -m nodemedic`."""
    script = Path(sys.executable).parent / "nodemedic"
    if script.exists():
        return [str(script)]
    found = shutil.which("nodemedic")
    return [found] if found else [sys.executable, "-m", "nodemedic"]


def agent_env() -> dict[str, str]:
    """The caller's environment without NODEMEDIC_* settings that would change what is measured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODEMEDIC_")}
    env["NODEMEDIC_IMDS__ENABLED"] = "false"
    return env


def append_fd(path: Path) -> int:
    """An O_APPEND descriptor: each os.write lands whole at the end of the file, like the kernel's logger."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _detection(line: str) -> dict | None:
    """The detection event a stdout line carries, if it is one."""
    if DETECTION_MARKER not in line:
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and DETECTION_MARKER in event else None


class AgentProcess:
    """`nodemedic run` as a subprocess, following a kernel-log file; stdout lines are timestamped in a thread."""

    def __init__(self, start_timeout_s: float = 30.0):
        self.workdir = Path(tempfile.mkdtemp(prefix="nodemedic-bench-"))
        self.kernel_log = self.workdir / "kern.log"
        self.kernel_log.touch()
        self.start_timeout_s = start_timeout_s
        self.metrics_port: int | None = None
        self.detections: list[tuple[float, dict]] = []
        self._first_seen: dict[str, float] = {}
        self._tail: collections.deque[str] = collections.deque(maxlen=20)
        self._cond = threading.Condition()
        self._started = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr = open(self.workdir / "stderr.log", "wb")
        self._reader: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def __enter__(self) -> AgentProcess:
        try:
            self.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def start(self) -> None:
        """Start the agent and wait for its start line and metrics port."""
        args = [*nodemedic_command(), "run", "--config", "/dev/null", "--kernel-log", str(self.kernel_log),
                "--state-dir", str(self.workdir / "state"), "--metrics-port", "0", "--node-name", "bench"]
        env = {**agent_env(), "NODEMEDIC_RECOVERY__SOCKET": str(self.workdir / "recovery.sock")}
        self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL,
                                      env=env)
        self._reader = threading.Thread(target=self._read, name="agent-stdout", daemon=True)
        self._reader.start()
        with self._cond:
            ok = self._cond.wait_for(lambda: (self._started and self.metrics_port is not None) or not self.alive,
                                     timeout=self.start_timeout_s)
        if not ok or not self.alive:
            raise RuntimeError(f"agent did not start: {self.diagnostics()}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it will not go; returns the exit status."""
        if self._proc is None:
            self._stderr.close()
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._stderr.close()
        return self._proc.returncode

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    # -- stdout -----------------------------------------------------------------------------------------------------
    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            arrived = time.perf_counter()
            line = raw.decode("utf-8", "replace")
            event = _detection(line)
            if event is not None:
                self._detected(arrived, event)
                continue
            self._tail.append(line.rstrip("\n"))
            self._note(line)
        with self._cond:
            self._cond.notify_all()  # the agent exited: wake anyone waiting on it

    def _detected(self, arrived: float, event: dict) -> None:
        with self._cond:
            self.detections.append((arrived, event))
            self._first_seen.setdefault(event.get("component", ""), arrived)
            self._cond.notify_all()

    def _note(self, line: str) -> None:
        started = '"msg":"nodemedic ready' in line  # every watcher is positioned: nothing appended is missed
        port = _METRICS_LINE.search(line)
        if started or port:
            with self._cond:
                self._started = self._started or started
                if port:
                    self.metrics_port = int(port.group(1))
                self._cond.notify_all()

    def wait_detection(self, component: str, timeout_s: float) -> float | None:
        """perf_counter time at which the first detection line for `component` arrived, or None."""
        with self._cond:
            self._cond.wait_for(lambda: component in self._first_seen or not self.alive, timeout=timeout_s)
            return self._first_seen.get(component)

    def detection_count(self) -> int:
        with self._cond:
            return len(self.detections)

    # -- metrics and process ----------------------------------------------------------------------------------------
    def metric_sum(self, name: str, **labels: str) -> float:
        """Sum of one metric's samples whose labels include `labels`, scraped from the agent's endpoint."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
                if all(w in line for w in wanted):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def process(self) -> psutil.Process:
        return psutil.Process(self.pid)

    def diagnostics(self) -> str:
        """Exit status and the last lines it wrote, for error messages."""
        status = "running" if self.alive else f"exited {self._proc.returncode if self._proc else None}"
        if not self._stderr.closed:
            self._stderr.flush()
        err = (self.workdir / "stderr.log").read_text(errors="replace")[-1500:]
        return f"{status}; stdout tail: {list(self._tail)[-5:]}; stderr tail: {err!r}"


@dataclass(frozen=True)
class Sizes:
    """How big each benchmark runs; --quick shrinks them for a smoke run."""

    injections: int = 200
    throughput_lines: int = 1_000_000
    storm_lines: int = 1_000_000
    settle_s: float = 5.0
    idle_s: float = 60.0


FULL = Sizes()
QUICK = Sizes(injections=30, throughput_lines=100_000, storm_lines=100_000, idle_s=30.0)
