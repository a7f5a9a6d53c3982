"""Cross-rank pieces over the job's store: fault keys per generation and the re-execution barrier.

Works with any object that has the torch.distributed.Store methods used here: set, get, check, add, compare_set
(TCPStore, FileStore, HashStore, PrefixStore, or a test double). `get` is only called on keys that `check` found or that
the writer sets right after a counter it already bumped, so no call blocks for long.

Keys (under `prefix`, default "nodemedic"):
  <prefix>/fault/<gen>                 JSON of the first fault seen in generation <gen> (compare_set: first writer wins)
  <prefix>/barrier/<gen>/count         arrivals at the barrier that starts generation <gen>
  <prefix>/barrier/<gen>/arrived/<i>   the previous-generation rank of the i-th arrival (1-based)
  <prefix>/barrier/<gen>/closed        the number of arrivals admitted; later arrivals are excluded
  <prefix>/pg/<gen>/...                Context.init_process_group's rendezvous for generation <gen>
"""

from __future__ import annotations

import time
from typing import Any, Callable


class BarrierTimeout(RuntimeError):
    """Not every rank of the previous generation arrived in time (and shrinking is off or below the minimum)."""


class Excluded(RuntimeError):
    """This rank arrived after the barrier closed: the survivors went on without it."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def fault_key(prefix: str, generation: int) -> str:
    return f"{prefix}/fault/{generation}"


def publish_fault(store: Any, prefix: str, generation: int, payload: str) -> str:
    """Record the fault of `generation` unless one already is; returns the recorded payload."""
    return _text(store.compare_set(fault_key(prefix, generation), "", payload))


def read_fault(store: Any, prefix: str, generation: int) -> str | None:
    key = fault_key(prefix, generation)
    return _text(store.get(key)) if store.check([key]) else None


def barrier(store: Any, prefix: str, generation: int, rank: int, world_size: int, *, timeout_s: float,
            shrink: bool = False, min_world_size: int = 1, poll_s: float = 0.002,
            clock: Callable[[], float] = time.monotonic) -> tuple[int, int]:
    """Wait for the ranks of the previous generation; returns (new rank, new world size).

    Without `shrink` every one of `world_size` ranks must arrive within `timeout_s`, else BarrierTimeout. With
    `shrink` the first rank to time out closes the barrier with whoever arrived (compare_set makes every rank agree
    on the count); survivors are renumbered in the order of their previous ranks; late arrivals get Excluded.
    """
    base = f"{prefix}/barrier/{generation}"
    count_key, closed_key = f"{base}/count", f"{base}/closed"
    index = int(store.add(count_key, 1))
    store.set(f"{base}/arrived/{index}", str(rank))
    deadline = clock() + timeout_s
    delay = poll_s
    while True:
        if store.check([closed_key]):
            admitted = int(_text(store.get(closed_key)))
            break
        arrived = int(store.add(count_key, 0))
        if arrived >= world_size:
            admitted = int(_text(store.compare_set(closed_key, "", str(world_size))))
            break
        if clock() >= deadline:
            if not shrink:
                raise BarrierTimeout(f"{arrived} of {world_size} ranks reached the barrier of generation "
                                     f"{generation} in {timeout_s:g} s")
            admitted = int(_text(store.compare_set(closed_key, "", str(arrived))))
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    if index > admitted:
        raise Excluded(f"arrived {index}th at the barrier of generation {generation}, closed at {admitted}")
    if admitted < max(1, min_world_size):
        raise BarrierTimeout(f"only {admitted} ranks survived (minimum {min_world_size})")
    members = sorted(int(_text(store.get(f"{base}/arrived/{i}"))) for i in range(1, admitted + 1))
    return members.index(rank), admitted
