"""Kernel-log lines for the benchmarks, in the formats the drivers and the kernel actually print."""

from __future__ import annotations

import random

XID_79_TEXT = "GPU has fallen off the bus."


def xid_79(domain: int, bus: int) -> str:
    """Xid 79 as the r535+ driver prints it (kernel_rc.c), lowercase hex as printk writes it."""
    return f"NVRM: Xid (PCI:{domain:04x}:{bus:02x}:00): 79, pid='<unknown>', name=<unknown>, {XID_79_TEXT}"


def component(domain: int, bus: int) -> str:
    """The component the agent reports for a GPU at this domain and bus."""
    return f"gpu:{domain:04x}:{bus:02x}:00.0"


def syslog(text: str, stamp: str = "Nov 22 05:20:52", host: str = "gpu-node-17") -> str:
    """A kernel message as rsyslog writes it to kern.log."""
    return f"{stamp} {host} kernel: {text}"


def _fault(rng: random.Random, i: int) -> str:
    """One of six real fault formats, cycled so each appears equally often."""
    bus = rng.choice((0x0f, 0x2d, 0x44, 0x5b, 0x89, 0xa8, 0xc0, 0xd7))
    pid = rng.randint(1000, 99999)
    kind = i % 6
    if kind == 0:
        return xid_79(0, bus)
    if kind == 1:
        return (f"NVRM: Xid (PCI:0000:{bus:02x}:00): 119, pid={pid}, name=python3, Timeout after 6s of waiting "
                f"for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4).")
    if kind == 2:
        return (f"NVRM: Xid (PCI:0000:{bus:02x}:00): 13, pid={pid}, name=python3, Graphics Exception: "
                f"ESR 0x405840=0x1e000b0c 0x405844=0x0 0x405848=0x0 0x40584c=0x0")
    if kind == 3:
        return (f"NVRM: Xid (PCI:0000:{bus:02x}:00): 154, GPU recovery action changed from 0x0 (None) to "
                f"0x1 (GPU Reset Required)")
    if kind == 4:
        return (f"nvidia-nvswitch{bus % 4}: SXid (PCI:0000:{bus:02x}:00.0): 12028, Non-fatal, Link 32 egress "
                f"non-posted PRIV error (First)")
    return (f"pcieport 0000:{bus:02x}:01.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, "
            f"(Receiver ID)")


_NOISE = (
    "IPv6: ADDRCONF(NETDEV_CHANGE): eth{n}: link becomes ready",
    "audit: type=1400 audit({t}:{k}): apparmor=\"STATUS\" operation=\"profile_replace\" info=\"same as current "
    "profile, skipping\" profile=\"unconfined\" name=\"/usr/bin/man\" pid={p} comm=\"apparmor_parser\"",
    "systemd[1]: Started Session {k} of User ubuntu.",
    "systemd[1]: run-containerd-runc-k8s.io-{h}-runc.{k}.mount: Deactivated successfully.",
    "mlx5_core 0000:{b:02x}:00.0: mlx5_pcie_event:301:(pid {p}): PCIe slot advertised sufficient power (75W).",
    "mlx5_core 0000:{b:02x}:00.1 enp{b}s0f1np1: Link up",
    "eth{n}: renamed from veth{h8}",
    "cni0: port {n}(veth{h8}) entered forwarding state",
    "nvme nvme{n}: I/O {k} QID {n} timeout, completion polled",
    "EXT4-fs (nvme{n}n1): mounted filesystem with ordered data mode. Quota mode: none.",
    "TCP: request_sock_TCP: Possible SYN flooding on port {p}. Sending cookies.  Check SNMP counters.",
    "kauditd_printk_skb: {n} callbacks suppressed",
    "overlayfs: upper fs does not support RENAME_WHITEOUT.",
    "nfs: server 10.0.{n}.{b} not responding, still trying",
    "docker0: port {n}(veth{h8}) entered disabled state",
    "lustre: LustreError: 11-0: fsx-OST00{n}{n}-osc-ffff{h8}: operation ost_connect to node 10.1.{b}.{n}@tcp "
    "failed: rc = -16",
)


def _noise(rng: random.Random) -> str:
    template = rng.choice(_NOISE)
    h = f"{rng.getrandbits(64):016x}"
    return template.format(n=rng.randint(0, 9), k=rng.randint(1, 99999), p=rng.randint(100, 65535),
                           t=f"{rng.uniform(1.7e9, 1.8e9):.3f}", b=rng.randint(0, 255), h=h * 4, h8=h[:7])


def mixed_pool(size: int, fault_every: int = 10, seed: int = 1) -> list[str]:
    """`size` lines, every `fault_every`-th a fault line, all with a dmesg-style `[seconds]` prefix."""
    rng = random.Random(seed)
    pool = []
    clock = 12345.0
    for i in range(size):
        clock += rng.uniform(0.0, 0.01)
        text = _fault(rng, i // fault_every) if i % fault_every == fault_every - 1 else _noise(rng)
        pool.append(f"[{clock:12.6f}] {text}")
    return pool
