"""NVML checks (pynvml from nvidia-ml-py): an event watcher for Xid/ECC/poison/recovery events and a field poller.

The NVML module is a seam: production code imports `pynvml`; tests hand in a fake with the same names.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from nodemedic.checks.base import CheckUnavailable, Emit, NodeContext, Poller, Watcher
from nodemedic.checks.kernel_log.parser import RECOVERY_ACTIONS, normalize_bdf
from nodemedic.checks.platform.pci import nvidia_gpu_addresses
from nodemedic.model import Action, Finding, Severity

log = logging.getLogger(__name__)

EVENTS_CHECK = "nvml.events"
FIELDS_CHECK = "nvml.fields"
WAIT_MS = 500                # nvmlEventSetWait timeout: how quickly the watcher notices `stop`
REPLAY_DELTA_LIMIT = 100     # PCIe replays between two polls that count as a degrading link
FI_RECOVERY_ACTION = 230     # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (older bindings lack the constant)

# event type name in pynvml -> (code, severity); Xid and recovery-action events are decoded separately.
_EVENTS: dict[str, tuple[str, Severity]] = {
    "nvmlEventTypeSingleBitEccError": ("GPU_ECC_CORRECTED", Severity.WARNING),
    "nvmlEventTypeDoubleBitEccError": ("GPU_ECC_UNCORRECTED", Severity.CRITICAL),
    "nvmlEventTypeDramRetirementEvent": ("GPU_MEMORY_RETIREMENT", Severity.WARNING),
    "nvmlEventTypeDramRetirementFailure": ("GPU_ROW_REMAP_FAILURE", Severity.CRITICAL),
    "nvmlEventTypeNonFatalPoisonError": ("GPU_POISON_CONTAINED", Severity.WARNING),
    "nvmlEventTypeFatalPoisonError": ("GPU_POISON_UNCONTAINED", Severity.CRITICAL),
    "nvmlEventTypeGpuUnavailableError": ("GPU_LOST", Severity.CRITICAL),
}
_XID_EVENT = "nvmlEventTypeXidCriticalError"
_RECOVERY_EVENT = "nvmlEventTypeGpuRecoveryAction"

# clock event reason bit -> code (REFERENCE.md); idle and application-clock reasons are not faults.
_CLOCK_REASONS = (
    (0x08, "GPU_HW_SLOWDOWN"),
    (0x20, "GPU_THERMAL_SLOWDOWN"),
    (0x40, "GPU_THERMAL_SLOWDOWN"),
    (0x80, "GPU_POWER_BRAKE"),
)
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def load_pynvml() -> ModuleType:
    """The real bindings; ImportError means nvidia-ml-py is not installed."""
    import pynvml

    return pynvml


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bus_id(nvml: Any, handle: Any) -> str:
    bus = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    dom, b, rest = bus.split(":")
    dev, _, fn = rest.partition(".")
    return normalize_bdf(dom, b, dev, fn or None)


def _is(nvml: Any, exc: BaseException, name: str) -> bool:
    cls = getattr(nvml, name, None)
    return cls is not None and isinstance(exc, cls)


class _Session:
    """nvmlInit once, kept across runs; re-initialised after an NVML failure."""

    def __init__(self, loader: Callable[[], Any]):
        self._loader = loader
        self.nvml: Any = None
        self._initialised = False

    def open(self) -> Any:
        if self.nvml is None:
            try:
                self.nvml = self._loader()
            except ImportError as exc:
                raise CheckUnavailable("NVML bindings (nvidia-ml-py) are not installed") from exc
        if not self._initialised:
            self.nvml.nvmlInit()
            self._initialised = True
        return self.nvml

    def reset(self) -> None:
        if self._initialised:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # a broken driver may refuse even this
                pass
        self._initialised = False


def _nvml_applies(session: _Session, ctx: NodeContext) -> bool:
    """Applies where NVML sees GPUs, or where the instance type says there should be some."""
    if ctx.expected_gpus:
        return True
    try:
        nvml = session.open()
        return int(nvml.nvmlDeviceGetCount()) > 0
    except Exception:
        session.reset()
        return False


class NvmlEventWatcher(Watcher):
    """Registers every supported event type on every GPU and turns each event into a finding within milliseconds."""

    name = EVENTS_CHECK

    def __init__(self, nvml: Any = None, wait_ms: int = WAIT_MS):
        self._session = _Session((lambda: nvml) if nvml is not None else load_pynvml)
        self.wait_ms = wait_ms
        self._ready = threading.Event()

    def applies(self, ctx: NodeContext) -> bool:
        return _nvml_applies(self._session, ctx)

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def watch(self, emit: Emit, stop: threading.Event) -> None:
        try:
            nvml = self._session.open()
        except CheckUnavailable:
            raise
        except Exception as exc:
            self._session.reset()
            raise CheckUnavailable(f"NVML cannot initialise: {exc}") from exc
        event_set = nvml.nvmlEventSetCreate()
        try:
            registered = self._register(nvml, event_set)
            if not registered:
                raise CheckUnavailable("no GPU supports NVML events")
            self._ready.set()
            while not stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, self.wait_ms)
                except Exception as exc:
                    if _is(nvml, exc, "NVMLError_Timeout"):
                        continue
                    if _is(nvml, exc, "NVMLError_GpuIsLost"):
                        emit(Finding(EVENTS_CHECK, "gpu:unknown", "GPU_LOST", "NVML: GPU is lost while waiting for "
                                     "events", Severity.CRITICAL, {"error": str(exc)}))
                        continue
                    raise
                finding = self._finding(nvml, data)
                if finding is not None:
                    emit(finding)
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception:
                pass
            self._session.reset()

    def _register(self, nvml: Any, event_set: Any) -> int:
        wanted = 0
        for name in (*_EVENTS, _XID_EVENT, _RECOVERY_EVENT):
            wanted |= int(getattr(nvml, name, 0))
        registered = 0
        for i in range(int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                mask = int(nvml.nvmlDeviceGetSupportedEventTypes(handle)) & wanted
                if mask:
                    nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
                    registered += 1
            except Exception as exc:  # one bad GPU must not blind the watcher to the others
                log.warning("NVML: cannot register events on GPU %d: %s", i, exc)
        return registered

    def _finding(self, nvml: Any, data: Any) -> Finding | None:
        etype, edata = int(data.eventType), int(data.eventData)
        try:
            component = f"gpu:{_bus_id(nvml, data.device)}"
        except Exception:
            component = "gpu:unknown"
        evidence: dict[str, Any] = {"event_type": hex(etype), "event_data": edata}
        gi = getattr(data, "gpuInstanceId", None)
        if gi not in (None, 0xFFFFFFFF):
            evidence["gpu_instance"] = gi
        if etype == int(getattr(nvml, _XID_EVENT, -1)):
            return Finding(EVENTS_CHECK, component, f"XID_{edata}", f"Xid {edata} (NVML event)", Severity.ERROR,
                           {**evidence, "xid": edata})
        if etype == int(getattr(nvml, _RECOVERY_EVENT, -1)):
            return _recovery_finding(EVENTS_CHECK, component, edata, evidence)
        for name, (code, severity) in _EVENTS.items():
            if etype == int(getattr(nvml, name, -1)):
                return Finding(EVENTS_CHECK, component, code, f"NVML event {name.removeprefix('nvmlEventType')}",
                               severity, evidence)
        log.debug("NVML: ignoring event type %s", hex(etype))
        return None


def _recovery_finding(check: str, component: str, value: int, evidence: dict[str, Any]) -> Finding:
    action = RECOVERY_ACTIONS.get(value, Action.WATCH)
    evidence = {**evidence, "recovery_action": value}
    if action is Action.NONE:
        return Finding(check, component, "GPU_RECOVERY_ACTION", "GPU recovery action: none", Severity.INFO,
                       evidence, healthy=True)
    return Finding(check, component, "GPU_RECOVERY_ACTION", f"GPU recovery action {value}: {action}",
                   Severity.ERROR, evidence, recommended_action=action)


@dataclass
class _Expectation:
    gpus: int | None = None
    nvlinks_per_gpu: int | None = None
    pcie_width: int | None = None


@dataclass
class _Poll:
    """Findings of one pass, with a healthy counterpart for every condition that was readable and fine."""

    component: str
    findings: list[Finding] = field(default_factory=list)

    def add(self, code: str, bad: bool, message: str, evidence: dict[str, Any],
            severity: Severity = Severity.ERROR, action: Action | None = None) -> None:
        self.findings.append(Finding(FIELDS_CHECK, self.component, code, message if bad else f"{code}: fine",
                                     severity if bad else Severity.INFO, evidence, healthy=not bad,
                                     recommended_action=action if bad else None))


class NvmlPoller(Poller):
    """Reads each GPU's health fields every `interval_s` and compares the node with its instance profile."""

    name = FIELDS_CHECK

    def __init__(self, nvml: Any = None, expected_gpus: int | None = None, nvlinks_per_gpu: int | None = None,
                 interval_s: float = 30.0, timeout_s: float = 20.0, sysfs_root: str | Path = "/sys",
                 pcie_width: int | None = None):
        self._session = _Session((lambda: nvml) if nvml is not None else load_pynvml)
        self.expect = _Expectation(expected_gpus, nvlinks_per_gpu, pcie_width)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.sysfs_root = Path(sysfs_root)
        self._replays: dict[str, int] = {}

    def applies(self, ctx: NodeContext) -> bool:
        if ctx.profile is not None:
            self.expect.gpus = self.expect.gpus if self.expect.gpus is not None else ctx.profile.gpus
            if self.expect.nvlinks_per_gpu is None:
                self.expect.nvlinks_per_gpu = ctx.profile.nvlinks_per_gpu
            if self.expect.pcie_width is None:
                self.expect.pcie_width = ctx.profile.pcie_width
        return _nvml_applies(self._session, ctx)

    def run(self) -> list[Finding]:
        try:
            nvml = self._session.open()
        except CheckUnavailable:
            if self.expect.gpus:
                return [self._driver_finding("NVML bindings are not installed on a GPU instance")]
            raise
        except Exception as exc:
            self._session.reset()
            if self.expect.gpus:
                return [self._driver_finding(f"NVML cannot initialise: {exc}")]
            raise CheckUnavailable(f"NVML cannot initialise: {exc}") from exc
        findings = [Finding(FIELDS_CHECK, "node", "NVIDIA_DRIVER_UNAVAILABLE", "NVML initialised", Severity.INFO,
                            healthy=True)]
        count = int(nvml.nvmlDeviceGetCount())
        sysfs = nvidia_gpu_addresses(self.sysfs_root)
        for index in range(count):
            findings += self._device(nvml, index, sysfs)
        if self.expect.gpus is not None:
            bad = count < self.expect.gpus
            findings.append(Finding(FIELDS_CHECK, "node", "GPU_COUNT_MISMATCH",
                                    f"NVML sees {count} of {self.expect.gpus} GPUs" if bad else "GPU count as expected",
                                    Severity.CRITICAL if bad else Severity.INFO,
                                    {"found": count, "expected": self.expect.gpus}, healthy=not bad))
        return findings

    def _driver_finding(self, why: str) -> Finding:
        return Finding(FIELDS_CHECK, "node", "NVIDIA_DRIVER_UNAVAILABLE", why, Severity.CRITICAL,
                       {"expected_gpus": self.expect.gpus})

    def _device(self, nvml: Any, index: int, sysfs: list[str]) -> list[Finding]:
        # NVML numbers GPUs in PCI bus order, so the sysfs list names a GPU whose handle cannot be had.
        fallback = f"gpu:{sysfs[index]}" if index < len(sysfs) else f"gpu:nvml-{index}"
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            component = f"gpu:{_bus_id(nvml, handle)}"
        except Exception as exc:
            return [self._device_error(nvml, fallback, exc)]
        poll = _Poll(component)
        try:
            self._ecc(nvml, handle, poll)
            self._memory(nvml, handle, poll)
            self._nvlink(nvml, handle, poll)
            self._pcie(nvml, handle, poll)
            self._clocks(nvml, handle, poll)
            self._recovery(nvml, handle, poll)
        except Exception as exc:
            if _is(nvml, exc, "NVMLError_GpuIsLost") or _is(nvml, exc, "NVMLError_ResetRequired"):
                return [self._device_error(nvml, component, exc)]
            raise
        poll.add("GPU_LOST", False, "", {})
        poll.add("GPU_RESET_REQUIRED", False, "", {})
        return poll.findings

    def _device_error(self, nvml: Any, component: str, exc: BaseException) -> Finding:
        if _is(nvml, exc, "NVMLError_ResetRequired"):
            return Finding(FIELDS_CHECK, component, "GPU_RESET_REQUIRED", f"NVML: {exc}", Severity.ERROR,
                           {"error": str(exc)})
        if _is(nvml, exc, "NVMLError_GpuIsLost"):
            return Finding(FIELDS_CHECK, component, "GPU_LOST", f"NVML: {exc}", Severity.CRITICAL,
                           {"error": str(exc)})
        return Finding(FIELDS_CHECK, component, "GPU_UNKNOWN_ERROR", f"NVML cannot reach the GPU: {exc}",
                       Severity.CRITICAL, {"error": str(exc)})

    @staticmethod
    def _optional(nvml: Any, fn: Callable[[], Any]) -> Any:
        """The value, or None where the GPU or driver does not support the query."""
        try:
            return fn()
        except Exception as exc:
            if _is(nvml, exc, "NVMLError_NotSupported") or _is(nvml, exc, "NVMLError_FunctionNotFound"):
                return None
            raise

    def _ecc(self, nvml: Any, h: Any, poll: _Poll) -> None:
        unc = self._optional(nvml, lambda: nvml.nvmlDeviceGetTotalEccErrors(
            h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))
        if unc is not None:
            poll.add("GPU_ECC_UNCORRECTED", int(unc) > 0, f"{unc} uncorrected ECC errors since the driver loaded",
                     {"volatile_uncorrected": int(unc)}, Severity.CRITICAL)

    def _memory(self, nvml: Any, h: Any, poll: _Poll) -> None:
        pending = self._optional(nvml, lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(h))
        if pending is not None:
            poll.add("GPU_RETIRED_PAGES_PENDING", int(pending) == 1, "retired pages pending a reset",
                     {"pending": int(pending)})
        rows = self._optional(nvml, lambda: nvml.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            corr, unc, rpending, failure = (int(x) for x in rows)
            ev = {"correctable": corr, "uncorrectable": unc, "pending": rpending, "failure": failure}
            poll.add("GPU_ROW_REMAP_PENDING", rpending > 0, "remapped rows pending a reset", ev)
            poll.add("GPU_ROW_REMAP_FAILURE", failure > 0, "row remapping failed", ev, Severity.CRITICAL)

    def _nvlink(self, nvml: Any, h: Any, poll: _Poll) -> None:
        states: list[int] = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            state = self._optional(nvml, lambda: nvml.nvmlDeviceGetNvLinkState(h, link))
            if state is None:
                if link >= (self.expect.nvlinks_per_gpu or 0):
                    break  # past the links this GPU has
                states.append(0)
                continue
            states.append(int(state))
        up = sum(1 for s in states if s == 1)
        down = [i for i, s in enumerate(states) if s != 1]
        expected = self.expect.nvlinks_per_gpu
        if expected is None:
            if not up:
                return  # no NVLink on this GPU (PCIe boards), or nothing to compare against
            bad = bool(down)
            expected_text = len(states)
        else:
            if expected == 0:
                return
            bad = up < expected
            expected_text = expected
        poll.add("NVLINK_DOWN", bad, f"{up} of {expected_text} NVLinks up (down: {down})",
                 {"up": up, "expected": expected_text, "down_links": down}, Severity.CRITICAL)

    def _pcie(self, nvml: Any, h: Any, poll: _Poll) -> None:
        want = self.expect.pcie_width
        cur = self._optional(nvml, lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(h)) if want else None
        if cur is not None:
            # Width, not generation (GPUs drop the generation at idle), and only against the instance type's known
            # width: the device maximum is not it in VMs (g4dn/g5 run x8 links of a x16 maximum).
            gen = self._optional(nvml, lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(h))
            poll.add("PCIE_LINK_DEGRADED", int(cur) < want, f"PCIe link x{cur} of x{want}",
                     {"width": int(cur), "expected_width": want, "generation": gen}, Severity.WARNING)
        replays = self._optional(nvml, lambda: nvml.nvmlDeviceGetPcieReplayCounter(h))
        if replays is not None:
            last = self._replays.get(poll.component)
            self._replays[poll.component] = int(replays)
            if last is not None:
                delta = int(replays) - last
                poll.add("PCIE_REPLAY_ERRORS", delta > REPLAY_DELTA_LIMIT, f"{delta} PCIe replays since last poll",
                         {"replays": int(replays), "delta": delta}, Severity.WARNING)

    def _clocks(self, nvml: Any, h: Any, poll: _Poll) -> None:
        getter = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons")
        reasons = self._optional(nvml, lambda: getter(h))
        if reasons is None:
            return
        reasons = int(reasons)
        active: dict[str, list[str]] = {}
        for bit, code in _CLOCK_REASONS:
            active.setdefault(code, [])
            if reasons & bit:
                active[code].append(hex(bit))
        for code, bits in active.items():
            poll.add(code, bool(bits), f"clock event reasons {hex(reasons)}", {"reasons": hex(reasons)},
                     Severity.WARNING)

    def _recovery(self, nvml: Any, h: Any, poll: _Poll) -> None:
        field_id = int(getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", FI_RECOVERY_ACTION))
        values = self._optional(nvml, lambda: nvml.nvmlDeviceGetFieldValues(h, [field_id]))
        if not values:
            return
        v = values[0]
        if int(getattr(v, "nvmlReturn", 0)) != 0:
            return  # the driver does not know this field
        value = int(getattr(v.value, _VALUE_FIELDS.get(int(getattr(v, "valueType", 1)), "uiVal")))
        poll.findings.append(_recovery_finding(FIELDS_CHECK, poll.component, value, {"field": field_id}))

