"""Injected failures: the next N matching requests get a Status error instead of being served."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from .errors import GENERIC_MESSAGES, REASONS, status_body


@dataclass
class Fault:
    """One armed failure; `path_contains` is matched against the raw request target, query string included."""

    status: int
    remaining: int
    methods: frozenset[str] | None
    path_contains: str | None
    retry_after: float | None
    message: str | None

    def matches(self, method: str, target: str) -> bool:
        return (self.remaining > 0 and (self.methods is None or method in self.methods)
                and (self.path_contains is None or self.path_contains in target))

    def reply(self) -> tuple[int, dict, dict[str, str]]:
        """Status code, `Status` body and headers, as the API server (or API priority & fairness) sends them."""
        details: dict = {}
        headers: dict[str, str] = {}
        if self.retry_after is not None:
            # The server only ever sends whole seconds; urllib3 rejects a fractional Retry-After.
            seconds = max(0, math.ceil(self.retry_after))
            headers["Retry-After"] = str(seconds)
            details["retryAfterSeconds"] = seconds
        message = self.message or GENERIC_MESSAGES.get(self.status, f"injected fault {self.status}")
        return self.status, status_body(self.status, REASONS.get(self.status, "Unknown"), message, details), headers


class FaultQueue:
    """Armed faults, consumed first-armed-first when several match."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    def arm(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def take(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, target):
                    fault.remaining -= 1
                    return fault
            return None

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(f.remaining for f in self._faults)
