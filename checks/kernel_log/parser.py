"""Kernel-log line classifier: NVIDIA Xid/SXid, GPU bus loss, PCIe AER, MCE/EDAC, Neuron and EFA errors.

Formats follow the drivers' own printk strings (NVIDIA open-gpu-kernel-modules kernel_rc.c, Linux
drivers/pci/pcie/aer.c before and after the 6.16 rewording, arch/x86 mce, EDAC, mm/memory-failure.c, the Neuron
driver's PRINTK ioctl and drivers/infiniband/hw/efa/efa_com.c); tests/fixtures/kernel_log holds real captures.
Almost every line of a kernel log is none of these, so a cheap substring prefilter runs before any regex.
"""

from __future__ import annotations

import re
import time

from nodemedic.model import Action, Finding, Severity

CHECK = "kernel_log"

# Substrings at least one of which every recognised line contains. Plain `in` tests are several times cheaper
# than one alternation regex over the whole line.
_TOKENS = ("NVRM", "Xid", "PCIe Bus Error", "AER:", "Hardware Error", "mce:", "EDAC", "Memory failure",
           "NEURON_HW_ERR", "efa ", "infiniband ")

_HEX = "[0-9a-fA-F]"
_XID = re.compile(
    rf"Xid \((?:PCI:)?(?P<dom>{_HEX}{{4,8}}):(?P<bus>{_HEX}{{2}}):(?P<dev>{_HEX}{{2}})(?:\.(?P<fn>[0-7]))?"
    r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?\): (?P<xid>\d+),? ?(?P<rest>.*)")
_SXID = re.compile(
    rf"nvidia-nvswitch(?P<sw>\d+): SXid \(PCI:(?P<bdf>{_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}(?:\.[0-7])?)\): "
    r"(?P<sxid>\d+),? ?(?P<rest>.*)")
_PID = re.compile(r"^pid=(?P<pid>'<unknown>'|\d+), (?:name=(?P<name>[^,]*), )?(?P<msg>.*)")
_RECOVERY = re.compile(r"GPU recovery action changed from 0x(?P<old>[0-9a-fA-F]+) \((?P<old_name>[^)]*)\) "
                       r"to 0x(?P<new>[0-9a-fA-F]+) \((?P<new_name>[^)]*)\)")
_BDF = rf"(?P<bdf>{_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}(?:\.[0-7])?)"
_FALLEN = re.compile(rf"NVRM: GPU (?:at )?(?:PCI:)?{_BDF}:? (?:GPU )?has fallen off the bus")
_FALLEN_MULTI_HEAD = re.compile(rf"NVRM: The NVIDIA GPU {_BDF}")
_RMINIT = re.compile(rf"NVRM: (?:GPU {_BDF}: )?RmInitAdapter failed! \((?P<code>[^)]*)\)")
_AER_DETAIL = re.compile(
    rf"(?P<drv>\S+) (?P<bdf>{_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}\.[0-7]): (?:AER: )?PCIe Bus Error: "
    r"severity=(?P<sev>[A-Za-z]+(?: \((?:Non-)?Fatal\))?), type=(?P<type>[^,]+), (?:id=\w+)?\((?P<agent>[^)]*)\)")
_AER_SUMMARY = re.compile(
    rf"(?P<port>{_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}\.[0-7]): AER: (?P<multi>Multiple )?"
    r"(?P<sev>Correct(?:ed|able)|Uncorrect(?:ed|able) \((?:Non-)?Fatal\)) error (?:message )?received"
    rf"(?: from|:) (?P<src>{_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}\.[0-7]|id=\w+)(?P<tail>.*)")
_MCE_BANK = re.compile(r"mce: \[Hardware Error\]: CPU (?P<cpu>\d+): Machine Check(?P<exc> Exception)?: "
                       r"(?P<mcgstatus>\w+) Bank (?P<bank>\d+): (?P<status>[0-9a-fA-F]+)")
_GHES = re.compile(r"\{\d+\}\[Hardware Error\]: event severity: (?P<sev>\w+)")
_EDAC = re.compile(r"EDAC (?:\w+ )?MC(?P<mc>\d+): (?P<count>\d+) (?P<kind>CE|UE) (?P<what>.*?) on (?P<where>\S+)")
_MEMFAIL = re.compile(r"Memory failure: (?P<pfn>0x[0-9a-fA-F]+): recovery action for (?P<page>.+?): "
                      r"(?P<result>\w+)")
_NEURON = re.compile(r"NEURON_HW_ERR=(?P<err>[A-Z0-9_]+)(?P<kv>(?: [\w-]+=\S*)*)")
_EFA = re.compile(rf"(?:efa (?P<bdf>{_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}\.[0-7])(?: (?P<ib>\w+))?|"
                  r"infiniband (?P<ib2>\w+)): (?P<msg>.*)")
_EFA_WEDGED = ("Admin queue is closed", "didn't send any completion for admin cmd",
               "didn't receive any MSI-X interrupt for admin cmd", "Wait for completion (polling) timeout",
               "Reading register timed out", "Device isn't ready, abort com init")
_EFA_FAILED = re.compile(r"Failed to (?:submit|process) command (?P<cmd>\w+) \(opcode (?P<op>\d+)\)"
                         r"(?: comp_status (?P<status>-?\d+))? err (?P<err>-?\d+)")

# Xid 154 and NVML's GPU recovery action field share these values (REFERENCE.md).
RECOVERY_ACTIONS: dict[int, Action] = {
    0: Action.NONE, 1: Action.RESET_GPU, 2: Action.REBOOT, 3: Action.RESET_GPU, 4: Action.RESET_GPU,
    5: Action.WATCH, 6: Action.RESET_GPU, 7: Action.REBOOT,
}
_SXID_SEVERITY = re.compile(r"^(?P<sev>Non-fatal|Fatal)\b", re.IGNORECASE)
_MCI_STATUS_UC = 1 << 61
_NEURON_ACTIONS = {"TERMINATE_INSTANCE": Action.REPLACE, "REBOOT": Action.REBOOT, "RESET": Action.REBOOT}


def normalize_bdf(dom: str, bus: str, dev: str, fn: str | None = None) -> str:
    """PCI address as sysfs writes it: at least 4 hex digits of domain, lowercase, with the function."""
    return f"{int(dom, 16):04x}:{bus.lower()}:{dev.lower()}.{fn or '0'}"


def _bdf(text: str) -> str:
    dom, bus, rest = text.split(":")
    dev, _, fn = rest.partition(".")
    return normalize_bdf(dom, bus, dev, fn or None)


class KernelLogClassifier:
    """Turns kernel-log lines into findings. Holds the little state multi-line driver messages need."""

    __slots__ = ("_pending_gpu",)

    def __init__(self) -> None:
        self._pending_gpu: str | None = None  # "The NVIDIA GPU <bdf>" seen, "fallen off the bus" may follow

    def classify(self, line: str, now: float | None = None) -> Finding | None:
        for tok in _TOKENS:
            if tok in line:
                break
        else:
            return None
        return self._classify(line, time.time() if now is None else now)

    def _classify(self, line: str, now: float) -> Finding | None:
        if "Xid" in line:
            if "SXid" in line:
                return self._sxid(line, now)
            return self._xid(line, now)
        if "NVRM" in line:
            return self._nvrm(line, now)
        if "NEURON_HW_ERR" in line:
            return self._neuron(line, now)
        if "PCIe Bus Error" in line or "AER:" in line:
            return self._aer(line, now)
        if "EDAC" in line:
            return self._edac(line, now)
        if "Hardware Error" in line or "mce:" in line:
            return self._mce(line, now)
        if "Memory failure" in line:
            return self._memfail(line, now)
        return self._efa(line, now)

    # -- NVIDIA ------------------------------------------------------------------------------------------------
    def _xid(self, line: str, now: float) -> Finding | None:
        m = _XID.search(line)
        if m is None:
            return None
        xid = int(m["xid"])
        bdf = normalize_bdf(m["dom"], m["bus"], m["dev"], m["fn"])
        evidence: dict[str, object] = {"line": line, "xid": xid, "pci": bdf}
        rest = m["rest"]
        pm = _PID.match(rest)
        if pm is not None:
            evidence["pid"] = pm["pid"].strip("'")
            if pm["name"] is not None:
                evidence["process"] = pm["name"]
            rest = pm["msg"]
        if m["gi"] is not None:
            evidence["gpu_instance"] = int(m["gi"])
            if m["ci"] is not None:
                evidence["compute_instance"] = int(m["ci"])
        component = f"gpu:{bdf}"
        if xid == 154:
            rm = _RECOVERY.search(rest)
            if rm is not None:
                new = int(rm["new"], 16)
                evidence.update(recovery_action=new, recovery_action_name=rm["new_name"],
                                previous_recovery_action=int(rm["old"], 16))
                action = RECOVERY_ACTIONS.get(new, Action.WATCH)
                if action is Action.NONE:
                    return Finding(CHECK, component, "XID_154", f"Xid 154: {rest}", Severity.INFO, evidence, now,
                                   healthy=True)
                return Finding(CHECK, component, "XID_154", f"Xid 154: {rest}", Severity.ERROR, evidence, now,
                               recommended_action=action)
        return Finding(CHECK, component, f"XID_{xid}", f"Xid {xid}: {rest}".rstrip(), Severity.ERROR, evidence, now)

    def _sxid(self, line: str, now: float) -> Finding | None:
        m = _SXID.search(line)
        if m is None:
            return None
        sxid = int(m["sxid"])
        bdf = _bdf(m["bdf"])
        rest = m["rest"]
        evidence: dict[str, object] = {"line": line, "sxid": sxid, "pci": bdf, "nvswitch": int(m["sw"])}
        action = None
        sm = _SXID_SEVERITY.match(rest)
        if sm is not None:
            fatal = sm["sev"].lower() == "fatal"
            evidence["fatal"] = fatal
            action = Action.REBOOT if fatal else Action.WATCH
        return Finding(CHECK, f"nvswitch:{bdf}", f"SXID_{sxid}", f"SXid {sxid}: {rest}".rstrip(),
                       Severity.CRITICAL if action is Action.REBOOT else Severity.WARNING, evidence, now,
                       recommended_action=action)

    def _nvrm(self, line: str, now: float) -> Finding | None:
        if "fallen off the bus" in line:
            m = _FALLEN.search(line)
            bdf = _bdf(m["bdf"]) if m is not None else self._pending_gpu
            if bdf is None:
                head = _FALLEN_MULTI_HEAD.search(line)  # the whole multi-line record in one (/dev/kmsg)
                bdf = _bdf(head["bdf"]) if head is not None else None
            self._pending_gpu = None
            # The same fault as Xid 79, which newer drivers print without the Xid: one code, so they dedup.
            return Finding(CHECK, f"gpu:{bdf}" if bdf else "gpu:unknown", "XID_79",
                           "GPU has fallen off the bus", Severity.CRITICAL,
                           {"line": line, "xid": 79, "pci": bdf, "source": "fallen-off-bus message"}, now)
        head = _FALLEN_MULTI_HEAD.search(line)
        if head is not None:
            self._pending_gpu = _bdf(head["bdf"])
            return None
        if "RmInitAdapter failed" in line:
            m = _RMINIT.search(line)
            if m is None:
                return None
            bdf = _bdf(m["bdf"]) if m["bdf"] else None
            return Finding(CHECK, f"gpu:{bdf}" if bdf else "gpu:unknown", "GPU_INIT_FAILED",
                           f"RmInitAdapter failed ({m['code']})", Severity.CRITICAL,
                           {"line": line, "pci": bdf, "rm_code": m["code"]}, now)
        return None

    # -- PCIe ----------------------------------------------------------------------------------------------------
    def _aer(self, line: str, now: float) -> Finding | None:
        m = _AER_DETAIL.search(line)
        if m is not None:
            # One detail line per error per device: this is the line that is counted.
            bdf = _bdf(m["bdf"])
            code = _aer_code(m["sev"])
            return Finding(CHECK, f"pci:{bdf}", code, f"PCIe {m['sev']} error, {m['type']} ({m['agent']})",
                           _AER_SEVERITY[code], {"line": line, "pci": bdf, "driver": m["drv"],
                                                 "layer": m["type"], "agent": m["agent"]}, now)
        m = _AER_SUMMARY.search(line)
        if m is not None and "no details found" in m["tail"]:
            # Normally a detail line follows and carries the error; without details this line is all there is.
            src = m["src"]
            bdf = _bdf(src) if not src.startswith("id=") else _bdf(m["port"])
            code = _aer_code(m["sev"])
            return Finding(CHECK, f"pci:{bdf}", code, f"PCIe {m['sev']} error (no details)", _AER_SEVERITY[code],
                           {"line": line, "pci": bdf, "port": _bdf(m["port"])}, now)
        return None

    # -- host CPU / memory ---------------------------------------------------------------------------------------
    def _mce(self, line: str, now: float) -> Finding | None:
        if "Machine check events logged" in line:
            return Finding(CHECK, "cpu", "MCE_CORRECTED", "machine check events logged", Severity.WARNING,
                           {"line": line}, now)
        m = _MCE_BANK.search(line)
        if m is not None:
            status = int(m["status"], 16)
            uncorrected = bool(m["exc"]) or bool(status & _MCI_STATUS_UC)
            code = "MCE_UNCORRECTED" if uncorrected else "MCE_CORRECTED"
            return Finding(CHECK, f"cpu:{m['cpu']}", code,
                           f"machine check on CPU {m['cpu']} bank {m['bank']}: status {m['status']}",
                           Severity.CRITICAL if uncorrected else Severity.WARNING,
                           {"line": line, "cpu": int(m["cpu"]), "bank": int(m["bank"]), "status": m["status"]}, now)
        if "Uncorrected hardware memory error" in line:
            return Finding(CHECK, "memory", "MCE_UNCORRECTED", "uncorrected hardware memory error",
                           Severity.CRITICAL, {"line": line}, now)
        m = _GHES.search(line)
        if m is not None:
            sev = m["sev"].lower()
            if sev == "info":
                return None
            code = "MCE_CORRECTED" if sev == "corrected" else "MCE_UNCORRECTED"
            return Finding(CHECK, "memory", code, f"APEI hardware error, severity {sev}",
                           Severity.WARNING if sev == "corrected" else Severity.CRITICAL, {"line": line}, now)
        if "[Hardware Error]: Corrected error, no action required" in line:
            return Finding(CHECK, "cpu", "MCE_CORRECTED", "corrected machine check", Severity.WARNING,
                           {"line": line}, now)
        if "[Hardware Error]: Uncorrected, " in line:
            return Finding(CHECK, "cpu", "MCE_UNCORRECTED", "uncorrected machine check", Severity.CRITICAL,
                           {"line": line}, now)
        return None

    def _edac(self, line: str, now: float) -> Finding | None:
        m = _EDAC.search(line)
        if m is None:
            return None
        code = f"EDAC_{m['kind']}"
        return Finding(CHECK, f"memory:mc{m['mc']}", code,
                       f"{m['count']} {m['kind']} {m['what']} on {m['where']}",
                       Severity.CRITICAL if m["kind"] == "UE" else Severity.WARNING,
                       {"line": line, "count": int(m["count"]), "location": m["where"]}, now)

    def _memfail(self, line: str, now: float) -> Finding | None:
        m = _MEMFAIL.search(line)
        if m is None:
            return None
        return Finding(CHECK, "memory", "MEMORY_FAILURE",
                       f"poisoned page {m['pfn']} ({m['page']}): {m['result']}",
                       Severity.WARNING if m["result"] == "Recovered" else Severity.ERROR,
                       {"line": line, "pfn": m["pfn"], "page": m["page"], "result": m["result"]}, now)

    # -- AWS accelerators and network ----------------------------------------------------------------------------
    def _neuron(self, line: str, now: float) -> Finding | None:
        m = _NEURON.search(line)
        if m is None:
            return None
        fields = dict(kv.split("=", 1) for kv in m["kv"].split())
        device = fields.get("nd-id")
        evidence: dict[str, object] = {"line": line, "error": m["err"], **fields}
        return Finding(CHECK, f"neuron:{device}" if device is not None else "neuron:unknown",
                       f"NEURON_{m['err']}", f"Neuron hardware error {m['err']}"
                       + (f" on device {device} core {fields.get('nc-id')}" if device is not None else ""),
                       Severity.CRITICAL, evidence, now,
                       recommended_action=_NEURON_ACTIONS.get(fields.get("action", "")))

    def _efa(self, line: str, now: float) -> Finding | None:
        m = _EFA.search(line)
        if m is None:
            return None
        msg = m["msg"]
        dev = m["ib"] or m["ib2"] or (_bdf(m["bdf"]) if m["bdf"] else "unknown")
        evidence: dict[str, object] = {"line": line, "device": dev}
        if m["bdf"]:
            evidence["pci"] = _bdf(m["bdf"])
        for sig in _EFA_WEDGED:
            if sig in msg:
                return Finding(CHECK, f"efa:{dev}", "EFA_ADMIN_QUEUE_FAILURE", f"EFA admin queue failure: {msg}",
                               Severity.CRITICAL, evidence, now)
        fm = _EFA_FAILED.search(msg)
        if fm is None:
            return None
        # AWS documents DEREG_MR comp_status 7 after a process exits as benign: never a device fault.
        if fm["cmd"] == "DEREG_MR" and fm["status"] == "7":
            return None
        if fm["err"] == "-19":  # ENODEV: the admin queue is already closed
            return Finding(CHECK, f"efa:{dev}", "EFA_ADMIN_QUEUE_FAILURE", f"EFA command failed: {msg}",
                           Severity.CRITICAL, evidence, now)
        evidence.update(command=fm["cmd"], comp_status=fm["status"], err=fm["err"])
        return Finding(CHECK, f"efa:{dev}", "EFA_DEVICE_ERROR", f"EFA command failed: {msg}", Severity.ERROR,
                       evidence, now)


def _aer_code(sev: str) -> str:
    if sev.startswith("Correct"):
        return "PCIE_AER_CORRECTED"
    if "Non-Fatal" in sev:
        return "PCIE_AER_NONFATAL"
    return "PCIE_AER_FATAL"


_AER_SEVERITY = {"PCIE_AER_CORRECTED": Severity.WARNING, "PCIE_AER_NONFATAL": Severity.ERROR,
                 "PCIE_AER_FATAL": Severity.CRITICAL}
