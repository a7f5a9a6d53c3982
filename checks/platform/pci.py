"""PCI bus enumeration under /sys/bus/pci: an independent view of which GPUs are there and answering."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nodemedic.checks.base import CheckUnavailable, NodeContext, Poller
from nodemedic.model import Finding, Severity

CHECK = "pci"
NVIDIA_VENDOR = 0x10DE
# PCI class codes of GPUs: VGA controller (0x0300) and 3D controller (0x0302). NVSwitches are 0x0680 (bridge).
GPU_CLASSES = (0x0300, 0x0302)


def _hex(path: Path) -> int | None:
    try:
        return int(path.read_text().strip(), 16)
    except (OSError, ValueError):
        return None


def nvidia_gpu_addresses(sysfs_root: str | Path = "/sys") -> list[str]:
    """PCI addresses of NVIDIA GPUs, in bus order (the order NVML numbers them in)."""
    base = Path(sysfs_root) / "bus" / "pci" / "devices"
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return []
    found = []
    for dev in entries:
        if _hex(dev / "vendor") == NVIDIA_VENDOR and ((_hex(dev / "class") or 0) >> 8) in GPU_CLASSES:
            found.append(dev.name.lower())
    return found


def responds(sysfs_root: str | Path, address: str) -> bool | None:
    """Whether the device answers config-space reads (a GPU off the bus reads back all ones); None if unknown."""
    try:
        with open(Path(sysfs_root) / "bus" / "pci" / "devices" / address / "config", "rb") as fh:
            head = fh.read(4)
    except OSError:
        return None
    if len(head) < 2:
        return None
    return int.from_bytes(head[:2], "little") != 0xFFFF


class PciGpuPoller(Poller):
    """Counts NVIDIA GPUs on the PCI bus and checks each still answers: corroboration for NVML and nvidia-smi."""

    name = CHECK

    def __init__(self, expected_gpus: int | None = None, sysfs_root: str | Path = "/sys", interval_s: float = 30.0):
        self.expected_gpus = expected_gpus
        self.sysfs_root = Path(sysfs_root)
        self.interval_s = interval_s
        self.timeout_s = 10.0

    def applies(self, ctx: NodeContext) -> bool:
        if self.expected_gpus is None:
            self.expected_gpus = ctx.expected_gpus
        return bool(self.expected_gpus) or bool(nvidia_gpu_addresses(self.sysfs_root))

    def run(self) -> list[Finding]:
        if not (self.sysfs_root / "bus" / "pci" / "devices").is_dir():
            raise CheckUnavailable(f"{self.sysfs_root}/bus/pci/devices is not readable")
        gpus = nvidia_gpu_addresses(self.sysfs_root)
        findings: list[Finding] = []
        answering = 0
        for address in gpus:
            ok = responds(self.sysfs_root, address)
            if ok is None:
                continue
            answering += ok
            evidence: dict[str, Any] = {"pci": address}
            findings.append(Finding(CHECK, f"gpu:{address}", "GPU_LOST",
                                    "GPU answers on the PCI bus" if ok else "GPU reads back all ones on the PCI bus",
                                    Severity.INFO if ok else Severity.CRITICAL, evidence, healthy=ok))
        if self.expected_gpus is not None:
            bad = len(gpus) < self.expected_gpus
            findings.append(Finding(CHECK, "node", "GPU_COUNT_MISMATCH",
                                    f"{len(gpus)} of {self.expected_gpus} NVIDIA GPUs on the PCI bus" if bad
                                    else "GPU count on the PCI bus as expected",
                                    Severity.CRITICAL if bad else Severity.INFO,
                                    {"found": len(gpus), "expected": self.expected_gpus, "addresses": gpus},
                                    healthy=not bad))
        return findings
