"""The agent <-> training-rank protocol: 4-byte big-endian length, then a UTF-8 JSON object. Stdlib only.

Messages (every one has "type"):
  rank -> agent  {"type": "register", "rank": int, "local_rank": int, "pid": int, "job_id": str, "gpus": [str]}
                 {"type": "report", "rank": int, "generation": int, "error": str, "component": str | None}
                 {"type": "state", "rank": int, "generation": int, "state": "at_barrier" | "past_barrier"}
  agent -> rank  {"type": "registered", "generation": int}      (the agent's current generation)
                 {"type": "fault", "generation": int, "code": str, "component": str, "reason": str}
A fault carries a generation number that only grows; a rank drops any fault at or below the last it acted on.
"""

from __future__ import annotations

import json
import struct
from typing import Any

SOCKET_ENV = "NODEMEDIC_RECOVERY_SOCKET"
DEFAULT_SOCKET = "/run/nodemedic/recovery.sock"
MAX_FRAME = 64 * 1024  # messages are small; anything larger is a broken or hostile peer
_HEADER = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that cannot be a message: oversized, not JSON, not an object. The connection should close."""


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise FrameError(f"message of {len(body)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Feed it bytes as they arrive (partial reads, several messages per read); it returns whole messages."""

    def __init__(self, max_frame: int = MAX_FRAME):
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buf)
            if length > self.max_frame:
                raise FrameError(f"frame of {length} bytes exceeds {self.max_frame}")
            if len(self._buf) < _HEADER.size + length:
                break
            body = bytes(self._buf[_HEADER.size:_HEADER.size + length])
            del self._buf[:_HEADER.size + length]
            try:
                message = json.loads(body.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise FrameError(f"frame is not UTF-8 JSON: {exc}") from None
            if not isinstance(message, dict) or not isinstance(message.get("type"), str):
                raise FrameError("frame is not a message object with a type")
            out.append(message)
        return out
