"""The check interface: a check observes the node and produces findings, nothing else."""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from nodemedic.checks.platform.profiles import InstanceProfile
from nodemedic.model import Finding

Emit = Callable[[Finding], None]


class CheckUnavailable(Exception):
    """The check cannot run here (tool missing, permission denied): reported as a check failure, never a fault."""


@dataclass(frozen=True)
class NodeContext:
    """What a check may know about the node it runs on."""

    node_name: str
    instance_type: str | None = None
    profile: InstanceProfile | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def expected_gpus(self) -> int | None:
        return self.profile.gpus if self.profile is not None else None


class Check(abc.ABC):
    name: str = "check"
    timeout_s: float = 60.0

    def applies(self, ctx: NodeContext) -> bool:
        """Whether this check has anything to look at on this node."""
        return True


class Watcher(Check):
    """Streams findings as they happen; `watch` returns only when `stop` is set (or raises)."""

    @abc.abstractmethod
    def watch(self, emit: Emit, stop: threading.Event) -> None: ...

    def wait_ready(self, timeout: float) -> bool:
        """True once the watcher is positioned on its source, so nothing that happens from now on is missed."""
        return True

    # Whether `scan` gives a one-pass view (a log can be read to its end; an event stream has nothing to re-read).
    scannable: bool = False

    def scan(self) -> list[Finding]:
        """One pass over what is already there (for `nodemedic check`)."""
        raise CheckUnavailable(f"{self.name} has no one-pass mode")


class Poller(Check):
    """Returns the findings of one pass each time it is run."""

    interval_s: float = 30.0

    @abc.abstractmethod
    def run(self) -> list[Finding]: ...
