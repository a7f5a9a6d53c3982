"""JSON log lines on stdout; each policy decision carries the HealthMonitoringAgentDetectionEvent marker."""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime, timezone
from typing import Any, TextIO

from nodemedic.model import Action
from nodemedic.policy import Decision

DETECTION_MARKER = "HealthMonitoringAgentDetectionEvent"
_DETECTION_LOGGER = "nodemedic.detection"
_EVIDENCE_LIMIT = 2000


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        event = getattr(record, "event", None)
        if isinstance(event, dict):
            out.update(event)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def setup_logging(level: str = "info", stream: TextIO | None = None) -> None:
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("watchdog").setLevel(logging.WARNING)


def detection_event(decision: Decision, node: str, instance_type: str | None = None) -> dict[str, Any]:
    """The fields of one detection event: flat, so CloudWatch Logs Insights discovers each as a field."""
    evidence = dict(decision.evidence)
    line = evidence.get("line")
    if isinstance(line, str) and len(line) > _EVIDENCE_LIMIT:
        evidence["line"] = line[:_EVIDENCE_LIMIT] + "..."
    return {
        DETECTION_MARKER: str(decision.outcome),
        "node": node,
        "instance_type": instance_type,
        "check": decision.check,
        "component": decision.component,
        "code": decision.code,
        "fault_type": decision.type,
        "reason": decision.reason,
        "action": str(decision.action),
        "health": str(decision.health_after),
        "previous_health": str(decision.health_before),
        "mode": "enforce" if decision.enforced else "observe",
        "count": decision.count,
        "observed_at": decision.finding.observed_at if decision.finding is not None else decision.at,
        "decided_at": decision.at,
        "evidence": evidence,
    }


class DetectionLog:
    def __init__(self, node: str, instance_type: str | None = None):
        self.node = node
        self.instance_type = instance_type
        self._log = logging.getLogger(_DETECTION_LOGGER)

    def emit(self, decision: Decision) -> None:
        event = detection_event(decision, self.node, self.instance_type)
        level = logging.WARNING if decision.action > Action.WATCH or decision.verdict_changed else logging.INFO
        self._log.log(level, f"{decision.outcome}: {decision.code} on {decision.component}: {decision.reason}",
                      extra={"event": event})


def now_iso(ts: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if ts is None else ts, timezone.utc).isoformat(timespec="seconds")
