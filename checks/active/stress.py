"""stress-ng deep checks: CPU, memory and disk under `--verify`, with the metrics table parsed and failures as faults.

Output layout follows stress-ng's own log lines (`stress-ng: <level>: [pid] ...`); the metrics table is printed under
`metrc:` since ~0.14 and under `info:` before. tests/fixtures/stress_ng/NOTES.md lists the real captures used.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

import psutil

from nodemedic.checks.active.base import DeepCheckResult, Status, tail
from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import MAX_OUTPUT, find_tool, run_tool
from nodemedic.model import Finding, Severity

KINDS = ("cpu", "memory", "disk")
CODES = {"cpu": "STRESS_CPU_FAILED", "memory": "STRESS_MEMORY_FAILED", "disk": "STRESS_DISK_FAILED"}
# stressor name -> kind, to name the component when the caller did not say which kind ran.
_STRESSOR_KIND = {"cpu": "cpu", "vm": "memory", "hdd": "disk", "iomix": "disk"}
MAX_WORKERS = 4
HDD_MAX_BYTES = 1 << 30
HDD_DISK_FRACTION = 0.1
MIN_BYTES = 1 << 20

# Exit statuses (stress-ng(1) EXIT STATUS) that mean the run could not be judged rather than the hardware failed:
# 1 bad options / harness resource issue, 3 a stressor lacked resources (ENOMEM, ENOSPC), 4 not implemented here.
_NOT_A_VERDICT = {1: "stress-ng error (bad options or harness resource issue)",
                  3: "a stressor could not get its resources (ENOMEM/ENOSPC)",
                  4: "a stressor is not implemented here"}

_LINE = re.compile(r"^(?:stress-ng:\s*)?(?P<level>info|metrc|fail|error|warn|debug):\s*(?:\[(?P<pid>\d+)\]\s?)?"
                   r"(?P<msg>.*)$")
_NUM = r"\d+(?:\.\d+)?"
_METRIC_ROW = re.compile(rf"^\s*(?P<stressor>[A-Za-z][\w-]*)\s+(?P<ops>\d+)\s+(?P<real>{_NUM})\s+(?P<usr>{_NUM})\s+"
                         rf"(?P<sys>{_NUM})\s+(?P<rate_real>{_NUM})\s+(?P<rate_cpu>{_NUM})"
                         rf"(?:\s+(?P<cpu_pct>{_NUM}))?(?:\s+(?P<rss>\d+))?\s*$")
_MISC_ROW = re.compile(rf"^\s*(?P<stressor>[A-Za-z][\w-]*)\s+(?P<value>{_NUM})\s+(?P<what>[^(]+?)\s*(?:\(.*\))?\s*$")
_DETECTED = re.compile(r"detected\s+(\d+)\s+.*?errors?\b", re.IGNORECASE)
_FAILURES_REACHED = re.compile(r"(\d+)\s+failures reached")
_FAILED_SUMMARY = re.compile(r"^failed:\s*(\d+)")


@dataclass(frozen=True)
class StressorMetrics:
    """One row of the `--metrics-brief` table."""

    stressor: str
    bogo_ops: int
    real_time_s: float
    usr_time_s: float
    sys_time_s: float
    bogo_ops_per_s_real: float
    bogo_ops_per_s_cpu: float

    def to_dict(self) -> dict[str, Any]:
        return {"bogo_ops": self.bogo_ops, "real_time_s": self.real_time_s, "usr_time_s": self.usr_time_s,
                "sys_time_s": self.sys_time_s, "bogo_ops_per_s_real": self.bogo_ops_per_s_real,
                "bogo_ops_per_s_cpu": self.bogo_ops_per_s_cpu}


def _logged(text: str) -> list[tuple[str, str]]:
    """(level, message) for each stress-ng log line; other lines (shell, harness banners) are dropped."""
    out = []
    for raw in text.splitlines():
        m = _LINE.match(raw.strip())
        if m:
            out.append((m["level"], m["msg"].rstrip()))
    return out


def stress_warnings(text: str) -> list[str]:
    """The `warn:` lines (e.g. "metrics-check: all bogo-op counters are zero"): evidence, never a fault."""
    return [msg for level, msg in _logged(text) if level == "warn"]


def _parse_metrics(lines: list[tuple[str, str]]) -> tuple[list[StressorMetrics], dict[str, dict[str, float]]]:
    rows: list[StressorMetrics] = []
    misc: dict[str, dict[str, float]] = {}
    in_table = in_misc = False
    for level, msg in lines:
        if level not in ("info", "metrc"):
            in_table = in_misc = False
            continue
        if msg.startswith("stressor") and "bogo ops" in msg:
            in_table, in_misc = True, False
            continue
        if msg.startswith("miscellaneous metrics"):
            in_table, in_misc = False, True
            continue
        if in_table:
            m = _METRIC_ROW.match(msg)
            if m:
                rows.append(StressorMetrics(m["stressor"], int(m["ops"]), float(m["real"]), float(m["usr"]),
                                            float(m["sys"]), float(m["rate_real"]), float(m["rate_cpu"])))
            elif not msg.strip().startswith("(secs)"):
                in_table = False
        elif in_misc:
            m = _MISC_ROW.match(msg)
            if m:
                misc.setdefault(m["stressor"], {})[m["what"]] = float(m["value"])
            else:
                in_misc = False
    return rows, misc


def parse_stress_output(text: str, returncode: int, kind: str | None = None,
                        scratch_dir: str | None = None) -> tuple[Status, list[Finding], dict[str, Any]]:
    """Judge one stress-ng run from its combined output and exit status: (status, findings, metrics)."""
    lines = _logged(text)
    rows, misc = _parse_metrics(lines)
    metrics: dict[str, Any] = {"stressors": {r.stressor: r.to_dict() for r in rows}}
    if rows:
        metrics["bogo_ops"] = sum(r.bogo_ops for r in rows)
        metrics["bogo_ops_per_s"] = round(sum(r.bogo_ops_per_s_real for r in rows), 2)
    if misc:
        metrics["misc"] = misc

    fail_lines = [msg for level, msg in lines if level == "fail"]
    error_lines = [msg for level, msg in lines if level == "error"]
    # The parent's "detected 5 bit errors" totals its workers' "detected 1 memory error" lines: take the max.
    detected = max((int(m.group(1)) for msg in fail_lines if (m := _DETECTED.search(msg))), default=0)
    # "N failures reached" is printed without the stress-ng prefix by some versions, so search the raw text.
    reached = [int(m.group(1)) for m in _FAILURES_REACHED.finditer(text)]
    failed_stressors = max((int(m.group(1)) for _, msg in lines if (m := _FAILED_SUMMARY.match(msg))), default=0)
    unsuccessful = "unsuccessful run completed" in text
    successful = re.search(r"(?<!un)successful run completed", text) is not None

    if kind is None:
        kind = next((_STRESSOR_KIND[r.stressor] for r in rows if r.stressor in _STRESSOR_KIND), None)
        kind = kind or next((_STRESSOR_KIND[w] for w in re.findall(r"dispatching hogs:.*?\d+\s+(\w+)", text)
                             if w in _STRESSOR_KIND), "cpu")
    component = f"disk:{scratch_dir}" if kind == "disk" and scratch_dir else kind

    hardware_signs = bool(fail_lines or detected or reached or failed_stressors or unsuccessful)
    if returncode in _NOT_A_VERDICT and not (fail_lines or detected or reached):
        return Status.ERROR, [], metrics
    if hardware_signs or returncode > 0:
        reasons = []
        if detected:
            reasons.append(f"detected {detected} error(s)")
        if fail_lines:
            reasons.append(f"{len(fail_lines)} fail line(s)")
        if reached:
            reasons.append(f"{max(reached)} failures reached")
        if failed_stressors:
            reasons.append(f"{failed_stressors} stressor(s) failed")
        if unsuccessful:
            reasons.append("unsuccessful run completed")
        if returncode:
            reasons.append(f"exit status {returncode}")
        message = f"stress-ng {kind} test failed: {', '.join(reasons)}"
        evidence = {"returncode": returncode, "fail_lines": fail_lines[:10], "error_lines": error_lines[:10],
                    "errors_detected": detected, "failed_stressors": failed_stressors}
        return Status.FAILED, [Finding(f"stress.{kind}", component, CODES.get(kind, "STRESS_FAILED"), message,
                                       Severity.ERROR, evidence)], metrics
    if returncode < 0:
        return Status.ERROR, [], metrics
    if not successful:
        # rc 0 without stress-ng's own verdict line: output we do not understand never reads as a pass.
        return Status.ERROR, [], metrics
    return Status.PASSED, [], metrics


def available_memory(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Memory this process may still use: the host's available memory, or less under a cgroup v2 limit.

    Inside a pod or a systemd unit with MemoryMax, the host's free memory is not ours: sizing stress-ng by it
    would get the run OOM-killed by the cgroup (or the agent with it).
    """
    available = int(psutil.virtual_memory().available)
    try:
        rel = next((line.split("::", 1)[1] for line in open(proc_cgroup, encoding="ascii")
                    if line.startswith("0::")), "/").strip()
        group = os.path.join(cgroup_root, rel.lstrip("/"))
        with open(os.path.join(group, "memory.max"), encoding="ascii") as fh:
            limit = fh.read().strip()
        with open(os.path.join(group, "memory.current"), encoding="ascii") as fh:
            current = int(fh.read().strip())
    except (OSError, ValueError, StopIteration):
        return available
    if limit == "max":
        return available
    return max(0, min(available, int(limit) - current))


def _workers() -> int:
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def build_args(kind: str, duration_s: float, scratch_dir: str | None = None, memory_fraction: float = 0.25,
               binary: str = "stress-ng") -> list[str]:
    """The stress-ng argument list for one kind (REFERENCE.md), with memory and disk use bounded."""
    timeout = str(max(1, round(duration_s)))
    if kind == "cpu":
        return [binary, "--cpu", "0", "--cpu-method", "all", "--verify", "--metrics-brief", "--timeout", timeout]
    workers = _workers()
    if kind == "memory":
        if not 0 < memory_fraction <= 0.9:
            raise ValueError(f"memory_fraction must be in (0, 0.9], not {memory_fraction}")
        total = int(available_memory() * memory_fraction)
        # Given per worker; stress-ng versions that split --vm-bytes across instances then use less, never more.
        per_worker = max(MIN_BYTES, total // workers)
        return [binary, "--vm", str(workers), "--vm-bytes", f"{per_worker}", "--verify", "--page-in",
                "--metrics-brief", "--timeout", timeout]
    if kind == "disk":
        if not scratch_dir:
            raise ValueError("the disk test needs a scratch_dir")
        free = shutil.disk_usage(scratch_dir).free
        per_worker = max(MIN_BYTES, min(HDD_MAX_BYTES, int(free * HDD_DISK_FRACTION) // workers))
        return [binary, "--hdd", str(workers), "--hdd-bytes", f"{per_worker}", "--temp-path", scratch_dir,
                "--verify", "--metrics-brief", "--timeout", timeout]
    raise ValueError(f"unknown stress kind {kind!r}; one of {', '.join(KINDS)}")



def run_stress(kind: str, duration_s: float, scratch_dir: str | None = None, memory_fraction: float = 0.25,
               binary: str = "stress-ng", timeout_margin_s: float = 30) -> DeepCheckResult:
    """Run one stress-ng test with `--verify` and judge it; a missing binary is SKIPPED, a timeout ERROR."""
    name = f"stress.{kind}"
    started = time.monotonic()
    try:
        args = build_args(kind, duration_s, scratch_dir, memory_fraction, binary)
    except (ValueError, OSError) as exc:
        return DeepCheckResult(name, Status.ERROR, f"cannot set up stress-ng {kind}: {exc}",
                               duration_s=time.monotonic() - started)
    exe = find_tool(binary)
    if exe is None:
        return DeepCheckResult(name, Status.SKIPPED, f"{binary} not found", evidence={"command": args},
                               duration_s=time.monotonic() - started)
    timeout_s = duration_s + timeout_margin_s
    try:
        # run_tool kills the whole process group on a timeout: stress-ng's forked stressors go with it.
        result = run_tool([exe, *args[1:]], timeout_s)
    except CheckUnavailable as exc:
        return DeepCheckResult(name, Status.ERROR, f"stress-ng {kind}: {exc}", evidence={"command": args},
                               duration_s=time.monotonic() - started)
    returncode, output = result.returncode, result.output[:MAX_OUTPUT]
    status, findings, metrics = parse_stress_output(output, returncode, kind, scratch_dir)
    evidence: dict[str, Any] = {"command": args, "returncode": returncode, "output_tail": tail(output)}
    warnings = stress_warnings(output)
    # stress-ng 0.15 has no metrics-check: a run too short for its --vm-bytes verifies nothing and says nothing.
    idle = [n for n, row in metrics.get("stressors", {}).items() if row["bogo_ops"] == 0]
    if idle and not any("bogo-op counters are zero" in w for w in warnings):
        warnings.append(f"zero bogo ops from {', '.join(idle)}: nothing was verified (run too short?)")
    if warnings:
        evidence["warnings"] = warnings
    if status is Status.PASSED and idle and len(idle) == len(metrics.get("stressors", {})):
        # Every stressor did zero work: nothing was verified, which is no verdict, not a pass.
        return DeepCheckResult(name, Status.ERROR, f"stress-ng {kind} verified nothing (zero bogo ops from "
                               f"{', '.join(idle)}; run too short for its size?)", [], metrics, evidence,
                               time.monotonic() - started)
    if status is Status.PASSED:
        rate = metrics.get("bogo_ops_per_s")
        summary = f"stress-ng {kind} passed" + (f", {rate:g} bogo ops/s" if rate is not None else "") \
            + (f" (warning: {warnings[0]})" if warnings else "")
    elif status is Status.FAILED:
        summary = findings[0].message
    else:
        summary = (f"stress-ng {kind} gave no verdict (exit {returncode}"
                   f"{': ' + _NOT_A_VERDICT[returncode] if returncode in _NOT_A_VERDICT else ''})")
    return DeepCheckResult(name, status, summary, findings, metrics, evidence, time.monotonic() - started)
