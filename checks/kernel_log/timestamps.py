"""Timestamps in the prefixes that dmesg, syslog, the journal and /dev/kmsg put before kernel messages."""

from __future__ import annotations

import re
from datetime import datetime, timezone

_KMSG = re.compile(r"^\d+,\d+,(\d+),[^;]*;")
_MONO = re.compile(r"^\s*\[\s*(\d+\.\d+)\]")
_CTIME = re.compile(r"^\s*\[(\w{3} \w{3} +\d{1,2} \d\d:\d\d:\d\d \d{4})\]")
_ISO = re.compile(r"^(?:\w+\s*:\s*\w+\s*:\s*)?(\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)")
_SYSLOG = re.compile(r"^(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(\d{1,2}) (\d\d:\d\d:\d\d)")


def parse_timestamp(line: str, year: int | None = None) -> tuple[float, bool] | None:
    """(seconds, is_wall_clock) from a line's prefix; boot-relative times come back with is_wall_clock False."""
    m = _ISO.match(line)
    if m is not None:
        text = m.group(1).replace(",", ".").replace(" ", "T")
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            return None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        return dt.timestamp(), True
    m = _SYSLOG.match(line)
    if m is not None:
        y = year or datetime.now(timezone.utc).year
        dt = datetime.strptime(f"{y} {m.group(1)} {m.group(2)} {m.group(3)}", "%Y %b %d %H:%M:%S")
        return dt.replace(tzinfo=timezone.utc).timestamp(), True
    m = _CTIME.match(line)
    if m is not None:
        dt = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y")
        return dt.replace(tzinfo=timezone.utc).timestamp(), True
    m = _KMSG.match(line)
    if m is not None:
        return int(m.group(1)) / 1e6, False
    m = _MONO.match(line)
    if m is not None:
        return float(m.group(1)), False
    return None
