"""A fake /sys tree with PCI devices, for checks that enumerate the bus."""

from __future__ import annotations

from pathlib import Path


def add_pci_device(root: Path, address: str, vendor: int = 0x10DE, pci_class: int = 0x030200,
                   answering: bool = True) -> Path:
    dev = root / "bus" / "pci" / "devices" / address
    dev.mkdir(parents=True, exist_ok=True)
    (dev / "vendor").write_text(f"0x{vendor:04x}\n")
    (dev / "class").write_text(f"0x{pci_class:06x}\n")
    head = (vendor.to_bytes(2, "little") + (0x2330).to_bytes(2, "little")) if answering else b"\xff" * 4
    (dev / "config").write_bytes(head + b"\x00" * 60)
    return dev


def hgx_node(root: Path, gpus: int = 8, lost: tuple[str, ...] = ()) -> list[str]:
    """An HGX-like bus: `gpus` NVIDIA 3D controllers, an NVSwitch (bridge class) and an unrelated NIC."""
    buses = ["53", "64", "75", "86", "97", "a8", "b9", "ca"]
    addresses = [f"0000:{buses[i]}:00.0" for i in range(gpus)]
    for a in addresses:
        add_pci_device(root, a, answering=a not in lost)
    add_pci_device(root, "0000:05:00.0", pci_class=0x068000)          # NVSwitch: not a GPU
    add_pci_device(root, "0000:10:1c.0", vendor=0x1D0F, pci_class=0x020000)  # EFA
    return addresses
