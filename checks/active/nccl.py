"""NCCL all-reduce bandwidth: run nccl-tests' `all_reduce_perf`, parse its table and footer, judge bus bandwidth.

Output layout follows nccl-tests' common.cu (header, `# Using devices` rank lines, the size table, then the
`# Out of bounds values` and `# Avg bus bandwidth` footer); tests/fixtures/nccl/NOTES.md lists the real captures.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from nodemedic.checks.active.base import DeepCheckResult, Status, tail, unavailable_status
from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.platform.profiles import normalize_instance_type
from nodemedic.checks.tools import run_tool
from nodemedic.model import Finding, Severity

CHECK = "nccl.all_reduce"
NODE = "node"
BUSBW_LOW = "NCCL_BUSBW_LOW"
WRONG_RESULTS = "NCCL_WRONG_RESULTS"
OPERATION = "all_reduce_perf"

# Launcher prefixes that wrap each line: Open MPI `--tag-output` ("[1,0]<stdout>:") and `srun --label` ("0: ").
_PREFIX = re.compile(r"^(?:\[\d+,\d+\]<std(?:out|err)>:\s?|\s*\d+:\s(?=\s*#|\s*\d))")
_NUM = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
# #wrong is a count; `-c 0` prints N/A; NCCL 1's tests printed the max error ("res") as a float instead.
_WRONG = rf"(?:\d+|N/A|{_NUM})"
_ROW = re.compile(
    rf"^(?P<size>\d+)\s+(?P<count>\d+)\s+(?P<type>[A-Za-z_]\w*)\s+(?P<redop>[A-Za-z_]\w*)\s+(?:(?P<root>-?\d+)\s+)?"
    rf"(?P<ot>{_NUM})\s+(?P<oa>{_NUM})\s+(?P<ob>{_NUM})\s+(?P<ow>{_WRONG})\s+"
    rf"(?P<it>{_NUM})\s+(?P<ia>{_NUM})\s+(?P<ib>{_NUM})\s+(?P<iw>{_WRONG})$")
_RANK = re.compile(r"^#?\s*Rank\s+(?P<rank>\d+)(?:\s+Group\s+\d+)?(?:\s+Pid\s+(?P<pid>\d+))?\s+on\s+(?P<host>\S+)"
                   r"\s+device\s+(?P<device>\d+)\s+\[(?P<bus>[^\]]*)\]\s*(?P<name>.*)$")
_HEADER = re.compile(r"^#?\s*nThread\s+\d+\s+nGpus\s+\d+")
_HEADER_FIELD = re.compile(r"(nThread|nGpus|minBytes|maxBytes|validation)\s*:?\s+(\d+)")
# Older nccl-tests (and NCCL 1's) printed the footer without the leading "#"; with NCCL_TESTS_MIN_BW set the average
# is followed by OK/FAILED.
_OOB = re.compile(r"^#?\s*Out of bounds values\s*:\s*(\d+)\s+(\S+)")
_AVG = re.compile(rf"^#?\s*Avg bus bandwidth\s*:\s*({_NUM}|nan|-?inf)(?:\s+(OK|FAILED))?", re.IGNORECASE)
# common.cu's NCCLCHECK/CUDACHECK/TESTCHECK print "<host>: Test NCCL failure file:line '...'" and
# " .. <host> pid N: Test failure file:line"; NCCL 1 era tests printed "NCCL failure file:line '...'".
_FAILURE = re.compile(r"(?:Test (?:NCCL |CUDA )?failure|NCCL failure|CUDA failure)\s+\S+:\d+")


@dataclass(frozen=True)
class NcclRow:
    """One line of the size table: out-of-place then in-place time (us), algbw and busbw (GB/s), #wrong."""

    size: int
    count: int
    type: str
    redop: str
    root: int | None
    oop_time_us: float
    oop_algbw: float
    oop_busbw: float
    oop_wrong: int | None  # None: not validated (`-c 0` prints N/A) or NCCL 1's float error column
    ip_time_us: float
    ip_algbw: float
    ip_busbw: float
    ip_wrong: int | None

    @property
    def busbw(self) -> float:
        return max(self.oop_busbw, self.ip_busbw)

    @property
    def algbw(self) -> float:
        return max(self.oop_algbw, self.ip_algbw)

    @property
    def wrong(self) -> int:
        return (self.oop_wrong or 0) + (self.ip_wrong or 0)


@dataclass(frozen=True)
class NcclRank:
    rank: int
    host: str
    device: int
    bus: str
    name: str
    pid: int | None = None


@dataclass
class NcclRun:
    """What one all_reduce_perf run printed."""

    rows: list[NcclRow] = field(default_factory=list)
    ranks: list[NcclRank] = field(default_factory=list)
    header: dict[str, int] = field(default_factory=dict)
    out_of_bounds: int | None = None          # the footer's count; None when the footer is missing
    out_of_bounds_status: str | None = None   # "OK" or what nccl-tests printed instead ("FAILED")
    avg_busbw: float | None = None
    failures: list[str] = field(default_factory=list)  # "Test NCCL failure ..." and the like
    legacy: bool = False                      # NCCL 1 era layout

    @property
    def complete(self) -> bool:
        return bool(self.rows) and self.out_of_bounds is not None and self.avg_busbw is not None

    @property
    def max_busbw(self) -> float | None:
        return max((r.busbw for r in self.rows), default=None)

    @property
    def max_algbw(self) -> float | None:
        return max((r.algbw for r in self.rows), default=None)

    @property
    def largest(self) -> NcclRow | None:
        return max(self.rows, key=lambda r: r.size, default=None)

    @property
    def wrong(self) -> int:
        return sum(r.wrong for r in self.rows)

    @property
    def devices(self) -> int:
        return len({r.rank for r in self.ranks})

    @property
    def nodes(self) -> int:
        return len({r.host for r in self.ranks})


def _wrong(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def parse_allreduce(text: str) -> NcclRun:
    """Parse all_reduce_perf output, skipping launcher noise; never raises on garbage (the run is just incomplete)."""
    run = NcclRun()
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if not line:
            continue
        if m := _ROW.match(line):
            g = m.groupdict()
            run.rows.append(NcclRow(
                int(g["size"]), int(g["count"]), g["type"], g["redop"],
                int(g["root"]) if g["root"] is not None else None,
                float(g["ot"]), float(g["oa"]), float(g["ob"]), _wrong(g["ow"]),
                float(g["it"]), float(g["ia"]), float(g["ib"]), _wrong(g["iw"])))
            if g["root"] is None:
                run.legacy = True
        elif _HEADER.match(line):
            run.header.update({k: int(v) for k, v in _HEADER_FIELD.findall(line)})
            if not line.startswith("#"):
                run.legacy = True
        elif m := _RANK.match(line):
            run.ranks.append(NcclRank(int(m["rank"]), m["host"], int(m["device"]), m["bus"], m["name"].strip(),
                                      int(m["pid"]) if m["pid"] else None))
        elif m := _OOB.match(line):
            run.out_of_bounds, run.out_of_bounds_status = int(m[1]), m[2]
        elif m := _AVG.match(line):
            run.avg_busbw = float(m[1])
        elif "NCCL Tests compiled with NCCL 1" in line:
            run.legacy = True
        elif _FAILURE.search(line):
            run.failures.append(line[:300])
    return run


# -- thresholds ---------------------------------------------------------------------------------------------------

def load_thresholds() -> dict[str, dict[str, float]]:
    """Instance type (normalised, without `ml.`) -> {single_node, multi_node} bus bandwidth thresholds in GB/s."""
    data = yaml.safe_load(resources.files(__package__).joinpath("nccl_thresholds.yaml").read_text()) or {}
    return {normalize_instance_type(name): dict(values) for name, values in data.items()}


def threshold_for(instance_type: str | None, nodes: int = 1,
                  thresholds: dict[str, dict[str, float]] | None = None) -> float | None:
    """The busbw threshold (GB/s) for `instance_type` (with or without `ml.`), or None when none is known."""
    if not instance_type:
        return None
    entry = (thresholds if thresholds is not None else load_thresholds()).get(normalize_instance_type(instance_type))
    if not entry:
        return None
    value = entry.get("single_node" if nodes <= 1 else "multi_node")
    return float(value) if value is not None else None


# -- the verdict --------------------------------------------------------------------------------------------------

def _record(run: NcclRun, threshold: float | None, nodes: int, devices: int) -> dict[str, Any]:
    # The record keys are the HyperPod deep-health-check names; despite "AlgoBw" they carry bus bandwidth,
    # which is what the thresholds and the footer's average are in.
    largest = run.largest
    return {
        "NcclMaxAlgoBw": run.max_busbw,
        "NcclAvgAlgoBw": run.avg_busbw,
        "NcclThresholdAlgoBw": threshold,
        "NcclOutOfBoundError": run.out_of_bounds_status,
        "NcclOperations": OPERATION,
        "NcclTotalDevices": devices,
        "NcclNodes": nodes,
        "max_algbw_gbs": run.max_algbw,
        "largest_size_bytes": largest.size if largest else None,
        "largest_size_busbw_gbs": largest.busbw if largest else None,
        "wrong": run.wrong,
    }


def judge(run: NcclRun, threshold_busbw_gbs: float | None, nodes: int | None = None,
          devices: int | None = None) -> DeepCheckResult:
    """PASSED only for a complete run with no wrong results and busbw (max and at the largest size) >= threshold."""
    nodes = nodes if nodes is not None else run.nodes
    devices = devices if devices is not None else run.devices
    metrics = _record(run, threshold_busbw_gbs, nodes, devices)

    def result(status: Status, summary: str, findings: list[Finding] | None = None) -> DeepCheckResult:
        return DeepCheckResult(CHECK, status, summary, findings or [], metrics)

    if run.failures:
        return result(Status.ERROR, f"all_reduce_perf failed: {run.failures[0]}")
    if not run.rows:
        return result(Status.ERROR, "all_reduce_perf printed no result rows")
    if not run.complete:
        return result(Status.ERROR, "all_reduce_perf output ends without its footer (run cut short)")
    if run.devices and devices and run.devices != devices:
        return result(Status.ERROR, f"all_reduce_perf ran on {run.devices} devices, {devices} expected")

    evidence = {"max_busbw_gbs": run.max_busbw, "largest_size_busbw_gbs": metrics["largest_size_busbw_gbs"],
                "threshold_gbs": threshold_busbw_gbs, "nodes": nodes, "devices": devices}
    wrong_rows = [r.size for r in run.rows if r.wrong]
    if wrong_rows or run.out_of_bounds or run.out_of_bounds_status != "OK":
        message = (f"all-reduce returned wrong results: {run.wrong} wrong values at sizes {wrong_rows[:5]}, "
                   f"out of bounds: {run.out_of_bounds} {run.out_of_bounds_status}")
        finding = Finding(CHECK, NODE, WRONG_RESULTS, message, Severity.CRITICAL,
                          {**evidence, "wrong": run.wrong, "wrong_sizes": wrong_rows,
                           "out_of_bounds": run.out_of_bounds, "out_of_bounds_status": run.out_of_bounds_status})
        return result(Status.FAILED, message, [finding])

    if threshold_busbw_gbs is None:
        return result(Status.PASSED, f"results correct, max busbw {run.max_busbw:g} GB/s (no threshold for this "
                                     "instance type: bandwidth not judged)")
    largest_busbw = metrics["largest_size_busbw_gbs"]
    assert run.max_busbw is not None and largest_busbw is not None
    if run.max_busbw < threshold_busbw_gbs or largest_busbw < threshold_busbw_gbs:
        message = (f"all-reduce bus bandwidth {run.max_busbw:g} GB/s max, {largest_busbw:g} GB/s at "
                   f"{metrics['largest_size_bytes']} B, below the {threshold_busbw_gbs:g} GB/s threshold "
                   f"({devices} devices on {nodes} node(s))")
        return result(Status.FAILED, message, [Finding(CHECK, NODE, BUSBW_LOW, message, Severity.ERROR, evidence)])
    return result(Status.PASSED, f"max busbw {run.max_busbw:g} GB/s >= {threshold_busbw_gbs:g} GB/s, "
                                 f"{largest_busbw:g} GB/s at {metrics['largest_size_bytes']} B, no wrong results")


# -- the runner ---------------------------------------------------------------------------------------------------


def run_allreduce(binary: str = "all_reduce_perf", gpus: int = 8, min_bytes: str = "1G", max_bytes: str = "16G",
                  timeout_s: float = 600.0, threshold_busbw_gbs: float | None = None, nodes: int = 1,
                  extra_args: list[str] | None = None) -> DeepCheckResult:
    """Run `all_reduce_perf -b MIN -e MAX -f 2 -g GPUS` in one process and judge it; an absent binary is SKIPPED."""
    args = [binary, "-b", min_bytes, "-e", max_bytes, "-f", "2", "-g", str(gpus), *(extra_args or [])]
    started = time.monotonic()
    try:
        out = run_tool(args, timeout_s)
    except CheckUnavailable as exc:
        # A missing binary means the test is not installed; a timeout means it ran and never finished.
        status = unavailable_status(exc)
        return DeepCheckResult(CHECK, status, str(exc), evidence={"command": args},
                               duration_s=time.monotonic() - started)
    run = parse_allreduce(out.output)
    result = judge(run, threshold_busbw_gbs, nodes, gpus * nodes)
    if out.returncode != 0 and result.status is not Status.FAILED:
        # A run that exits non-zero never passes, whatever it printed before.
        result.status = Status.ERROR
        result.summary = f"all_reduce_perf exited {out.returncode}: {result.summary}"
    result.evidence = {"command": args, "returncode": out.returncode, "output_tail": tail(out.output)}
    result.duration_s = time.monotonic() - started
    return result
