"""Object-metadata helpers: timestamps, uids, and the Go-serialiser quirks the server's output has."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

from .errors import bad_request

# metav1.Time fields are serialised at second precision, metav1.MicroTime at microseconds.
SECOND_TIME_FIELDS = frozenset({
    "creationTimestamp", "deletionTimestamp", "lastHeartbeatTime", "lastTransitionTime", "lastProbeTime",
    "timeAdded", "firstTimestamp", "lastTimestamp", "deprecatedFirstTimestamp", "deprecatedLastTimestamp",
    "startTime", "startedAt", "finishedAt",
})
MICRO_TIME_FIELDS = frozenset({"eventTime", "lastObservedTime"})
# Structs are always written by encoding/json even when empty; everything else here is `omitempty`.
ALWAYS_PRESENT = frozenset({"metadata", "spec", "status"})


def now() -> datetime:
    return datetime.now(timezone.utc)


def format_time(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_micro_time(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_uid() -> str:
    return str(uuid.uuid4())


def parse_time(text: str) -> datetime:
    """Parse RFC 3339 as Go does: a zone (Z or ±hh:mm) is required, a naive timestamp is an error."""
    candidate = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    try:
        parsed = datetime.fromisoformat(candidate)
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None or "T" not in text.upper():
        raise bad_request(f'parsing time "{text}" as "2006-01-02T15:04:05Z07:00": cannot parse "{text}" as RFC 3339')
    return parsed


def normalize(obj: Any, top: bool = True) -> Any:
    """Re-serialise like the server: canonical timestamps, dropped nulls/empties and `$` directives."""
    if isinstance(obj, list):
        return [normalize(item, top=False) for item in obj]
    if not isinstance(obj, dict):
        return obj
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if key.startswith("$"):
            continue  # unknown fields such as leftover patch directives are dropped on decode
        if isinstance(value, str) and key in SECOND_TIME_FIELDS and value:
            value = format_time(parse_time(value))
        elif isinstance(value, str) and key in MICRO_TIME_FIELDS and value:
            value = format_micro_time(parse_time(value))
        else:
            value = normalize(value, top=False)
        if value is None or (value in ({}, []) and not (top and key in ALWAYS_PRESENT)):
            continue
        if key == "unschedulable" and value is False:
            continue
        out[key] = value
    return out


def metadata(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
        obj["metadata"] = meta
    return meta
