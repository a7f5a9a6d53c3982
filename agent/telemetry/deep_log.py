"""The node-local deep-check log: one JSON record per line, rotated by size, readable with `jq` or Logs Insights."""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import threading
from pathlib import Path
from typing import Any

from nodemedic.telemetry.logs import now_iso

log = logging.getLogger(__name__)

STARTED, RESULT, COMPLETED = "DeepHealthCheckStarted", "DeepHealthCheckResult", "DeepHealthCheckCompleted"


class DeepCheckLog:
    """Appends records to `path` (rotated at `max_bytes`, `backups` kept); falls back to `fallback` if unwritable.

    Writing never raises: a full disk costs the log line (said on the agent's own log), never the run.
    """

    def __init__(self, path: str | os.PathLike[str], node: str, instance_type: str | None = None,
                 max_bytes: int = 10 * 1024 * 1024, backups: int = 5,
                 fallback: str | os.PathLike[str] | None = None):
        self.node = node
        self.instance_type = instance_type
        self._lock = threading.Lock()
        self._handler: logging.handlers.RotatingFileHandler | None = None
        self.path: Path | None = None
        for candidate in [path, fallback] if fallback is not None else [path]:
            try:
                Path(candidate).parent.mkdir(parents=True, exist_ok=True)
                # delay=False opens now, so an unwritable path is found here rather than at the first record.
                self._handler = logging.handlers.RotatingFileHandler(candidate, maxBytes=max_bytes,
                                                                     backupCount=backups, encoding="utf-8")
                self.path = Path(candidate)
                break
            except OSError as exc:
                log.warning("deep-check log %s not writable (%s)%s", candidate, exc,
                            "; trying the state directory" if candidate != fallback and fallback else "")
        if self._handler is not None:
            self._handler.setFormatter(logging.Formatter("%(message)s"))

    def write(self, event: str, record: dict[str, Any], at: float) -> None:
        if self._handler is None:
            return
        line = json.dumps({"time": now_iso(at), "timestamp": at, "event": event, "node": self.node,
                           "instance_type": self.instance_type, **record}, default=str, separators=(",", ":"))
        entry = logging.LogRecord("nodemedic.deep_check", logging.INFO, __file__, 0, line, None, None)
        with self._lock:
            # emit() rotates first when the line would pass max_bytes; its errors go to handleError, so check.
            try:
                if self._handler.shouldRollover(entry):
                    self._handler.doRollover()
                self._handler.stream.write(line + "\n")
                self._handler.stream.flush()
            except (OSError, ValueError) as exc:
                log.error("could not write deep-check log %s: %s", self.path, exc)

    def close(self) -> None:
        if self._handler is not None:
            self._handler.close()


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of one log file, skipping lines that are not JSON (a torn last line after a crash)."""
    out = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
