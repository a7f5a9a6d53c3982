"""Neuron (Trainium / Inferentia) deep checks: device count (`neuron-ls`), a hardware check and `nccom-test`.

Formats, and where they were confirmed (tests/fixtures/neuron/NOTES.md lists every capture):

* `neuron-ls --json-output` prints a JSON array, one object per device: `neuron_device`, `bdf`, `nc_count`,
  `memory_size` (bytes), `connected_to` (null on one-device instances), `neuroncore_ids`, `neuron_processes`;
  newer releases add `instance_type`, `instance_id` and `logical_neuroncore_config` to each object (shared samples
  neuron_ls_04 and the trn2.48xlarge report that sample neuron_ls_02 came from).
* `neuron-ls` without options prints a box table whose columns vary by release: NEURON DEVICE, NEURON CORES,
  [LOGICAL NC | NEURON CORE IDS], NEURON MEMORY ("96 GB"), CONNECTED DEVICES, PCI BDF (with or without the PCI
  domain), then PID / CPU AFFINITY / NUMA NODE / RUNTIME VERSION; a device used by several processes continues on
  rows whose first cell is empty; newer releases print `instance-type:` / `instance-id:` lines first
  (aws-neuron-sdk tools/neuron-sys-tools/neuron-ls.rst, neuron-runtime/nrt-api-guide.rst, samples neuron_ls_01/02).
* `nccom-test -r <ranks> [-N <nodes>] -b MIN -e MAX -f FACTOR -d TYPE [--check] <op> [--hosts H ...]` prints a
  table headed `size(B) count(elems) type time(us) algbw(GB/s) busbw(GB/s)` (newer releases: `time:avg(us)`,
  percentile columns with `--stats`, `total_input_size(B)`/`total_output_size(B)` with `--show-input-output-size`,
  a trailing `algorithm` column with `--show-algorithm`) and the footer `Avg bus bandwidth: <x>GB/s`. A failed
  benchmark prints `<size>    Failure running neuron-bench - log file <path>` and `<n> errors found - test
  failed`; a missing driver prints `Neuron DKMS Driver is not running! ...` (aws-neuron-sdk
  tools/neuron-sys-tools/nccom-test.rst, all releases from the Beta guide to 2.29). Multi-node runs need
  `NEURON_RT_ROOT_COMM_ID=<first host>:<port>` in the environment.
* What `--check` prints when the data is wrong is NOT documented. The parser recognises a correctness failure only
  by the phrases in `_WRONG` (an assumption, exercised by a SYNTHETIC fixture); any other failure text leaves the
  run an ERROR, never a pass and never a hardware fault.

The Neuron hardware check: SageMaker HyperPod's deep health checks list "Neuron hardware check — runs a training
workload and verifies the results" next to "NCCOM local test" (HyperPod EKS/Slurm deep-health-check pages); the
tool behind it is not published. Here it is a short verified workload through the documented tooling: for each
device, `nccom-test --check` all-reduce over that device's NeuronCores only (NEURON_RT_VISIBLE_CORES, a documented
Neuron runtime variable). nccom-test generates and executes NEFFs on the cores and compares every output with a
golden result computed on the CPU, so a device whose compute engines, DMA or HBM corrupt data fails on its own,
and the failure names the device.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from nodemedic.checks.active.base import DeepCheckResult, Status, tail, unavailable_status
from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import ToolResult, run_tool
from nodemedic.model import Finding, Severity

COUNT_CHECK = "neuron.device_count"
HW_CHECK = "neuron.hw_check"
NCCOM_CHECK = "neuron.nccom"
NODE = "node"

DEVICE_COUNT_LOW = "NEURON_DEVICE_COUNT_LOW"
HW_CHECK_FAILED = "NEURON_HW_CHECK_FAILED"
NCCOM_BUSBW_LOW = "NEURON_NCCOM_BUSBW_LOW"
NCCOM_WRONG_RESULTS = "NEURON_NCCOM_WRONG_RESULTS"

_GIB = 1024 ** 3
# The docs' multi-node example uses this port; any free port works, the caller may pick another.
DEFAULT_ROOT_COMM_PORT = 45654


def component(index: int) -> str:
    return f"neuron:{index}"


# -- neuron-ls ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NeuronDevice:
    """One Neuron device as `neuron-ls` lists it."""

    index: int
    cores: int | None = None            # nc_count / NEURON CORES
    logical_cores: int | None = None    # LOGICAL NC (the Trn2 doc table): what the runtime schedules on
    core_ids: tuple[int, ...] = ()      # neuroncore_ids / NEURON CORE IDS; () when the listing does not say
    memory_bytes: int | None = None
    connected_to: tuple[int, ...] = ()
    bdf: str | None = None

    @property
    def runtime_cores(self) -> int:
        """How many NeuronCores the runtime sees on this device (ranks a collective can put on it)."""
        if self.core_ids:
            return len(self.core_ids)
        return self.logical_cores or self.cores or 0


@dataclass
class NeuronLs:
    """What one `neuron-ls` run listed; `format` is "json" or "table"."""

    format: str
    devices: list[NeuronDevice] = field(default_factory=list)
    instance_type: str | None = None
    instance_id: str | None = None

    @property
    def count(self) -> int:
        return len(self.devices)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        return ()
    found = [_int(v) for v in value]
    return tuple(v for v in found if v is not None)


def _json_device(item: Any) -> NeuronDevice | None:
    if not isinstance(item, dict) or _int(item.get("neuron_device")) is None:
        return None
    return NeuronDevice(index=_int(item["neuron_device"]) or 0, cores=_int(item.get("nc_count")),
                        core_ids=_ints(item.get("neuroncore_ids")), memory_bytes=_int(item.get("memory_size")),
                        connected_to=_ints(item.get("connected_to")),
                        bdf=item.get("bdf") if isinstance(item.get("bdf"), str) else None)


def _parse_json(text: str) -> NeuronLs | None:
    start = min((i for i in (text.find("["), text.find("{")) if i >= 0), default=-1)
    if start < 0:
        return None
    try:
        doc, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return None
    # A top-level array is the documented shape; an object wrapping one is tolerated.
    items = doc.get("neuron_devices") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        return None
    devices = [d for d in (_json_device(item) for item in items) if d is not None]
    if items and not devices:
        return None  # a list, but not of devices
    first = next((item for item in items if isinstance(item, dict)), {})
    return NeuronLs("json", devices, first.get("instance_type"), first.get("instance_id"))


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _core_range(text: str) -> tuple[int, ...]:
    """'0-3' or '0, 1' -> (0, 1, 2, 3) / (0, 1); anything else -> ()."""
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if m := re.fullmatch(r"(\d+)\s*-\s*(\d+)", part):
            ids.extend(range(int(m[1]), int(m[2]) + 1))
        elif part.isdigit():
            ids.append(int(part))
        elif part:
            return ()
    return tuple(ids)


def _memory(text: str) -> int | None:
    # neuron-ls's "GB" is GiB: the JSON of the same trn2 device says 103079215104 bytes where the table says 96 GB.
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B)", text.strip(), re.IGNORECASE)
    if not m:
        return None
    scale = {"K": 1024, "M": 1024 ** 2, "G": _GIB, "T": 1024 ** 4}[m[2][0].upper()]
    return int(float(m[1]) * scale)


def _table_device(row: dict[str, str]) -> NeuronDevice | None:
    index = _int(row.get("NEURON DEVICE", ""))
    if index is None:
        return None
    return NeuronDevice(index=index, cores=_int(row.get("NEURON CORES", "")),
                        logical_cores=_int(row.get("LOGICAL NC", "")),
                        core_ids=_core_range(row.get("NEURON CORE IDS", "")),
                        memory_bytes=_memory(row.get("NEURON MEMORY", "")),
                        connected_to=_core_range(row.get("CONNECTED DEVICES", "")),
                        bdf=row.get("PCI BDF") or None)


def _parse_table(text: str) -> NeuronLs | None:
    header: list[str] | None = None
    pending: list[list[str]] = []   # the header's rows, joined cell by cell at the border under them
    info: dict[str, str] = {}
    devices: list[NeuronDevice] = []
    for raw in text.splitlines():
        line = raw.strip()
        if m := re.match(r"^(instance-type|instance-id):\s*(\S+)", line):
            info[m[1]] = m[2]
        elif line.startswith("+") and set(line) <= set("+-="):
            if header is None and pending:
                header = [" ".join(" ".join(col).split()).upper() for col in zip(*pending)]
        elif line.startswith("|") and line.endswith("|"):
            cells = _cells(line)
            if header is None:
                pending.append(cells)
            elif len(cells) == len(header) and cells[0]:  # an empty first cell continues the device above
                device = _table_device(dict(zip(header, cells)))
                if device is not None:
                    devices.append(device)
    if header is None or "NEURON DEVICE" not in header:
        return None
    return NeuronLs("table", _fill_core_ids(devices), info.get("instance-type"), info.get("instance-id"))


def _fill_core_ids(devices: list[NeuronDevice]) -> list[NeuronDevice]:
    """Older tables give only a core count: the runtime numbers cores device by device, so ids follow from it."""
    if not devices or any(d.core_ids for d in devices) or any(not d.runtime_cores for d in devices):
        return devices
    filled, next_id = [], 0
    for d in sorted(devices, key=lambda d: d.index):
        n = d.runtime_cores
        filled.append(NeuronDevice(d.index, d.cores, d.logical_cores, tuple(range(next_id, next_id + n)),
                                   d.memory_bytes, d.connected_to, d.bdf))
        next_id += n
    return filled


def parse_neuron_ls(text: str) -> NeuronLs | None:
    """`neuron-ls` output (JSON or table) -> its devices; None when it is neither (garbage, cut-short JSON)."""
    # A captured "$ neuron-ls ..." command line is not output.
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("$ "))
    if body.lstrip().startswith(("[", "{")):
        return _parse_json(body)
    # A table; failing that, JSON after some preamble (a warning printed before the document).
    return _parse_table(body) or _parse_json(body)


# -- nccom-test ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NccomRow:
    size: int
    count: int
    type: str
    time_us: float | None   # the first time column (p50 in old releases, avg in new ones)
    algbw: float            # GB/s (GiB/s per the guide)
    busbw: float
    algorithm: str | None = None


@dataclass
class NccomRun:
    """What one nccom-test run printed."""

    rows: list[NccomRow] = field(default_factory=list)
    avg_busbw: float | None = None
    failures: list[str] = field(default_factory=list)   # the run could not finish (bench failure, no driver)
    wrong: list[str] = field(default_factory=list)      # --check found corrupt data
    errors_found: int | None = None                     # "<n> errors found - test failed"

    @property
    def complete(self) -> bool:
        return bool(self.rows) and self.avg_busbw is not None

    @property
    def max_busbw(self) -> float | None:
        return max((r.busbw for r in self.rows), default=None)

    @property
    def largest(self) -> NccomRow | None:
        return max(self.rows, key=lambda r: r.size, default=None)


_NUM = r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?"
_DEFAULT_HEADER = ["size(B)", "count(elems)", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)"]
_AVG = re.compile(rf"^Avg bus bandwidth:\s*({_NUM})\s*GB/s", re.IGNORECASE)
_ERRORS_FOUND = re.compile(r"^(\d+) errors? found\b", re.IGNORECASE)
_FAILURE = re.compile(r"Failure running neuron-bench|Neuron DKMS Driver is not running|test failed", re.IGNORECASE)
# Assumed wording of a failed --check (not documented): see the module docstring.
_WRONG = re.compile(r"correctness check failed|data integrity check failed|does not match (?:the )?golden"
                    r"|golden (?:mismatch|comparison failed)|output mismatch", re.IGNORECASE)


def _row(tokens: list[str], header: list[str]) -> NccomRow | None:
    if len(tokens) != len(header) or not tokens[0].isdigit():
        return None
    row = dict(zip(header, tokens))
    time_key = next((k for k in header if k.startswith("time")), None)
    try:
        return NccomRow(int(row["size(B)"]), int(row["count(elems)"]), row["type"],
                        float(row[time_key]) if time_key else None,
                        float(row["algbw(GB/s)"]), float(row["busbw(GB/s)"]), row.get("algorithm"))
    except (KeyError, ValueError):
        return None


def parse_nccom(text: str) -> NccomRun:
    """Parse nccom-test output; never raises on garbage (the run is just incomplete)."""
    run = NccomRun()
    header = _DEFAULT_HEADER
    for raw in text.splitlines():
        # Without --non-interactive the progress indicator redraws with carriage returns: keep the last frame.
        line = next((part for part in reversed(raw.split("\r")) if part.strip()), "").strip()
        tokens = line.split()
        if not tokens:
            continue
        if "size(B)" in tokens and "busbw(GB/s)" in tokens and "algbw(GB/s)" in tokens:
            header = tokens
        elif row := _row(tokens, header):
            run.rows.append(row)
        elif m := _AVG.match(line):
            run.avg_busbw = float(m[1])
        elif _WRONG.search(line):
            run.wrong.append(line[:300])
        elif m := _ERRORS_FOUND.match(line):
            run.errors_found = int(m[1])
        elif _FAILURE.search(line):
            run.failures.append(line[:300])
    return run


def judge_nccom(run: NccomRun, threshold_busbw_gbs: float | None, ranks: int | None = None,
                nodes: int = 1, operation: str = "allr") -> DeepCheckResult:
    """PASSED only for a complete run without failures whose busbw (max and at the largest size) clears the bar."""
    largest = run.largest
    metrics: dict[str, Any] = {
        "max_busbw_gbs": run.max_busbw, "avg_busbw_gbs": run.avg_busbw,
        "largest_size_bytes": largest.size if largest else None,
        "largest_size_busbw_gbs": largest.busbw if largest else None,
        "threshold_gbs": threshold_busbw_gbs, "ranks": ranks, "nodes": nodes, "operation": operation,
        "rows": len(run.rows), "errors_found": run.errors_found,
    }

    def result(status: Status, summary: str, findings: list[Finding] | None = None) -> DeepCheckResult:
        return DeepCheckResult(NCCOM_CHECK, status, summary, findings or [], metrics)

    if run.wrong:
        message = f"nccom-test {operation} returned wrong results: {run.wrong[0]}"
        return result(Status.FAILED, message, [Finding(NCCOM_CHECK, NODE, NCCOM_WRONG_RESULTS, message,
                                                       Severity.CRITICAL, {**metrics, "wrong": run.wrong[:5]})])
    if run.failures or run.errors_found:
        said = run.failures[0] if run.failures else f"{run.errors_found} errors found"
        return result(Status.ERROR, f"nccom-test could not finish: {said}")
    if not run.rows:
        return result(Status.ERROR, "nccom-test printed no result rows")
    if not run.complete:
        return result(Status.ERROR, "nccom-test output ends without its `Avg bus bandwidth` line (run cut short)")
    assert largest is not None and run.max_busbw is not None
    if threshold_busbw_gbs is None:
        return result(Status.PASSED, f"max busbw {run.max_busbw:g} GB/s over {len(run.rows)} sizes "
                                     "(no threshold: bandwidth not judged)")
    if run.max_busbw < threshold_busbw_gbs or largest.busbw < threshold_busbw_gbs:
        message = (f"nccom-test {operation} bus bandwidth {run.max_busbw:g} GB/s max, {largest.busbw:g} GB/s at "
                   f"{largest.size} B, below the {threshold_busbw_gbs:g} GB/s threshold "
                   f"({ranks or '?'} ranks on {nodes} node(s))")
        return result(Status.FAILED, message, [Finding(NCCOM_CHECK, NODE, NCCOM_BUSBW_LOW, message,
                                                       Severity.ERROR, dict(metrics))])
    return result(Status.PASSED, f"max busbw {run.max_busbw:g} GB/s >= {threshold_busbw_gbs:g} GB/s, "
                                 f"{largest.busbw:g} GB/s at {largest.size} B")


# -- runners ------------------------------------------------------------------------------------------------------


def _unavailable(name: str, exc: CheckUnavailable, started: float, **evidence: Any) -> DeepCheckResult:
    # A missing tool means the check is not installed (SKIPPED); a timeout or a cancel means it never finished.
    return DeepCheckResult(name, unavailable_status(exc), str(exc), evidence=evidence,
                           duration_s=time.monotonic() - started)


def list_devices(binary: str = "neuron-ls", timeout_s: float = 30.0) -> tuple[NeuronLs | None, ToolResult]:
    """Run `neuron-ls --json-output`; raises CheckUnavailable (ToolNotFound when it is not installed)."""
    out = run_tool([binary, "--json-output"], timeout_s)
    return parse_neuron_ls(out.stdout), out


def judge_count(listing: NeuronLs, expected: int | None) -> DeepCheckResult:
    metrics = {"devices": listing.count, "expected": expected, "cores": sum(d.runtime_cores for d in listing.devices),
               "instance_type": listing.instance_type}
    if expected is None:
        return DeepCheckResult(COUNT_CHECK, Status.PASSED, f"{listing.count} Neuron device(s) (not judged: no "
                               "instance profile)", metrics=metrics)
    if listing.count < expected:
        present = sorted(d.index for d in listing.devices)
        missing = sorted(set(range(expected)) - set(present))
        message = f"neuron-ls lists {listing.count} of {expected} Neuron devices"
        finding = Finding(COUNT_CHECK, NODE, DEVICE_COUNT_LOW, message, Severity.CRITICAL,
                          {"found": listing.count, "expected": expected, "present": present, "missing": missing})
        return DeepCheckResult(COUNT_CHECK, Status.FAILED, message, [finding], metrics)
    return DeepCheckResult(COUNT_CHECK, Status.PASSED, f"{listing.count} of {expected} Neuron devices",
                           metrics=metrics)


def run_neuron_ls_count(expected: int | None, binary: str = "neuron-ls", timeout_s: float = 30.0) -> DeepCheckResult:
    """Devices `neuron-ls` lists vs the instance profile's `neuron_devices`."""
    started = time.monotonic()
    args = [binary, "--json-output"]
    try:
        listing, out = list_devices(binary, timeout_s)
    except CheckUnavailable as exc:
        return _unavailable(COUNT_CHECK, exc, started, command=args)
    evidence = {"command": args, "returncode": out.returncode, "output_tail": tail(out.output)}
    if out.returncode != 0 or listing is None:
        why = f"exited {out.returncode}" if out.returncode != 0 else "printed no device listing"
        return DeepCheckResult(COUNT_CHECK, Status.ERROR, f"neuron-ls {why}", evidence=evidence,
                               duration_s=time.monotonic() - started)
    result = judge_count(listing, expected)
    result.evidence = {**evidence, "devices": [d.index for d in listing.devices]}
    result.duration_s = time.monotonic() - started
    return result


def nccom_command(ranks: int, binary: str = "nccom-test", operation: str = "allr", nodes: int = 1,
                  hosts: list[str] | None = None, min_bytes: str = "8", max_bytes: str = "1GB",
                  step_factor: int = 2, datatype: str = "fp32", check: bool = True, non_interactive: bool = True,
                  extra_args: list[str] | None = None) -> list[str]:
    """The nccom-test argument list; `--hosts` takes the rest of the line, so it goes last (as in the guide)."""
    args = [binary, "-r", str(ranks)]
    if nodes > 1:
        args += ["-N", str(nodes)]
    args += ["-b", min_bytes, "-e", max_bytes, "-f", str(step_factor), "-d", datatype]
    if check:
        args.append("--check")
    if non_interactive:
        args.append("--non-interactive")  # no progress animation in a captured log (releases 2.2x+)
    args += [*(extra_args or []), operation]
    if hosts:
        args += ["--hosts", *hosts]
    return args


def _env(**extra: str | None) -> dict[str, str] | None:
    set_ = {k: v for k, v in extra.items() if v is not None}
    return {**os.environ, **set_} if set_ else None


def _local_cores(neuron_ls_binary: str, timeout_s: float) -> int | None:
    """NeuronCores on this node per neuron-ls (what a local nccom-test can put ranks on); None when unknown."""
    listing, out = list_devices(neuron_ls_binary, timeout_s)
    if out.returncode != 0 or listing is None:
        return None
    return sum(d.runtime_cores for d in listing.devices) or None


def run_nccom(ranks: int | None = None, binary: str = "nccom-test", operation: str = "allr", nodes: int = 1,
              hosts: list[str] | None = None, root_comm_id: str | None = None, min_bytes: str = "8",
              max_bytes: str = "1GB", step_factor: int = 2, datatype: str = "fp32", check: bool = True,
              threshold_busbw_gbs: float | None = None, timeout_s: float = 600.0,
              neuron_ls_binary: str = "neuron-ls", non_interactive: bool = True,
              extra_args: list[str] | None = None) -> DeepCheckResult:
    """`nccom-test` on this node (nodes=1) or across `hosts`; `ranks` None means every local core times `nodes`."""
    started = time.monotonic()
    if ranks is None:
        try:
            cores = _local_cores(neuron_ls_binary, min(30.0, timeout_s))
        except CheckUnavailable as exc:
            return _unavailable(NCCOM_CHECK, exc, started, command=[neuron_ls_binary, "--json-output"])
        if cores is None:
            return DeepCheckResult(NCCOM_CHECK, Status.ERROR, "neuron-ls gave no NeuronCore count to size the run",
                                   duration_s=time.monotonic() - started)
        ranks = cores * nodes
    args = nccom_command(ranks, binary, operation, nodes, hosts, min_bytes, max_bytes, step_factor, datatype,
                         check, non_interactive, extra_args)
    # Multi-node runs rendezvous at NEURON_RT_ROOT_COMM_ID: the first host and a free port, per the guide.
    if root_comm_id is None and nodes > 1 and hosts and "NEURON_RT_ROOT_COMM_ID" not in os.environ:
        root_comm_id = f"{hosts[0]}:{DEFAULT_ROOT_COMM_PORT}"
    try:
        out = run_tool(args, max(0.0, timeout_s - (time.monotonic() - started)),
                       env=_env(NEURON_RT_ROOT_COMM_ID=root_comm_id))
    except CheckUnavailable as exc:
        return _unavailable(NCCOM_CHECK, exc, started, command=args)
    result = judge_nccom(parse_nccom(out.output), threshold_busbw_gbs, ranks, nodes, operation)
    if out.returncode != 0 and result.status is not Status.FAILED:
        # A run that exits non-zero never passes, whatever it printed before.
        result.status = Status.ERROR
        result.summary = f"nccom-test exited {out.returncode}: {result.summary}"
    result.evidence = {"command": args, "returncode": out.returncode, "output_tail": tail(out.output),
                       **({"NEURON_RT_ROOT_COMM_ID": root_comm_id} if root_comm_id else {})}
    result.duration_s = time.monotonic() - started
    return result


# -- the hardware check -------------------------------------------------------------------------------------------

def _cores_arg(ids: tuple[int, ...]) -> str:
    """(4, 5, 6, 7) -> "4-7"; a non-contiguous set as a list, both forms NEURON_RT_VISIBLE_CORES takes."""
    if ids and list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(str(i) for i in ids)


@dataclass(frozen=True)
class DeviceVerdict:
    device: int
    status: Status
    summary: str
    busbw_gbs: float | None = None
    wrong: tuple[str, ...] = ()


def judge_device(device: int, run: NccomRun, returncode: int) -> DeviceVerdict:
    """One device's verified all-reduce: wrong data is a FAILED device, anything unfinished an ERROR."""
    if run.wrong:
        return DeviceVerdict(device, Status.FAILED, run.wrong[0], run.max_busbw, tuple(run.wrong[:5]))
    judged = judge_nccom(run, None)
    if judged.status is Status.PASSED and returncode != 0:
        return DeviceVerdict(device, Status.ERROR, f"nccom-test exited {returncode}", run.max_busbw)
    if judged.status is not Status.PASSED:
        return DeviceVerdict(device, Status.ERROR, judged.summary, run.max_busbw)
    return DeviceVerdict(device, Status.PASSED, "verified", run.max_busbw)


def _hw_result(verdicts: list[DeviceVerdict], skipped: list[int]) -> tuple[Status, str, list[Finding]]:
    failed = [v for v in verdicts if v.status is Status.FAILED]
    errors = [v for v in verdicts if v.status is Status.ERROR]
    findings = [Finding(HW_CHECK, component(v.device), HW_CHECK_FAILED,
                        f"Neuron device {v.device} returned wrong results in a verified all-reduce: {v.summary}",
                        Severity.CRITICAL, {"device": v.device, "wrong": list(v.wrong)}) for v in failed]
    note = f"; could not test device(s) {[v.device for v in errors]}" if errors else ""
    note += f"; device(s) {skipped} have too few cores to test" if skipped else ""
    if failed:
        return Status.FAILED, f"device(s) {[v.device for v in failed]} failed the verified workload{note}", findings
    if errors:
        return Status.ERROR, f"{errors[0].summary} (device {errors[0].device}){note}", []
    return Status.PASSED, f"{len(verdicts)} device(s) passed the verified all-reduce{note}", []


def run_hw_check(devices: list[NeuronDevice] | None = None, binary: str = "nccom-test",
                 neuron_ls_binary: str = "neuron-ls", size: str = "64MB", iters: int = 20,
                 timeout_s: float = 900.0, non_interactive: bool = True) -> DeepCheckResult:
    """For each device: a `nccom-test --check` all-reduce over its own cores; `timeout_s` covers every device."""
    started = time.monotonic()
    deadline = started + timeout_s
    if devices is None:
        try:
            listing, out = list_devices(neuron_ls_binary, min(30.0, timeout_s))
        except CheckUnavailable as exc:
            return _unavailable(HW_CHECK, exc, started, command=[neuron_ls_binary, "--json-output"])
        if out.returncode != 0 or listing is None:
            return DeepCheckResult(HW_CHECK, Status.ERROR, "neuron-ls gave no device listing to test",
                                   evidence={"output_tail": tail(out.output)}, duration_s=time.monotonic() - started)
        devices = _fill_core_ids(listing.devices)
    if not devices:
        # Whether devices should be here is the count check's verdict, not this one's.
        return DeepCheckResult(HW_CHECK, Status.SKIPPED, "no Neuron devices to test",
                               duration_s=time.monotonic() - started)
    verdicts, commands, skipped = [], [], []
    for device in sorted(devices, key=lambda d: d.index):
        ids = device.core_ids or tuple(range(device.runtime_cores))
        if len(ids) < 2:
            skipped.append(device.index)  # a collective needs two ranks
            continue
        args = nccom_command(len(ids), binary, "allr", min_bytes=size, max_bytes=size, step_factor=2,
                             datatype="fp32", check=True, non_interactive=non_interactive,
                             extra_args=["-n", str(iters)])
        cores = _cores_arg(ids)
        commands.append({"device": device.index, "NEURON_RT_VISIBLE_CORES": cores, "command": args})
        try:
            out = run_tool(args, max(0.0, deadline - time.monotonic()), env=_env(NEURON_RT_VISIBLE_CORES=cores))
        except CheckUnavailable as exc:
            # Not installed: the whole check is skipped. Timed out or cancelled: no verdict for the node.
            status = unavailable_status(exc)
            return DeepCheckResult(HW_CHECK, status, f"{exc} (device {device.index})",
                                   metrics=_hw_metrics(verdicts), evidence={"commands": commands},
                                   duration_s=time.monotonic() - started)
        verdicts.append(judge_device(device.index, parse_nccom(out.output), out.returncode))
        commands[-1].update(returncode=out.returncode, output_tail=tail(out.output, 10))
    if not verdicts:
        return DeepCheckResult(HW_CHECK, Status.SKIPPED, f"device(s) {skipped} have too few cores to test",
                               duration_s=time.monotonic() - started)
    status, summary, findings = _hw_result(verdicts, skipped)
    return DeepCheckResult(HW_CHECK, status, summary, findings, _hw_metrics(verdicts), {"commands": commands},
                           time.monotonic() - started)


def _hw_metrics(verdicts: list[DeviceVerdict]) -> dict[str, Any]:
    return {"devices_tested": len(verdicts),
            "passed": [v.device for v in verdicts if v.status is Status.PASSED],
            "failed": [v.device for v in verdicts if v.status is Status.FAILED],
            "errors": [v.device for v in verdicts if v.status is Status.ERROR],
            "busbw_gbs": {str(v.device): v.busbw_gbs for v in verdicts}}

