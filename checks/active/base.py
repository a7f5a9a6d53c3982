"""What a deep check returns: a status that never mistakes "could not run" for "passed" or for a hardware fault."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import ToolNotFound
from nodemedic.model import Finding


class Status(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"      # the hardware failed the test: findings say what
    ERROR = "error"        # the test could not run to a verdict (crashed, aborted, timed out, garbage output)
    SKIPPED = "skipped"    # the tool or device is not there

    def __str__(self) -> str:
        return self.value


@dataclass
class DeepCheckResult:
    name: str
    status: Status
    summary: str
    findings: list[Finding] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)   # figures measured (bandwidth, latency, bogo ops/s)
    evidence: dict[str, Any] = field(default_factory=dict)  # raw output tails, command lines, exit codes
    duration_s: float = 0.0

    def record(self) -> dict[str, Any]:
        """One JSON-able record for the node-local deep-check log."""
        return {"name": self.name, "status": str(self.status), "summary": self.summary, "metrics": self.metrics,
                "evidence": self.evidence, "duration_s": round(self.duration_s, 3),
                "findings": [f.to_dict() for f in self.findings]}


def unavailable_status(exc: CheckUnavailable) -> Status:
    """A tool that is not installed means SKIPPED; one that timed out, was cancelled or would not start, ERROR."""
    return Status.SKIPPED if isinstance(exc, ToolNotFound) else Status.ERROR


def tail(text: str, lines: int = 30) -> str:
    """The last `lines` lines of a tool's output: evidence enough to say why, without keeping it all."""
    return "\n".join(text.splitlines()[-lines:])
