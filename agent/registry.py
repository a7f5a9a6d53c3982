"""The checks this agent knows, built from the config."""

from __future__ import annotations

import logging

from nodemedic.checks.base import Check, NodeContext
from nodemedic.checks.kernel_log import KernelLogWatcher
from nodemedic.checks.nvidia.dcgm import DcgmHealthPoller, DcgmPolicyWatcher
from nodemedic.checks.nvidia.nvml import NvmlEventWatcher, NvmlPoller
from nodemedic.checks.nvidia.smi import NvidiaSmiPoller
from nodemedic.checks.platform.imds import Imds
from nodemedic.checks.platform.maintenance import MaintenancePoller
from nodemedic.checks.platform.pci import PciGpuPoller
from nodemedic.checks.platform.profiles import profile_for
from nodemedic.config import Config

log = logging.getLogger(__name__)


def node_context(config: Config, instance_type: str | None) -> NodeContext:
    return NodeContext(config.node_name, instance_type, profile_for(instance_type, config.instance_profiles))


def build_checks(config: Config, ctx: NodeContext, imds: Imds | None = None) -> list[Check]:
    c = config.checks
    expected = ctx.expected_gpus
    checks: list[Check] = []
    if c.kernel_log.enabled:
        checks.append(_timed(KernelLogWatcher(path=c.kernel_log.path, lookback_s=c.kernel_log.lookback_s,
                                              kind=c.kernel_log.source), c.kernel_log.timeout_s))
    if c.nvml.enabled:
        checks.append(NvmlEventWatcher())
        checks.append(_timed(NvmlPoller(expected_gpus=expected, interval_s=c.nvml.interval_s,
                                        sysfs_root=c.pci.sysfs_root), c.nvml.timeout_s))
    if c.nvidia_smi.enabled:
        checks.append(NvidiaSmiPoller(expected_gpus=expected, binary=c.nvidia_smi.binary,
                                      timeout_s=c.nvidia_smi.timeout_s, interval_s=c.nvidia_smi.interval_s))
    if c.dcgm.enabled:
        checks.append(DcgmHealthPoller(binary=c.dcgm.binary, host=c.dcgm.host, timeout_s=c.dcgm.timeout_s,
                                       interval_s=c.dcgm.interval_s, unreachable_after_s=c.dcgm.unreachable_after_s))
        checks.append(DcgmPolicyWatcher(binary=c.dcgm.binary, host=c.dcgm.host, group=c.dcgm.group,
                                        timeout_s=c.dcgm.timeout_s))
    if c.pci.enabled:
        checks.append(_timed(PciGpuPoller(expected_gpus=expected, sysfs_root=c.pci.sysfs_root,
                                          interval_s=c.pci.interval_s), c.pci.timeout_s))
    if c.maintenance.enabled and imds is not None:
        checks.append(MaintenancePoller(imds, interval_s=c.maintenance.interval_s,
                                        timeout_s=c.maintenance.timeout_s))
    return checks


def _timed(check: Check, timeout_s: float) -> Check:
    check.timeout_s = timeout_s
    return check


def applicable(checks: list[Check], ctx: NodeContext) -> list[Check]:
    """The checks that apply; one whose applies() fails is kept, so its failure is reported when it runs."""
    out = []
    for c in checks:
        try:
            if c.applies(ctx):
                out.append(c)
        except Exception:
            log.exception("check %s: cannot tell whether it applies; running it so its failure is reported", c.name)
            out.append(c)
    return out
