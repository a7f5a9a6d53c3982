"""The agent <-> rank framing: 4-byte big-endian length + UTF-8 JSON."""

from __future__ import annotations

import pytest

from nodemedic.recovery.protocol import MAX_FRAME, FrameError, FrameReader, encode


def test_round_trip_partial_reads_and_several_per_read():
    a, b = encode({"type": "fault", "generation": 3}), encode({"type": "registered", "generation": 3})
    r = FrameReader()
    wire = a + b
    got = []
    for i in range(0, len(wire), 3):  # three bytes at a time
        got += r.feed(wire[i:i + 3])
    assert got == [{"type": "fault", "generation": 3}, {"type": "registered", "generation": 3}]
    assert FrameReader().feed(a + b) == got


@pytest.mark.parametrize("frame", [
    (MAX_FRAME + 1).to_bytes(4, "big"),
    (5).to_bytes(4, "big") + b"\xff\xfe{}x",
    (2).to_bytes(4, "big") + b"[]",
    (7).to_bytes(4, "big") + b'{"a": 1',
    (8).to_bytes(4, "big") + b'{"a": 1}',
])
def test_bad_frames_raise(frame):
    with pytest.raises(FrameError):
        FrameReader().feed(frame)


def test_oversized_message_is_refused_on_encode():
    with pytest.raises(FrameError):
        encode({"type": "x", "pad": "a" * MAX_FRAME})
