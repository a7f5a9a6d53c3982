"""Kernel-log watcher: NVIDIA Xid/SXid, bus loss, PCIe AER, MCE/EDAC, Neuron and EFA driver errors."""

from __future__ import annotations

import logging
import threading

from nodemedic.checks.base import Emit, NodeContext, Watcher
from nodemedic.checks.kernel_log.parser import CHECK, KernelLogClassifier
from nodemedic.checks.kernel_log.sources import LineSource, make_source
from nodemedic.model import Finding

log = logging.getLogger(__name__)


class KernelLogWatcher(Watcher):
    name = CHECK

    def __init__(self, path: str | None = None, lookback_s: float | None = None, source: LineSource | None = None,
                 kind: str = "auto"):
        self.kind = kind
        self.path = path
        self.lookback_s = lookback_s
        self.source = source

    def applies(self, ctx: NodeContext) -> bool:
        return True  # every node has a kernel log; if it cannot be read, that is a check failure

    def scan(self) -> list[Finding]:
        source = self.source or make_source(self.kind, self.path, self.lookback_s)
        classify = KernelLogClassifier().classify
        return [f for line in source.existing() if (f := classify(line)) is not None]

    def watch(self, emit: Emit, stop: threading.Event) -> None:
        source = self.source or make_source(self.kind, self.path, self.lookback_s)
        # After a restart by the supervisor, follow from where the log is now rather than looking back again.
        self.lookback_s = None
        log.info("kernel log: following %s", source)
        classify = KernelLogClassifier().classify
        for line in source.lines(stop):
            finding = classify(line)
            if finding is not None:
                emit(finding)
