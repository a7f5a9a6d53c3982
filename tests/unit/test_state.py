from __future__ import annotations

import json
import logging
import multiprocessing
import os

import pytest

from nodemedic.policy import PolicyState
from nodemedic.state import AgentLock, StateStore

from conftest import finding


def _busy_state(policy, clock) -> PolicyState:
    state = PolicyState()
    policy.on_boot(state, "boot-a", clock())
    policy.observe(state, finding("XID_79"), clock())
    policy.observe(state, finding("PCIE_AER_NONFATAL", "pci:0000:00:1d.0"), clock())
    return state


def test_round_trip_resumes_exactly(tmp_path, policy, clock):
    store = StateStore(tmp_path)
    state = _busy_state(policy, clock)
    store.save(state)
    loaded = store.load()
    assert loaded == state
    assert loaded.verdict.health.value == "UnschedulablePendingReboot"


def test_missing_file_is_clean_state(tmp_path):
    assert StateStore(tmp_path / "nope").load() == PolicyState()


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path, policy, clock):
    store = StateStore(tmp_path)
    store.save(_busy_state(policy, clock))
    store.save(PolicyState())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_failed_write_keeps_the_old_file(tmp_path, policy, clock, monkeypatch):
    store = StateStore(tmp_path)
    good = _busy_state(policy, clock)
    store.save(good)

    def boom(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        store.save(PolicyState())
    monkeypatch.undo()
    assert store.load() == good
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\x00\xff\xfe", b'{"active": {"k": 3}}',
                                     b'{"version": 99}', b""])
def test_corrupt_file_is_moved_aside_and_agent_starts_clean(tmp_path, content, caplog):
    store = StateStore(tmp_path)
    store.path.write_bytes(content)
    with caplog.at_level(logging.ERROR):
        assert store.load() == PolicyState()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("state.json.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes() == content
    assert not store.path.exists()
    assert "moved aside" in caplog.text


def test_unreadable_file_is_not_fatal(tmp_path, caplog):
    store = StateStore(tmp_path)
    store.path.mkdir()  # reading a directory fails with an OSError
    with caplog.at_level(logging.ERROR):
        assert store.load() == PolicyState()
    assert "unusable" in caplog.text


def _bump(directory: str, n: int) -> None:
    store = StateStore(directory)
    for _ in range(n):
        with store.transaction() as state:
            state.suppressed += 1


def test_concurrent_writers_lose_no_update(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_bump, args=(str(tmp_path), 50)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert StateStore(tmp_path).load().suppressed == 200
    json.loads((tmp_path / "state.json").read_text())


def test_readers_never_see_partial_file(tmp_path, policy, clock):
    store = StateStore(tmp_path)
    big = _busy_state(policy, clock)
    for i in range(150):
        policy.observe(big, finding("XID_92", f"gpu:{i:04x}:00:00.0", message="x" * 500), clock.advance(1))
    ctx = multiprocessing.get_context("fork")
    writer = ctx.Process(target=_write_loop, args=(str(tmp_path), big.model_dump_json(), 200))
    writer.start()
    reads = 0
    while writer.is_alive() or reads == 0:
        if store.path.exists():
            json.loads(store.path.read_bytes())
            reads += 1
    writer.join()
    assert writer.exitcode == 0 and reads > 0


def _write_loop(directory: str, payload: str, n: int) -> None:
    store = StateStore(directory)
    state = PolicyState.model_validate_json(payload)
    for i in range(n):
        state.suppressed = i
        store.save(state)


def test_agent_lock(tmp_path):
    a, b = AgentLock(tmp_path), AgentLock(tmp_path)
    assert not b.held_by_other()
    assert a.acquire()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=lambda: q.put((AgentLock(tmp_path).held_by_other(), AgentLock(tmp_path).acquire())))
    p.start()
    p.join(10)
    assert q.get(timeout=5) == (True, False)
    a.release()
    assert b.acquire()
    b.release()
