"""nvidia-smi passive check: parses `nvidia-smi -q -x` and the tool's error outputs into findings.

The XML layout follows NVIDIA's DTDs v11 (drivers 5xx up to 530: `clocks_throttle_reasons`) and v12+ (535 on:
`clocks_event_reasons`, `gpu_recovery_action` from 550/570); tests/fixtures/nvidia_smi holds the real captures.
"""

from __future__ import annotations

import re
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

from nodemedic.checks.base import CheckUnavailable, NodeContext, Poller
from nodemedic.checks.kernel_log.parser import normalize_bdf
from nodemedic.checks.tools import find_tool, run_tool
from nodemedic.model import Action, Finding, Severity

CHECK = "nvidia_smi"
NODE = "node"

_BDF = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]"
# Old drivers print "for GPU 0000:0B:00.0", newer ones "for GPU0000:07:00.0".
_DEVICE_HANDLE = re.compile(rf"Unable to determine the device handle for GPU ?(?P<bdf>{_BDF}): (?P<reason>.+)")
_INFOROM = re.compile(rf"infoROM is corrupted at gpu (?P<bdf>{_BDF})")
_NO_DEVICES = "No devices were found"
_DRIVER_DOWN = ("couldn't communicate with the NVIDIA driver", "Driver/library version mismatch")

# nvidia-smi exit codes (nvidia-smi(1) RETURN VALUE, the NVML return codes). 2 and 4 mean we cannot look.
_UNAVAILABLE_EXITS = {2: "invalid argument", 4: "permission denied"}
_EXIT_FAULTS: dict[int, tuple[str, str]] = {
    8: ("GPU_POWER_CABLE", "external power cables not properly attached"),
    9: ("NVIDIA_DRIVER_UNAVAILABLE", "NVIDIA driver is not loaded"),
    # An interrupt problem leaves the driver loaded but the GPU unreachable: closest to "no handle on the GPU".
    10: ("GPU_UNKNOWN_ERROR", "NVIDIA kernel detected an interrupt issue with a GPU"),
    12: ("NVIDIA_DRIVER_UNAVAILABLE", "NVML shared library could not be found or loaded"),
    14: ("GPU_INFOROM_CORRUPTED", "infoROM is corrupted"),
    15: ("GPU_LOST", "GPU has fallen off the bus or is otherwise inaccessible"),
}

# <gpu_recovery_action> text (and NVML field 230 numbers) -> the action the driver asks for.
_RECOVERY_NUMBERS = {"none": 0, "reset": 1, "gpu reset required": 1, "reboot": 2, "node reboot required": 2,
                     "drain p2p": 3, "drain and reset": 4}
_RECOVERY_ACTIONS = {1: Action.RESET_GPU, 2: Action.REBOOT, 3: Action.RESET_GPU, 4: Action.RESET_GPU}


@dataclass(frozen=True)
class SmiGpu:
    """One `<gpu>` of `nvidia-smi -q -x`; None means the field is N/A or absent in this driver's XML."""

    bus_id: str  # normalised like sysfs: "0000:3b:00.0"
    uuid: str | None
    product_name: str | None
    ecc_volatile_uncorrected: int | None
    retired_pages_pending: bool | None
    remap_pending: bool | None
    remap_failure: bool | None
    hw_slowdown: bool | None
    sw_thermal_slowdown: bool | None
    hw_thermal_slowdown: bool | None
    hw_power_brake: bool | None
    pcie_gen_current: int | None
    pcie_gen_max: int | None
    pcie_width_current: int | None
    pcie_width_max: int | None
    recovery_action: int | None  # 0 none, 1 reset, 2 node reboot, 3 drain P2P, 4 drain and reset
    recovery_action_text: str | None

    @property
    def component(self) -> str:
        return f"gpu:{self.bus_id}"


@dataclass(frozen=True)
class SmiReport:
    driver_version: str | None
    attached_gpus: int | None  # what the driver counts; may exceed len(gpus) when some GPUs cannot be queried
    gpus: tuple[SmiGpu, ...]


# -- XML ----------------------------------------------------------------------------------------------------------
def normalize_bus_id(text: str) -> str:
    """`00000000:3B:00.0` (nvidia-smi) -> `0000:3b:00.0` (sysfs, kernel-log findings)."""
    dom, bus, rest = text.strip().split(":")
    dev, _, fn = rest.partition(".")
    return normalize_bdf(dom, bus, dev, fn or None)


def _text(el: ET.Element | None, path: str) -> str | None:
    found = el.find(path) if el is not None else None
    if found is None or found.text is None:
        return None
    value = found.text.strip()
    return None if value in ("", "N/A") else value


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    m = re.match(r"(\d+)", value)  # "16x", "0", "192 bank(s)"
    return int(m.group(1)) if m else None


def _flag(value: str | None) -> bool | None:
    return {"yes": True, "active": True, "no": False, "not active": False}.get((value or "").lower())


def _ecc_uncorrected(gpu: ET.Element) -> int | None:
    vol = gpu.find("ecc_errors/volatile")
    if vol is None:
        return None
    if vol.find("double_bit") is not None:  # DTD v10 and older
        return _int(_text(vol, "double_bit/total"))
    # 550+ split the SRAM counter into parity/SECDED; when they exist, sram_uncorrectable is not added again.
    split = vol.find("sram_uncorrectable_parity") is not None or vol.find("sram_uncorrectable_secded") is not None
    names = (("sram_uncorrectable_parity", "sram_uncorrectable_secded") if split else ("sram_uncorrectable",))
    values = [_int(_text(vol, n)) for n in (*names, "dram_uncorrectable")]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _retired_pending(gpu: ET.Element) -> bool | None:
    # `pending_blacklist` is the old name of `pending_retirement`; drivers print both.
    flags = [_flag(_text(gpu, f"retired_pages/{n}")) for n in ("pending_retirement", "pending_blacklist")]
    known = [f for f in flags if f is not None]
    return any(known) if known else None


def _clock_reason(gpu: ET.Element, name: str) -> bool | None:
    block = gpu.find("clocks_event_reasons")
    prefix = "clocks_event_reason_"
    if block is None:  # DTD v11 and older
        block, prefix = gpu.find("clocks_throttle_reasons"), "clocks_throttle_reason_"
    return _flag(_text(block, prefix + name))


def _recovery_action(text: str | None) -> int | None:
    if text is None:
        return None
    lowered = text.lower()
    if lowered in _RECOVERY_NUMBERS:
        return _RECOVERY_NUMBERS[lowered]
    m = re.fullmatch(r"(0x[0-9a-f]+|\d+)(?: \((.*)\))?", lowered)  # "0x1 (GPU Reset Required)", "1"
    return int(m.group(1), 0) if m else None


def _gpu(el: ET.Element) -> SmiGpu:
    # <pci><pci_bus_id> and the id attribute carry the same address in every capture; the element is the
    # documented field, the attribute is the fallback.
    raw_bus = _text(el, "pci/pci_bus_id") or el.get("id")
    if not raw_bus:
        raise ValueError("nvidia-smi XML: a <gpu> has no PCI bus id")
    link = el.find("pci/pci_gpu_link_info")
    recovery = _text(el, "gpu_recovery_action")
    return SmiGpu(
        bus_id=normalize_bus_id(raw_bus),
        uuid=_text(el, "uuid"),
        product_name=_text(el, "product_name"),
        ecc_volatile_uncorrected=_ecc_uncorrected(el),
        retired_pages_pending=_retired_pending(el),
        # <remapped_rows>N/A</remapped_rows> (no children) on pre-Ampere and MIG -> None.
        remap_pending=_flag(_text(el, "remapped_rows/remapped_row_pending")),
        remap_failure=_flag(_text(el, "remapped_rows/remapped_row_failure")),
        hw_slowdown=_clock_reason(el, "hw_slowdown"),
        sw_thermal_slowdown=_clock_reason(el, "sw_thermal_slowdown"),
        hw_thermal_slowdown=_clock_reason(el, "hw_thermal_slowdown"),
        hw_power_brake=_clock_reason(el, "hw_power_brake_slowdown"),
        pcie_gen_current=_int(_text(link, "pcie_gen/current_link_gen")),
        pcie_gen_max=_int(_text(link, "pcie_gen/max_link_gen")),
        pcie_width_current=_int(_text(link, "link_widths/current_link_width")),
        pcie_width_max=_int(_text(link, "link_widths/max_link_width")),
        recovery_action=_recovery_action(recovery),
        recovery_action_text=recovery,
    )


def parse_smi_xml(text: str) -> SmiReport:
    """Parse `nvidia-smi -q -x` output; raises ValueError when it is not a well-formed nvidia_smi_log."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"nvidia-smi XML is malformed: {exc}") from exc
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"nvidia-smi XML: root element is <{root.tag}>, expected <nvidia_smi_log>")
    try:
        gpus = tuple(_gpu(g) for g in root.findall("gpu"))
    except (ValueError, IndexError) as exc:  # a bus id that does not split into domain:bus:dev.fn
        raise ValueError(f"nvidia-smi XML: bad GPU entry: {exc}") from exc
    return SmiReport(_text(root, "driver_version"), _int(_text(root, "attached_gpus")), gpus)


def extract_xml(output: str) -> str | None:
    """The XML document inside the tool's output (warnings may surround it), or None."""
    start = output.find("<?xml")
    if start < 0:
        start = output.find("<nvidia_smi_log")
    if start < 0:
        return None
    end = output.find("</nvidia_smi_log>", start)
    return output[start:] if end < 0 else output[start:end + len("</nvidia_smi_log>")]


# -- error outputs and exit codes -----------------------------------------------------------------------------------
def _finding(component: str, code: str, message: str, severity: Severity, now: float, healthy: bool = False,
             recommended_action: Action | None = None, **evidence: Any) -> Finding:
    return Finding(CHECK, component, code, message, Severity.INFO if healthy else severity, evidence, now,
                   healthy=healthy, recommended_action=recommended_action)


def classify_output(output: str, now: float | None = None) -> list[Finding]:
    """Findings for the error lines nvidia-smi prints (per-GPU handle failures, driver down, InfoROM)."""
    now = time.time() if now is None else now
    findings: list[Finding] = []
    for m in _DEVICE_HANDLE.finditer(output):
        bdf, reason = normalize_bus_id(m["bdf"]), m["reason"].strip()
        code = "GPU_LOST" if "GPU is lost" in reason else "GPU_UNKNOWN_ERROR"
        findings.append(_finding(f"gpu:{bdf}", code, f"nvidia-smi cannot get a handle on the GPU: {reason}",
                                 Severity.CRITICAL, now, line=m.group(0).strip(), pci=bdf, reason=reason))
    for m in _INFOROM.finditer(output):
        bdf = normalize_bus_id(m["bdf"])
        findings.append(_finding(f"gpu:{bdf}", "GPU_INFOROM_CORRUPTED", "GPU infoROM is corrupted", Severity.WARNING,
                                 now, line=m.group(0), pci=bdf))
    for needle in _DRIVER_DOWN:
        if needle in output:
            line = next(ln.strip() for ln in output.splitlines() if needle in ln)
            findings.append(_finding(NODE, "NVIDIA_DRIVER_UNAVAILABLE", f"nvidia-smi: {line}", Severity.CRITICAL,
                                     now, line=line))
            break
    return findings


def exit_code_finding(returncode: int, output: str, now: float | None = None) -> Finding | None:
    """The node-wide finding an nvidia-smi exit code stands for; CheckUnavailable for 2 and 4; None otherwise."""
    if returncode in _UNAVAILABLE_EXITS:
        raise CheckUnavailable(f"nvidia-smi exited {returncode} ({_UNAVAILABLE_EXITS[returncode]}): "
                               f"{output.strip()[-300:]}")
    if returncode not in _EXIT_FAULTS:
        return None
    code, meaning = _EXIT_FAULTS[returncode]
    return _finding(NODE, code, f"nvidia-smi exited {returncode}: {meaning}", Severity.CRITICAL,
                    time.time() if now is None else now, exit_code=returncode, output=output.strip()[-2000:])


# -- per-GPU conditions ---------------------------------------------------------------------------------------------
def _gpu_findings(gpu: SmiGpu, now: float, pcie_width: int | None = None) -> list[Finding]:
    ids = {"pci": gpu.bus_id, "uuid": gpu.uuid}
    conditions: list[tuple[str, str, Severity, bool | None, dict[str, Any]]] = [
        ("GPU_ECC_UNCORRECTED", "uncorrected ECC errors since the driver loaded", Severity.CRITICAL,
         None if gpu.ecc_volatile_uncorrected is None else gpu.ecc_volatile_uncorrected > 0,
         {"volatile_uncorrected": gpu.ecc_volatile_uncorrected}),
        ("GPU_RETIRED_PAGES_PENDING", "retired pages pending", Severity.ERROR, gpu.retired_pages_pending,
         {"retired_pages_pending": gpu.retired_pages_pending}),
        ("GPU_ROW_REMAP_PENDING", "row remapping pending", Severity.ERROR, gpu.remap_pending,
         {"remapped_row_pending": gpu.remap_pending}),
        ("GPU_ROW_REMAP_FAILURE", "row remapping failure", Severity.CRITICAL, gpu.remap_failure,
         {"remapped_row_failure": gpu.remap_failure}),
        ("GPU_HW_SLOWDOWN", "hardware slowdown active", Severity.WARNING, gpu.hw_slowdown,
         {"hw_slowdown": gpu.hw_slowdown}),
        ("GPU_THERMAL_SLOWDOWN", "thermal slowdown active", Severity.WARNING,
         _any(gpu.sw_thermal_slowdown, gpu.hw_thermal_slowdown),
         {"sw_thermal_slowdown": gpu.sw_thermal_slowdown, "hw_thermal_slowdown": gpu.hw_thermal_slowdown}),
        ("GPU_POWER_BRAKE", "hardware power brake slowdown active", Severity.WARNING, gpu.hw_power_brake,
         {"hw_power_brake_slowdown": gpu.hw_power_brake}),
        # Width only: GPUs drop the PCIe generation when idle (the A10G capture runs gen1 of gen4). And only against
        # the instance type's known width: AWS's own g4dn/g5 captures run x8 links of a x16 maximum.
        ("PCIE_LINK_DEGRADED", "PCIe link narrower than the instance type's width", Severity.WARNING,
         None if gpu.pcie_width_current is None or pcie_width is None else gpu.pcie_width_current < pcie_width,
         {"current_link_width": gpu.pcie_width_current, "max_link_width": gpu.pcie_width_max,
          "expected_link_width": pcie_width,
          "current_link_gen": gpu.pcie_gen_current, "max_link_gen": gpu.pcie_gen_max}),
    ]
    findings = []
    for code, what, severity, bad, raw in conditions:
        if bad is None:  # N/A on this GPU or driver: say nothing either way
            continue
        findings.append(_finding(gpu.component, code, what if bad else f"no {what}", severity, now,
                                 healthy=not bad, **ids, **raw))
    if gpu.recovery_action is not None:
        action = _RECOVERY_ACTIONS.get(gpu.recovery_action)
        findings.append(_finding(
            gpu.component, "GPU_RECOVERY_ACTION", f"GPU recovery action: {gpu.recovery_action_text}", Severity.ERROR,
            now, healthy=gpu.recovery_action == 0, recommended_action=action, **ids,
            recovery_action=gpu.recovery_action, recovery_action_text=gpu.recovery_action_text))
    return findings


def _any(*flags: bool | None) -> bool | None:
    known = [f for f in flags if f is not None]
    return any(known) if known else None


def _count_finding(found: int, expected: int, bus_ids: list[str], attached: int | None, now: float) -> Finding:
    evidence = {"found": found, "expected": expected, "bus_ids": bus_ids, "attached_gpus": attached}
    if found < expected:
        return _finding(NODE, "GPU_COUNT_MISMATCH", f"nvidia-smi sees {found} of {expected} GPUs",
                        Severity.CRITICAL, now, **evidence)
    return _finding(NODE, "GPU_COUNT_MISMATCH", f"nvidia-smi sees all {expected} GPUs", Severity.CRITICAL, now,
                    healthy=True, **evidence)


def evaluate(returncode: int, stdout: str, stderr: str = "", expected_gpus: int | None = None,
             now: float | None = None, pcie_width: int | None = None) -> list[Finding]:
    """Findings for one `nvidia-smi -q -x` run. Raises CheckUnavailable or ValueError when it tells nothing."""
    now = time.time() if now is None else now
    output = stdout + ("\n" + stderr if stderr else "")
    findings = classify_output(output, now)
    exit_finding = exit_code_finding(returncode, output, now)
    if exit_finding is not None and exit_finding.code not in {f.code for f in findings}:
        findings.append(exit_finding)

    report: SmiReport | None = None
    xml = extract_xml(stdout)
    if xml is not None:
        try:
            report = parse_smi_xml(xml)
        except ValueError:
            if returncode == 0 and not findings:
                raise
            # A failing run that left half an XML document: its error findings are what it has to say.

    no_devices = _NO_DEVICES in output
    if report is None and not findings and not no_devices:
        if returncode == 0:
            raise ValueError(f"nvidia-smi -q -x exited 0 without XML: {output.strip()[:300]!r}")
        raise CheckUnavailable(f"nvidia-smi exited {returncode}: {output.strip()[-300:]}")

    if expected_gpus and (report is not None or no_devices):
        gpus = report.gpus if report is not None else ()
        findings.append(_count_finding(len(gpus), expected_gpus, [g.bus_id for g in gpus],
                                       report.attached_gpus if report else None, now))
    if report is not None:
        if "NVIDIA_DRIVER_UNAVAILABLE" not in {f.code for f in findings}:
            findings.append(_finding(NODE, "NVIDIA_DRIVER_UNAVAILABLE", "nvidia-smi reached the driver",
                                     Severity.INFO, now, healthy=True))
        corrupted = {f.component for f in findings if f.code == "GPU_INFOROM_CORRUPTED"}
        for gpu in report.gpus:
            findings.extend(_gpu_findings(gpu, now, pcie_width))
            if gpu.component not in corrupted:
                findings.append(_finding(gpu.component, "GPU_INFOROM_CORRUPTED", "no infoROM warning",
                                         Severity.INFO, now, healthy=True))
    return findings


class NvidiaSmiPoller(Poller):
    """Runs `nvidia-smi -q -x` and reports GPU count, memory, clock, PCIe and recovery-action state."""

    name = CHECK

    def __init__(self, expected_gpus: int | None = None, binary: str = "nvidia-smi", timeout_s: float = 30.0,
                 interval_s: float = 60.0, pcie_width: int | None = None) -> None:
        self.expected_gpus = expected_gpus
        self.pcie_width = pcie_width
        self.binary = binary
        self.timeout_s = timeout_s
        self.interval_s = interval_s

    def applies(self, ctx: NodeContext) -> bool:
        if ctx.profile is not None:
            self.expected_gpus = self.expected_gpus if self.expected_gpus is not None else ctx.profile.gpus
            self.pcie_width = self.pcie_width if self.pcie_width is not None else ctx.profile.pcie_width
        # Expecting GPUs without the tool is itself worth reporting (as a check failure), so it still applies.
        return find_tool(self.binary) is not None or bool(self.expected_gpus and self.expected_gpus > 0)

    def run(self) -> list[Finding]:
        result = run_tool([self.binary, "-q", "-x"], self.timeout_s)
        return evaluate(result.returncode, result.stdout, result.stderr, self.expected_gpus,
                        pcie_width=self.pcie_width)
