"""A fake of pynvml (nvidia-ml-py) over a scripted device model: same function names, constants and exceptions.

Constants and error numbers are copied from nvidia-ml-py 13.x (pynvml.py). Only the calls nodemedic makes exist;
anything else raises AttributeError, so a new call in production code fails loudly here first.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_SUCCESS = 0
_ERRORS = {
    "Uninitialized": 1, "InvalidArgument": 2, "NotSupported": 3, "NoPermission": 4, "NotFound": 6,
    "DriverNotLoaded": 9, "Timeout": 10, "LibraryNotFound": 12, "FunctionNotFound": 13, "GpuIsLost": 15,
    "ResetRequired": 16, "Unknown": 999,
}


class NVMLError(Exception):
    value = -1

    def __str__(self) -> str:
        return f"NVML error {self.value} ({type(self).__name__.removeprefix('NVMLError_')})"


_classes = {}
for _name, _val in _ERRORS.items():
    _classes[_name] = type(f"NVMLError_{_name}", (NVMLError,), {"value": _val})
NVMLError_Uninitialized = _classes["Uninitialized"]
NVMLError_NotSupported = _classes["NotSupported"]
NVMLError_DriverNotLoaded = _classes["DriverNotLoaded"]
NVMLError_Timeout = _classes["Timeout"]
NVMLError_LibraryNotFound = _classes["LibraryNotFound"]
NVMLError_FunctionNotFound = _classes["FunctionNotFound"]
NVMLError_GpuIsLost = _classes["GpuIsLost"]
NVMLError_ResetRequired = _classes["ResetRequired"]
NVMLError_Unknown = _classes["Unknown"]

NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230

nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8
nvmlEventTypeClock = 0x10
nvmlEventTypeDramRetirementEvent = 0x400
nvmlEventTypeDramRetirementFailure = 0x800
nvmlEventTypeNonFatalPoisonError = 0x1000
nvmlEventTypeFatalPoisonError = 0x2000
nvmlEventTypeGpuUnavailableError = 0x4000
nvmlEventTypeGpuRecoveryAction = 0x8000
ALL_EVENTS = 0xFC0F | 0x10 | 0x4


@dataclass
class FakeGpu:
    bus_id: str                                   # as NVML prints it: 00000000:3B:00.0
    ecc_uncorrected_volatile: int = 0
    retired_pending: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)   # corrected, uncorrected, pending, failure
    nvlinks: list[int] = field(default_factory=lambda: [1] * 18)
    pcie_width: tuple[int, int] = (16, 16)         # current, max
    pcie_gen: int = 5
    replays: int = 0
    clock_reasons: int = 0
    recovery_action: int | None = 0               # None: the driver does not know field 230
    supported_events: int = ALL_EVENTS
    lost: bool = False                            # every query raises GpuIsLost
    handle_error: type[NVMLError] | None = None   # nvmlDeviceGetHandleByIndex raises this
    ecc_supported: bool = True


class FakeNvml:
    """Module-like: pass an instance wherever production code takes the `pynvml` module."""

    def __init__(self, gpus: list[FakeGpu] | None = None):
        self.gpus = gpus if gpus is not None else default_gpus()
        self.init_error: type[NVMLError] | None = None
        self.initialised = 0
        self.calls = 0
        self._events: queue.Queue[SimpleNamespace] = queue.Queue()
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        for name, value in globals().items():  # constants and exception classes, as on the module
            if name.startswith(("NVML", "nvmlEventType")):
                setattr(self, name, value)

    # -- scripting ---------------------------------------------------------------------------------------------
    def post_event(self, index: int, event_type: int, data: int = 0) -> None:
        """Queue an event as the driver would raise it on GPU `index` (dropped if that type is not registered)."""
        if self._registered.get(index, 0) & event_type:
            self._events.put(SimpleNamespace(device=self._handle(index), eventType=event_type, eventData=data,
                                             gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))

    def registered(self, index: int) -> int:
        return self._registered.get(index, 0)

    # -- library lifecycle ---------------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error()
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        if self.initialised <= 0:
            raise NVMLError_Uninitialized()
        self.initialised -= 1

    def _check(self) -> None:
        self.calls += 1
        if self.initialised <= 0:
            raise NVMLError_Uninitialized()

    # -- devices ---------------------------------------------------------------------------------------------------
    def _handle(self, index: int) -> SimpleNamespace:
        return SimpleNamespace(index=index)

    def _gpu(self, handle: Any) -> FakeGpu:
        self._check()
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise NVMLError_GpuIsLost()
        return gpu

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimpleNamespace:
        self._check()
        gpu = self.gpus[index]
        if gpu.handle_error is not None:
            raise gpu.handle_error()
        return self._handle(index)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(handle).bus_id.encode())

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        if not gpu.ecc_supported:
            raise NVMLError_NotSupported()
        if (error_type, counter_type) == (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC):
            return gpu.ecc_uncorrected_volatile
        return 0

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        return self._gpu(handle).retired_pending

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        return self._gpu(handle).remapped_rows

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        gpu = self._gpu(handle)
        if link >= len(gpu.nvlinks):
            raise NVMLError_NotSupported()
        return gpu.nvlinks[link]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._gpu(handle).pcie_width[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._gpu(handle).pcie_width[1]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._gpu(handle).pcie_gen

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._gpu(handle).replays

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu(handle).clock_reasons

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[int]) -> list[SimpleNamespace]:
        gpu = self._gpu(handle)
        out = []
        for fid in field_ids:
            if fid == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and gpu.recovery_action is not None:
                out.append(SimpleNamespace(fieldId=fid, nvmlReturn=NVML_SUCCESS, valueType=1,
                                           value=SimpleNamespace(uiVal=gpu.recovery_action)))
            else:
                out.append(SimpleNamespace(fieldId=fid, nvmlReturn=_ERRORS["NotSupported"], valueType=1,
                                           value=SimpleNamespace(uiVal=0)))
        return out

    # -- events ------------------------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> object:
        self._check()
        return object()

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._gpu(handle).supported_events

    def nvmlDeviceRegisterEvents(self, handle: Any, mask: int, event_set: object) -> None:
        gpu = self._gpu(handle)
        if mask & ~gpu.supported_events:
            raise NVMLError_NotSupported()
        self._registered[handle.index] = self._registered.get(handle.index, 0) | mask

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        self._check()
        try:
            return self._events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError_Timeout() from None

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._registered.clear()


def default_gpus(n: int = 8) -> list[FakeGpu]:
    """An 8-GPU HGX-like node: H100 SXM bus ids as on a p5.48xlarge."""
    buses = ["53", "64", "75", "86", "97", "A8", "B9", "CA"]
    return [FakeGpu(bus_id=f"00000000:{buses[i % 8]}:00.0") for i in range(n)]
