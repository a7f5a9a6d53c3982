"""EC2 scheduled maintenance (IMDS events/maintenance/scheduled): drain a node before the platform takes it."""

from __future__ import annotations

import json
from typing import Any

from nodemedic.checks.base import CheckUnavailable, NodeContext, Poller
from nodemedic.checks.platform.imds import Imds
from nodemedic.model import Action, Finding, Severity

CHECK = "imds.maintenance"
EVENTS_PATH = "meta-data/events/maintenance/scheduled"

# EC2 event codes -> what the node needs before the platform acts.
EVENT_ACTIONS = {
    "instance-reboot": Action.REBOOT,
    "system-reboot": Action.REBOOT,
    "instance-retirement": Action.REPLACE,
    "instance-stop": Action.REPLACE,
    "system-maintenance": Action.RESET_GPU,  # no reboot, but work should drain off the node first
}


class MaintenancePoller(Poller):
    name = CHECK

    def __init__(self, imds: Imds, interval_s: float = 300.0, timeout_s: float = 10.0):
        self.imds = imds
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._open: set[str] = set()

    def applies(self, ctx: NodeContext) -> bool:
        return self.imds.get("meta-data/instance-id") is not None  # on EC2 at all

    def run(self) -> list[Finding]:
        text = self.imds.get(EVENTS_PATH)
        if text is None:
            raise CheckUnavailable("IMDS maintenance events not reachable")
        try:
            events = json.loads(text) if text.strip() else []
            if not isinstance(events, list):
                raise ValueError("not a list")
        except ValueError as exc:
            raise ValueError(f"IMDS maintenance events are not a JSON list: {text[:200]!r}") from exc
        findings = []
        active: set[str] = set()
        for event in events:
            if not isinstance(event, dict) or event.get("State", "active") != "active":
                continue
            event_id = str(event.get("EventId") or event.get("Code") or "unknown")
            active.add(event_id)
            findings.append(_finding(event_id, event))
        for gone in self._open - active:  # completed, cancelled, or no longer listed
            findings.append(Finding(CHECK, f"maintenance:{gone}", "MAINTENANCE_SCHEDULED",
                                    f"maintenance event {gone} is no longer scheduled", Severity.INFO, healthy=True))
        self._open = active
        return findings


def _finding(event_id: str, event: dict[str, Any]) -> Finding:
    code = str(event.get("Code", "unknown"))
    when = event.get("NotBefore", "an unknown time")
    return Finding(CHECK, f"maintenance:{event_id}", "MAINTENANCE_SCHEDULED",
                   f"EC2 {code} scheduled from {when}: {event.get('Description', '')}".rstrip(": "),
                   Severity.WARNING, {"event_id": event_id, "code": code, "not_before": event.get("NotBefore"),
                                      "not_after": event.get("NotAfter"), "description": event.get("Description")},
                   recommended_action=EVENT_ACTIONS.get(code, Action.WATCH))
