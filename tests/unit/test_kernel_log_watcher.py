"""The kernel-log watcher: batches from a source become findings; storms of one fault fold into one."""

from __future__ import annotations

import threading

from nodemedic.checks.kernel_log import KernelLogWatcher
from nodemedic.checks.kernel_log.sources import LineSource

XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."
XID48 = "NVRM: Xid (PCI:0000:5d:00): 48, pid=1, name=x, DBE"


class Scripted(LineSource):
    def __init__(self, batches):
        self._batches = batches

    def batches(self, stop, ready=None):
        if ready is not None:
            ready.set()
        yield from self._batches
        stop.set()

    def existing(self):
        for b in self._batches:
            yield from b


def run(batches):
    out = []
    w = KernelLogWatcher(source=Scripted(batches))
    w.watch(out.append, threading.Event())
    assert w.wait_ready(0)
    return out


def test_consecutive_repeats_fold_and_order_is_kept():
    out = run([[XID79] * 500 + ["noise"] * 10 + [XID79] * 3 + [XID48, XID79], [XID79] * 7])
    assert [(f.code, f.repeats) for f in out] == [("XID_79", 503), ("XID_48", 1), ("XID_79", 1), ("XID_79", 7)]
    assert sum(f.repeats for f in out if f.code == "XID_79") == 511


def test_scan_reads_what_is_there():
    w = KernelLogWatcher(source=Scripted([["noise", XID48], [XID79]]))
    assert [f.code for f in w.scan()] == ["XID_48", "XID_79"]
