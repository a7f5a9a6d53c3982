"""The facts and decisions that flow from checks through policy to actions."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict


class Severity(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    CRITICAL = 3

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str | int | Severity) -> Severity:
        if isinstance(value, Severity):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[str(value).strip().upper()]
        except KeyError:
            raise ValueError(f"unknown severity {value!r}; one of {', '.join(str(s) for s in cls)}") from None


class Action(enum.IntEnum):
    """What the node needs, ordered so that max() picks the strongest remedy."""

    NONE = 0
    WATCH = 1
    RESET_GPU = 2
    REBOOT = 3
    REPLACE = 4

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str | int | Action) -> Action:
        if isinstance(value, Action):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[str(value).strip().upper().replace("-", "_")]
        except KeyError:
            raise ValueError(f"unknown action {value!r}; one of {', '.join(str(a) for a in cls)}") from None

    def escalated(self) -> Action:
        return Action(min(self + 1, Action.REPLACE))


class Health(str, enum.Enum):
    SCHEDULABLE = "Schedulable"
    UNSCHEDULABLE = "Unschedulable"
    PENDING_REBOOT = "UnschedulablePendingReboot"
    PENDING_REPLACEMENT = "UnschedulablePendingReplacement"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def for_action(cls, action: Action) -> Health:
        if action >= Action.REPLACE:
            return cls.PENDING_REPLACEMENT
        if action >= Action.REBOOT:
            return cls.PENDING_REBOOT
        if action >= Action.RESET_GPU:
            return cls.UNSCHEDULABLE
        return cls.SCHEDULABLE


@dataclass(slots=True)
class Finding:
    """One fact observed by one check; `healthy=True` says a condition is fine again."""

    check: str
    component: str
    code: str
    message: str
    severity: Severity = Severity.WARNING
    evidence: dict[str, Any] = field(default_factory=dict)
    observed_at: float = field(default_factory=time.time)
    healthy: bool = False
    # Set by a check only when the source itself names the remedy (Xid 154, NVSwitch "Fatal"); the catalog
    # decides whether to trust it.
    recommended_action: Action | None = None
    # How many identical consecutive sightings this finding stands for (a log storm is folded at the source).
    repeats: int = 1

    def same_fault(self, other: Finding) -> bool:
        return (self.code == other.code and self.component == other.component and self.healthy == other.healthy
                and self.recommended_action == other.recommended_action and self.check == other.check)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "component": self.component,
            "code": self.code,
            "message": self.message,
            "severity": str(self.severity),
            "evidence": self.evidence,
            "observed_at": self.observed_at,
            "healthy": self.healthy,
            "recommended_action": str(self.recommended_action) if self.recommended_action is not None else None,
            "repeats": self.repeats,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        """The inverse of to_dict (findings handed to the running agent through its inbox)."""
        action = data.get("recommended_action")
        return cls(check=str(data["check"]), component=str(data["component"]), code=str(data["code"]),
                   message=str(data.get("message", "")), severity=Severity.parse(data.get("severity", "warning")),
                   evidence=dict(data.get("evidence") or {}), observed_at=float(data.get("observed_at", time.time())),
                   healthy=bool(data.get("healthy", False)),
                   recommended_action=Action.parse(action) if action is not None else None,
                   repeats=int(data.get("repeats", 1)))


CHECK_FAILED = "CHECK_FAILED"


def check_failed(check: str, reason: str, *, observed_at: float | None = None, **evidence: Any) -> Finding:
    """A check that could not run: reported, never mistaken for a hardware fault."""
    return Finding(
        check=check,
        component=f"check:{check}",
        code=CHECK_FAILED,
        message=f"check {check} failed: {reason}",
        severity=Severity.WARNING,
        evidence={"reason": reason, **evidence},
        observed_at=time.time() if observed_at is None else observed_at,
    )


def check_recovered(check: str, *, observed_at: float | None = None) -> Finding:
    return Finding(
        check=check,
        component=f"check:{check}",
        code=CHECK_FAILED,
        message=f"check {check} runs again",
        severity=Severity.INFO,
        observed_at=time.time() if observed_at is None else observed_at,
        healthy=True,
    )


# Deep-check statuses as published (Kubernetes label value, Slurm reason, `status`); Error: no verdict reached.
DEEP_IN_PROGRESS, DEEP_PASSED, DEEP_FAILED, DEEP_ERROR = "InProgress", "Passed", "Failed", "Error"


class FaultDetail(BaseModel):
    """One fault as operators see it (Kubernetes annotation, `nodemedic status`)."""

    model_config = ConfigDict(extra="ignore")

    time: float
    component: str
    code: str
    type: str
    message: str
    action: str
    check: str = ""
    count: int = 1
    enforced: bool = True


class NodeVerdict(BaseModel):
    """What the node needs now."""

    model_config = ConfigDict(extra="ignore")

    health: Health = Health.SCHEDULABLE
    action: str = "none"
    fault_types: list[str] = []
    fault_reasons: list[str] = []
    faults: list[FaultDetail] = []
    deep_check: str | None = None
    generation: int = 0
    updated_at: float = 0.0

    @property
    def healthy(self) -> bool:
        return self.health is Health.SCHEDULABLE
