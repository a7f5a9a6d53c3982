"""Kernel-log watcher: NVIDIA Xid/SXid, bus loss, PCIe AER, MCE/EDAC, Neuron and EFA driver errors."""

from __future__ import annotations

import logging
import threading
import time

from nodemedic.checks.base import Emit, NodeContext, Watcher
from nodemedic.checks.kernel_log.parser import CHECK, KernelLogClassifier
from nodemedic.checks.kernel_log.sources import LineSource, make_source
from nodemedic.model import Finding

log = logging.getLogger(__name__)


class KernelLogWatcher(Watcher):
    name = CHECK
    scannable = True

    def __init__(self, path: str | None = None, lookback_s: float | None = None, source: LineSource | None = None,
                 kind: str = "auto"):
        self.kind = kind
        self.path = path
        self.lookback_s = lookback_s
        self.source = source
        self._ready = threading.Event()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

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
        classify = KernelLogClassifier().classify
        log.info("kernel log: following %s", source)
        for batch in source.batches(stop, self._ready):
            now = time.time()
            pending: Finding | None = None
            for line in batch:
                finding = classify(line, now)
                if finding is None:
                    continue
                # A storm of the same fault folds into one finding per batch that carries the count.
                if pending is not None and pending.same_fault(finding):
                    pending.repeats += 1
                    continue
                if pending is not None:
                    emit(pending)
                pending = finding
            if pending is not None:
                emit(pending)
