"""The checks this agent knows, built from the config."""

from __future__ import annotations

from nodemedic.checks.base import Check, NodeContext
from nodemedic.checks.kernel_log import KernelLogWatcher
from nodemedic.config import Config


def build_checks(config: Config) -> list[Check]:
    checks: list[Check] = []
    kl = config.checks.kernel_log
    if kl.enabled:
        watcher = KernelLogWatcher(path=kl.path, lookback_s=kl.lookback_s, kind=kl.source)
        watcher.timeout_s = kl.timeout_s
        checks.append(watcher)
    return checks


def applicable(checks: list[Check], ctx: NodeContext) -> list[Check]:
    return [c for c in checks if c.applies(ctx)]
