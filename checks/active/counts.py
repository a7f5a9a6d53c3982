"""Device counts against the instance profile: GPUs and NVLinks (through NVML) and EFA devices (through fi_info).

The GPU test runs the passive NVML poller once with the profile's expectations and keeps only its count verdicts, so
the deep check and the passive check can never disagree on what "8 GPUs, 18 NVLinks each" means.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from nodemedic.checks.active.base import DeepCheckResult, Status, unavailable_status
from nodemedic.checks.active.efa import list_devices
from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.nvidia.nvml import NvmlPoller
from nodemedic.model import Finding, Severity

GPU_CHECK = "gpu.count"
EFA_CHECK = "efa.count"
EFA_COUNT_MISMATCH = "EFA_COUNT_MISMATCH"
# What the count test judges; everything else the poller reports (ECC, clocks) is the passive check's business.
_COUNT_CODES = {"GPU_COUNT_MISMATCH", "NVLINK_DOWN", "GPU_LOST", "GPU_RESET_REQUIRED", "GPU_UNKNOWN_ERROR"}


def run_gpu_counts(expected_gpus: int | None, nvlinks_per_gpu: int | None, nvml: Any = None) -> DeepCheckResult:
    """GPUs NVML sees and NVLinks up per GPU vs the profile; no NVML on a node expecting no GPUs is SKIPPED."""
    started = time.monotonic()

    def result(status: Status, summary: str, findings: list[Finding] | None = None,
               metrics: dict[str, Any] | None = None) -> DeepCheckResult:
        return DeepCheckResult(GPU_CHECK, status, summary, findings or [], metrics or {},
                               {"expected_gpus": expected_gpus, "expected_nvlinks_per_gpu": nvlinks_per_gpu},
                               time.monotonic() - started)

    poller = NvmlPoller(nvml=nvml, expected_gpus=expected_gpus, nvlinks_per_gpu=nvlinks_per_gpu)
    try:
        found = poller.run()
    except CheckUnavailable as exc:
        if not expected_gpus:
            return result(Status.SKIPPED, f"no GPUs here: {exc}")
        return result(Status.ERROR, str(exc))
    except Exception as exc:  # a broken driver: the passive NVML check reports it as a fault
        return result(Status.ERROR, f"NVML query failed: {type(exc).__name__}: {exc}")
    driver = [f for f in found if f.code == "NVIDIA_DRIVER_UNAVAILABLE" and not f.healthy]
    if driver:
        return result(Status.ERROR, driver[0].message)

    links = {f.component: f.evidence.get("up") for f in found if f.code == "NVLINK_DOWN"}
    # Every GPU NVML enumerates yields findings under its own component, healthy or not.
    count = next((f.evidence.get("found") for f in found if f.code == "GPU_COUNT_MISMATCH"), None)
    if count is None:
        count = len({f.component for f in found if f.component.startswith("gpu:")})
    if not count and not expected_gpus:
        return result(Status.SKIPPED, "NVML sees no GPUs and none are expected")
    metrics = {"gpus": count, "expected_gpus": expected_gpus, "nvlinks_up": links,
               "expected_nvlinks_per_gpu": nvlinks_per_gpu}
    bad = [dataclasses.replace(f, check=GPU_CHECK) for f in found if f.code in _COUNT_CODES and not f.healthy]
    if bad:
        return result(Status.FAILED, "; ".join(f.message for f in bad[:3]) + (f" (+{len(bad) - 3} more)"
                                                                             if len(bad) > 3 else ""), bad, metrics)
    judged = "" if expected_gpus is not None else " (no instance profile: count not judged)"
    nvl = f", NVLinks as expected ({nvlinks_per_gpu} per GPU)" if nvlinks_per_gpu else ""
    return result(Status.PASSED, f"{count} GPU(s){judged}{nvl}", metrics=metrics)


def run_efa_count(expected: int | None, provider: str = "efa", timeout_s: float = 30) -> DeepCheckResult:
    """EFA domains `fi_info` lists vs the profile; fi_info missing is SKIPPED, none expected and none found too."""
    started = time.monotonic()
    try:
        devices = list_devices(provider, timeout_s)
    except CheckUnavailable as exc:
        return DeepCheckResult(EFA_CHECK, unavailable_status(exc), str(exc), duration_s=time.monotonic() - started)
    metrics = {"devices": len(devices), "expected": expected, "provider": provider}
    evidence = {"domains": devices}
    elapsed = time.monotonic() - started
    if expected is None:
        if not devices:
            return DeepCheckResult(EFA_CHECK, Status.SKIPPED, f"no {provider} devices and none expected",
                                   metrics=metrics, evidence=evidence, duration_s=elapsed)
        return DeepCheckResult(EFA_CHECK, Status.PASSED, f"{len(devices)} {provider} device(s) (not judged: no "
                               "instance profile)", metrics=metrics, evidence=evidence, duration_s=elapsed)
    if len(devices) < expected:
        message = f"fi_info lists {len(devices)} of {expected} {provider} devices"
        finding = Finding(EFA_CHECK, "node", EFA_COUNT_MISMATCH, message, Severity.CRITICAL,
                          {"found": len(devices), "expected": expected, "domains": devices})
        return DeepCheckResult(EFA_CHECK, Status.FAILED, message, [finding], metrics, evidence, elapsed)
    return DeepCheckResult(EFA_CHECK, Status.PASSED, f"{len(devices)} of {expected} {provider} devices",
                           metrics=metrics, evidence=evidence, duration_s=elapsed)
