"""DCGM passive checks through `dcgmi`: health watches (a poller) and policy violations (a watcher).

Formats follow DCGM's own dcgmi sources (dcgmi/Health.cpp, dcgmi/Policy.cpp, dcgmi/DcgmiOutput.cpp, Command.cpp);
tests/fixtures/dcgm/NOTES.md says which fixtures are real captures and which are built from those sources.
DCGM not answering is never a GPU fault: it is CheckUnavailable, then DCGM_UNREACHABLE on the node if it lasts.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from nodemedic.checks.base import CheckUnavailable, Emit, NodeContext, Poller, Watcher
from nodemedic.checks.kernel_log.parser import normalize_bdf
from nodemedic.checks.tools import ToolExited, ToolResult, find_tool, follow_tool, run_tool
from nodemedic.model import Action, Finding, Severity

log = logging.getLogger(__name__)

HEALTH_CHECK = "dcgm.health"
POLICY_CHECK = "dcgm.policy"
NODE = "node"
UNREACHABLE = "DCGM_UNREACHABLE"

# Command::Connect / DoExecuteConnectionFailure print these and dcgmi exits with DCGM_ST_CONNECTION_NOT_VALID.
_CONNECTION_ERRORS = ("unable to establish a connection", "unable to connect to host engine",
                      "host engine connection invalid")
_WATCHES_NOT_ENABLED = "Health watches not enabled"


def _host_args(host: str | None) -> list[str]:
    return ["--host", host] if host else []


def _is_connection_error(result: ToolResult) -> bool:
    text = result.output.lower()
    return any(marker in text for marker in _CONNECTION_ERRORS)


def _first_line(result: ToolResult) -> str:
    lines = [ln.strip() for ln in result.output.splitlines() if ln.strip()]
    return lines[0][:200] if lines else "no output"


# -- dcgmi discovery -l -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DcgmGpu:
    gpu_id: int
    pci_bus_id: str | None  # normalised like sysfs: "0000:18:00.0"
    name: str | None  # None when DCGM prints "<<<NULL>>>"
    uuid: str | None


_DISCOVERY_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*Name:\s*(.*?)\s*\|")
_DISCOVERY_BUS = re.compile(r"PCI Bus ID:\s*([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])")
_DISCOVERY_UUID = re.compile(r"Device UUID:\s*(\S+)")


def parse_discovery(text: str) -> dict[int, DcgmGpu]:
    """GPU id -> GPU from the `dcgmi discovery -l` table (the GPU section only; switches and CPUs are skipped)."""
    gpus: dict[int, DcgmGpu] = {}
    current: dict[str, Any] | None = None
    in_gpus = False

    def close() -> None:
        if current is not None:
            gpus[current["gpu_id"]] = DcgmGpu(**current)

    for line in text.splitlines():
        if "GPU ID" in line:
            in_gpus = True
            continue
        if re.search(r"Switch ID|CPU ID|NvSwitch(es)? found|CPUs? found", line):
            in_gpus = False
        if not in_gpus:
            continue
        if m := _DISCOVERY_ROW.match(line.strip()):
            close()
            name = m.group(2)
            current = {"gpu_id": int(m.group(1)), "pci_bus_id": None, "uuid": None,
                       "name": None if name in ("", "<<<NULL>>>") else name}
        elif current is not None and (m := _DISCOVERY_BUS.search(line)):
            current["pci_bus_id"] = normalize_bdf(*m.groups())
        elif current is not None and (m := _DISCOVERY_UUID.search(line)):
            current["uuid"] = m.group(1)
    close()
    return gpus


def discover(binary: str, host: str | None, timeout_s: float) -> dict[int, DcgmGpu]:
    """Runs `dcgmi discovery -l`; CheckUnavailable when DCGM cannot be asked."""
    result = run_tool([binary, "discovery", "-l", *_host_args(host)], timeout_s)
    if result.returncode != 0:
        raise CheckUnavailable(f"DCGM not available: dcgmi discovery exited {result.returncode}: "
                               f"{_first_line(result)}")
    return parse_discovery(result.stdout)


def gpu_component(gpu_id: int, gpus: dict[int, DcgmGpu]) -> str:
    gpu = gpus.get(gpu_id)
    return f"gpu:{gpu.pci_bus_id}" if gpu is not None and gpu.pci_bus_id else f"gpu:dcgm-{gpu_id}"


# -- dcgmi health -c -j -------------------------------------------------------------------------------------------

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
_RESULTS = {"Healthy": PASS, "Warning": WARN, "Failure": FAIL}

# Health::HelperSystemToString -> the suffix of the DCGM_HEALTH_<SYS> catalog code.
SYSTEMS = {
    "PCIe system": "PCIE", "NVLINK system": "NVLINK", "PMU system": "PMU", "MCU system": "MCU",
    "Memory system": "MEM", "SM system": "SM", "InfoROM system": "INFOROM", "Thermal system": "THERMAL",
    "Power system": "POWER", "Driver": "DRIVER",
}
# A failing InfoROM, thermal or power watch degrades the GPU but does not call for a reboot.
_FAIL_WATCH_ONLY = {"INFOROM", "THERMAL", "POWER"}


@dataclass(frozen=True)
class HealthIncident:
    """One entity's result for one health system."""

    entity_group: str  # "GPU", or another DCGM entity group name ("Switch", ...)
    entity_id: int
    system: str  # catalog suffix: "PCIE", "MEM", ...
    result: str  # PASS, WARN or FAIL
    message: str
    system_name: str  # as dcgmi printed it: "PCIe system"


@dataclass(frozen=True)
class HealthReport:
    overall: str
    incidents: list[HealthIncident] = field(default_factory=list)


def _system_code(group: str, name: str) -> str | None:
    if name in SYSTEMS:
        return SYSTEMS[name]
    # HelperSystemToString has no NvSwitch case: switch incidents come out as "Internal error".
    if "switch" in group.lower() or "switch" in name.lower():
        return "NVSWITCH"
    return None


def parse_health(text: str) -> HealthReport:
    """`dcgmi health -c -j`: body -> {"Overall Health": {value}, "<group>": {children: {<id>: {children: {Errors:
    {children: {<system>: {value, overflow: [message parts]}}}}}}}} (Health::HandleOneEntity, DcgmiOutputJson)."""
    try:
        body = json.loads(text)["body"]
        overall = _RESULTS.get(body["Overall Health"]["value"], WARN)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a dcgmi health report: {exc}") from exc
    incidents = []
    for group, node in body.items():
        if group == "Overall Health" or not isinstance(node, dict):
            continue
        for entity, detail in node.get("children", {}).items():
            if not entity.isdigit():
                continue
            errors = detail.get("children", {}).get("Errors", {}).get("children", {})
            for name, system in errors.items():
                code = _system_code(group, name)
                if code is None:
                    log.warning("dcgm health: unknown system %r on %s %s", name, group, entity)
                    continue
                # Long messages are cut into ~54-character pieces for the text table; JSON keeps the pieces.
                message = " ".join(part.strip() for part in system.get("overflow", []))
                incidents.append(HealthIncident(group, int(entity), code, _RESULTS.get(system.get("value"), WARN),
                                                message, name))
    return HealthReport(overall, incidents)


# -- the health poller --------------------------------------------------------------------------------------------

class DcgmHealthPoller(Poller):
    """Sets DCGM health watches for all systems once, then reports `dcgmi health -c -j` per GPU and system."""

    name = HEALTH_CHECK

    def __init__(self, binary: str = "dcgmi", host: str | None = None, timeout_s: float = 30.0,
                 interval_s: float = 60.0, unreachable_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.binary = binary
        self.host = host
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.unreachable_after_s = unreachable_after_s
        self.clock = clock
        self._watches_set = False
        self._gpus: dict[int, DcgmGpu] | None = None
        self._down_since: float | None = None
        self._clear_unreachable = True  # the first answer also clears a DCGM_UNREACHABLE left by an earlier run

    def applies(self, ctx: NodeContext) -> bool:
        return find_tool(self.binary) is not None

    def run(self) -> list[Finding]:
        try:
            report = self._contact()
        except CheckUnavailable as exc:
            return self._unreachable(str(exc))
        findings = self._findings(report)
        self._down_since = None
        if self._clear_unreachable:
            self._clear_unreachable = False
            findings.append(Finding(HEALTH_CHECK, NODE, UNREACHABLE, "DCGM host engine answers",
                                    severity=Severity.INFO, healthy=True))
        return findings

    def _dcgmi(self, *args: str) -> ToolResult:
        result = run_tool([self.binary, *args, *_host_args(self.host)], self.timeout_s)
        if result.returncode != 0 and _is_connection_error(result):
            raise CheckUnavailable(f"DCGM not available: {_first_line(result)}")
        return result

    def _contact(self) -> HealthReport:
        if not self._watches_set:
            self._set_watches()
        result = self._dcgmi("health", "-c", "-j")
        if result.returncode != 0 and _WATCHES_NOT_ENABLED in result.output:
            # A restarted host engine forgets its watches: set them again and ask once more.
            self._set_watches()
            result = self._dcgmi("health", "-c", "-j")
        if result.returncode != 0:
            raise CheckUnavailable(f"DCGM not available: dcgmi health exited {result.returncode}: "
                                   f"{_first_line(result)}")
        if self._gpus is None:
            try:
                self._gpus = discover(self.binary, self.host, self.timeout_s)
            except CheckUnavailable as exc:
                log.warning("dcgm health: no GPU list from dcgmi discovery (%s); naming GPUs by DCGM id", exc)
        try:
            return parse_health(result.stdout)
        except ValueError as exc:
            raise CheckUnavailable(f"DCGM not available: {exc}") from exc

    def _set_watches(self) -> None:
        # `-s a` is every system dcgmi can set (PCIe, memory, InfoROM, thermal, power, NVLink, NvSwitch);
        # letters cannot be combined with `a`.
        result = self._dcgmi("health", "-s", "a")
        if result.returncode != 0:
            raise CheckUnavailable(f"DCGM not available: cannot set health watches: {_first_line(result)}")
        self._watches_set = True

    def _unreachable(self, reason: str) -> list[Finding]:
        # Watches and GPU ids are the host engine's state: ask for them again once it is back.
        self._watches_set = False
        self._gpus = None
        now = self.clock()
        if self._down_since is None:
            self._down_since = now
        down_for = now - self._down_since
        if down_for <= self.unreachable_after_s:
            raise CheckUnavailable(reason if reason.startswith("DCGM not available") else
                                   f"DCGM not available: {reason}")
        self._clear_unreachable = True
        return [Finding(HEALTH_CHECK, NODE, UNREACHABLE,
                        f"DCGM host engine unreachable for {down_for:.0f}s: {reason}",
                        severity=Severity.WARNING, evidence={"reason": reason, "down_for_s": round(down_for, 1)})]

    def _findings(self, report: HealthReport) -> list[Finding]:
        gpus = self._gpus or {}
        findings = []
        seen: set[tuple[int, str]] = set()
        for inc in report.incidents:
            is_gpu = inc.entity_group == "GPU"
            if is_gpu:
                seen.add((inc.entity_id, inc.system))
            if inc.result == PASS:
                continue
            component = (gpu_component(inc.entity_id, gpus) if is_gpu
                         else f"{inc.entity_group.lower()}:dcgm-{inc.entity_id}")
            failed = inc.result == FAIL
            action = Action.REBOOT if failed and inc.system not in _FAIL_WATCH_ONLY else Action.WATCH
            word = "Failure" if failed else "Warning"
            findings.append(Finding(
                HEALTH_CHECK, component, f"DCGM_HEALTH_{inc.system}",
                f"DCGM health {inc.system_name}: {word} on {inc.entity_group} {inc.entity_id}: {inc.message}",
                severity=Severity.ERROR if failed else Severity.WARNING, recommended_action=action,
                evidence={"dcgm_entity": f"{inc.entity_group}:{inc.entity_id}", "system": inc.system_name,
                          "result": inc.result, "message": inc.message}))
        gpu_ids = set(gpus) | {gpu_id for gpu_id, _ in seen}
        for gpu_id in sorted(gpu_ids):
            for system in dict.fromkeys(SYSTEMS.values()):
                if (gpu_id, system) not in seen:
                    findings.append(Finding(HEALTH_CHECK, gpu_component(gpu_id, gpus), f"DCGM_HEALTH_{system}",
                                            f"DCGM health {system} passes on GPU {gpu_id}",
                                            severity=Severity.INFO, healthy=True))
        return findings


# -- dcgmi policy --reg -------------------------------------------------------------------------------------------

# Policy::ListenForViolations: "Timestamp: <ctime>", a headline, then this many "<name>: <value>" lines.
_VIOLATIONS: list[tuple[re.Pattern[str], str, str, int]] = [
    (re.compile(r"double-bit ECC error has violated", re.I), "dbe", "GPU_ECC_UNCORRECTED", 1),
    (re.compile(r"PCIe .*has violated", re.I), "pcie", "PCIE_REPLAY_ERRORS", 1),
    (re.compile(r"retired pages has violated", re.I), "max_pages", "GPU_RETIRED_PAGES_LIMIT", 2),
    (re.compile(r"thermal limit has violated", re.I), "thermal", "GPU_THERMAL_VIOLATION", 1),
    (re.compile(r"power limit has violated", re.I), "power", "GPU_POWER_VIOLATION", 1),
    (re.compile(r"NVLink Counter (?P<field>\d+) has violated", re.I), "nvlink", "NVLINK_ERRORS", 1),
    (re.compile(r"XID error (?P<xid>\d+) detected", re.I), "xid", "XID_", 0),
]
_LISTENING = re.compile(r"^Listening for violations\.?\s*$")
_TIMESTAMP = re.compile(r"^Timestamp:\s*(.*)$")
_DETAIL = re.compile(r"^([A-Za-z][\w .-]*?):\s*(-?\d+)\s*$")
# dcgmi never prints a GPU id with a violation today; use one if a version does.
_GPU_ID = re.compile(r"\bGPU(?: ID)?:?\s+(\d+)\b")


@dataclass
class PolicyViolation:
    kind: str  # dbe, pcie, max_pages, thermal, power, nvlink, xid
    code: str
    headline: str
    timestamp: str | None = None
    values: dict[str, int] = field(default_factory=dict)
    xid: int | None = None
    nvlink_field: int | None = None
    gpu_id: int | None = None
    expected_details: int = 0

    @property
    def complete(self) -> bool:
        return len(self.values) >= self.expected_details


class PolicyViolationParser:
    """Turns `dcgmi policy --reg` lines into violations; a violation is handed out once its details are in."""

    def __init__(self) -> None:
        self.listening = False
        self._timestamp: str | None = None
        self._pending: PolicyViolation | None = None

    def feed(self, line: str) -> list[PolicyViolation]:
        line = line.strip()
        out: list[PolicyViolation] = []
        if not line:
            return out
        if _LISTENING.match(line):
            self.listening = True
            return out
        if m := _TIMESTAMP.match(line):
            out += self.flush()
            self._timestamp = m.group(1).strip()
            return out
        for pattern, kind, code, details in _VIOLATIONS:
            if m := pattern.search(line):
                out += self.flush()
                groups = m.groupdict()
                v = PolicyViolation(kind, code, line, self._timestamp, expected_details=details)
                if groups.get("xid"):
                    v.xid = int(groups["xid"])
                    v.code = f"XID_{v.xid}"
                if groups.get("field"):
                    v.nvlink_field = int(groups["field"])
                self._timestamp = None
                self._pending = v
                break
        else:
            if "has violated policy manager values" in line:
                log.warning("dcgm policy: unrecognised violation %r", line)
            elif self._pending is not None and (m := _DETAIL.match(line)):
                self._pending.values[m.group(1)] = int(m.group(2))
            if self._pending is not None and (m := _GPU_ID.search(line)):
                self._pending.gpu_id = int(m.group(1))
        if self._pending is not None and self._pending.complete:
            out += self.flush()
        return out

    def flush(self) -> list[PolicyViolation]:
        """The violation in progress, whether or not its detail lines came (the doc example prints none)."""
        pending, self._pending = self._pending, None
        return [pending] if pending is not None else []


def violation_finding(v: PolicyViolation, component: str) -> Finding:
    details = ", ".join(f"{k}: {n}" for k, n in v.values.items())
    evidence: dict[str, Any] = {"condition": v.kind, "headline": v.headline, "timestamp": v.timestamp, **v.values}
    if v.xid is not None:
        evidence["xid"] = v.xid
    if v.nvlink_field is not None:
        evidence["nvlink_field_id"] = v.nvlink_field
    if v.gpu_id is not None:
        evidence["dcgm_gpu_id"] = v.gpu_id
    return Finding(POLICY_CHECK, component, v.code,
                   f"DCGM policy violation: {v.headline}" + (f" ({details})" if details else ""),
                   severity=Severity.WARNING, evidence=evidence)


_POLL_MS = 100
_DETAIL_WAIT_S = 0.5  # a violation still missing detail lines after this long is reported without them


class DcgmPolicyWatcher(Watcher):
    """Sets DCGM policy conditions, then follows `dcgmi policy --reg` and reports each violation."""

    name = POLICY_CHECK

    def __init__(self, binary: str = "dcgmi", host: str | None = None, group: int = 0, timeout_s: float = 30.0,
                 max_retired_pages: int = 60, max_temp_c: int = 90, max_power_w: int | None = None):
        self.binary = binary
        self.host = host
        self.group = group
        self.timeout_s = timeout_s
        self.max_retired_pages = max_retired_pages
        self.max_temp_c = max_temp_c
        # No default: a power threshold only makes sense against the GPU's own limit (400 W A100, 700 W H100).
        self.max_power_w = max_power_w
        self._ready = threading.Event()
        self._gpus: dict[int, DcgmGpu] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def applies(self, ctx: NodeContext) -> bool:
        return find_tool(self.binary) is not None

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def set_policy_args(self) -> list[str]:
        args = [self.binary, "policy", "-g", str(self.group), "--set", "0,0", "-e", "-p", "-n", "-x",
                "-M", str(self.max_retired_pages), "-T", str(self.max_temp_c)]
        if self.max_power_w is not None:
            args += ["-P", str(self.max_power_w)]
        return args + _host_args(self.host)

    def watch(self, emit: Emit, stop: threading.Event) -> None:
        self._ready.clear()
        exe = find_tool(self.binary)
        if exe is None:
            raise CheckUnavailable(f"{self.binary} not found")
        result = run_tool(self.set_policy_args(), self.timeout_s)
        if result.returncode != 0:
            raise CheckUnavailable(f"DCGM not available: cannot set policy: {_first_line(result)}")
        args = [exe, "policy", "-g", str(self.group), "--reg", *_host_args(self.host)]
        # dcgmi prints "Listening for violations." without flushing: line-buffer it so the pipe sees it now.
        if stdbuf := find_tool("stdbuf"):
            args = [stdbuf, "-oL", *args]
        parser = PolicyViolationParser()
        last_data = time.monotonic()
        try:
            for lines in follow_tool(args, stop, poll_s=_POLL_MS / 1000, on_start=self._started):
                if not lines:
                    if time.monotonic() - last_data >= _DETAIL_WAIT_S:
                        self._emit(parser.flush(), emit)
                    continue
                last_data = time.monotonic()
                for line in lines:
                    violations = parser.feed(line)
                    if parser.listening or violations:
                        self._ready.set()
                    self._emit(violations, emit)
        except ToolExited as exc:
            self._emit(parser.flush(), emit)
            if any(marker in str(exc).lower() for marker in _CONNECTION_ERRORS):
                raise CheckUnavailable(f"DCGM not available: {' | '.join(exc.tail).strip()[:300]}") from None
            raise RuntimeError(str(exc).replace("dcgmi exited", "dcgmi policy --reg exited", 1)) from None

    def _started(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def _emit(self, violations: list[PolicyViolation], emit: Emit) -> None:
        for v in violations:
            emit(violation_finding(v, self._component(v)))

    def _component(self, v: PolicyViolation) -> str:
        if v.gpu_id is None:
            return NODE
        if self._gpus is None:
            try:
                self._gpus = discover(self.binary, self.host, self.timeout_s)
            except CheckUnavailable as exc:
                log.warning("dcgm policy: no GPU list from dcgmi discovery (%s)", exc)
                return gpu_component(v.gpu_id, {})
        return gpu_component(v.gpu_id, self._gpus)

