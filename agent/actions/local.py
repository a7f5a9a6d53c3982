"""The embedded local backend: no cluster to act on, so it records and prints what it would apply."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from nodemedic.actions import ActionBackend
from nodemedic.model import NodeVerdict

log = logging.getLogger(__name__)


class LocalBackend(ActionBackend):
    name = "local"

    def __init__(self, node: str, record_path: str | os.PathLike[str] | None = None, dry_run: bool = False):
        self.node = node
        self.record_path = Path(record_path) if record_path else None
        self.dry_run = dry_run
        self._last: tuple[str, tuple[str, ...], str | None] | None = None

    def apply(self, verdict: NodeVerdict) -> None:
        key = (verdict.health.value, tuple(verdict.fault_reasons), verdict.deep_check)
        if key == self._last:
            return
        record = {
            "time": time.time(),
            "node": self.node,
            "health": verdict.health.value,
            "action": verdict.action,
            "fault_types": verdict.fault_types,
            "fault_reasons": verdict.fault_reasons,
            "deep_check": verdict.deep_check,
            "generation": verdict.generation,
            "dry_run": self.dry_run,
        }
        if self.record_path is not None and not self.dry_run:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.record_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        log.warning("local: node %s is now %s (would apply: %s; faults: %s%s)%s", self.node, verdict.health.value,
                    verdict.action, ", ".join(verdict.fault_reasons) or "none",
                    f"; deep check {verdict.deep_check}" if verdict.deep_check else "",
                    " [dry run]" if self.dry_run else "")
        self._last = key
