"""The agent's recovery socket against real Unix sockets, and the rule for which decisions signal ranks."""

from __future__ import annotations

import grp
import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from nodemedic.catalog import load_catalog
from nodemedic.model import Action, Finding, Health, Severity
from nodemedic.policy import CheckMode, Decision, Outcome, Policy, PolicyConfig, PolicyState
from nodemedic.recovery.protocol import MAX_FRAME, FrameReader, encode
from nodemedic.recovery_server import (RecoveryConfig, RecoveryServer, RecoveryServerError, normalize_gpu,
                                       should_signal, signal_gpus, signal_ranks)

from conftest import finding

GPU0, GPU1 = "0000:3b:00.0", "0000:5d:00.0"


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


class Rank:
    """A minimal training-side client: blocking socket, the protocol's framing."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(str(path))
        self.reader = FrameReader()
        self.pending: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(encode(message))

    def register(self, rank: int, gpus: list[str] | None = None, job: str = "job-1") -> dict[str, Any]:
        self.send({"type": "register", "rank": rank, "local_rank": rank, "pid": 1000 + rank, "job_id": job,
                   "gpus": gpus or []})
        return self.recv()

    def recv(self) -> dict[str, Any]:
        while not self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("server closed the connection")
            self.pending += self.reader.feed(data)
        return self.pending.pop(0)

    def closed_by_server(self) -> bool:
        try:
            while self.sock.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def sock_path(tmp_path) -> Path:
    return tmp_path / "run" / "recovery.sock"


@pytest.fixture
def reports() -> list[Finding]:
    return []


@pytest.fixture
def server(sock_path, reports):
    srv = RecoveryServer(sock_path, on_report=reports.append, generation=0)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def connect(sock_path):
    ranks: list[Rank] = []

    def _connect() -> Rank:
        ranks.append(Rank(sock_path))
        return ranks[-1]
    yield _connect
    for r in ranks:
        r.close()


# -- registration and broadcast -------------------------------------------------------------------------------------

def test_register_gets_current_generation_and_is_tracked(server, connect):
    assert connect().register(3, ["00000000:3B:00.0", "1"]) == {"type": "registered", "generation": 0}
    (info,) = server.ranks()
    assert (info.rank, info.local_rank, info.pid, info.job_id) == (3, 3, 1003, "job-1")
    assert info.gpus == {GPU0, "1"}


def test_broadcast_reaches_every_rank(server, connect):
    ranks = [connect() for _ in range(4)]
    for i, r in enumerate(ranks):
        r.register(i)
    assert server.broadcast_fault("XID_79", f"gpu:{GPU0}", "GPU has fallen off the bus") == 4
    for r in ranks:
        assert r.recv() == {"type": "fault", "generation": 1, "code": "XID_79", "component": f"gpu:{GPU0}",
                            "reason": "GPU has fallen off the bus"}


def test_gpu_filtered_broadcast(server, connect):
    on0, on1, undeclared, by_index = connect(), connect(), connect(), connect()
    on0.register(0, [GPU0])
    on1.register(1, [GPU1])
    undeclared.register(2)
    by_index.register(3, ["0"])  # an index cannot be told apart from a PCI address: signalled to be safe
    assert server.broadcast_fault("XID_13", f"gpu:{GPU0}", "app error", gpus={"00000000:3B:00.0"}) == 3
    for r in (on0, undeclared, by_index):
        assert r.recv()["generation"] == 1
    assert server.broadcast_fault("XID_79", "node", "all") == 4
    assert on1.recv()["generation"] == 2  # it never saw generation 1


def test_generation_grows_once_per_broadcast(server, connect):
    r = connect()
    r.register(0)
    for expected in (1, 2, 3):
        server.broadcast_fault("XID_13", "gpu:x", "again")
        assert server.generation == expected and r.recv()["generation"] == expected
    assert server.broadcast_fault("XID_13", "gpu:x", "nobody", gpus={GPU1}) == 1  # r declared no GPUs
    assert connect().register(1) == {"type": "registered", "generation": 4}


def test_default_generation_starts_above_any_earlier_agent(sock_path):
    before = RecoveryServer(sock_path).generation
    time.sleep(0.002)
    assert RecoveryServer(sock_path).generation > before > 0


def test_disconnected_rank_is_forgotten(server, connect):
    a, b = connect(), connect()
    a.register(0)
    b.register(1)
    a.close()
    wait_for(lambda: [r.rank for r in server.ranks()] == [1])
    assert server.broadcast_fault("XID_79", "node", "x") == 1
    assert b.recv()["generation"] == 1


def test_state_messages_are_tracked(server, connect):
    r = connect()
    r.register(0)
    r.send({"type": "state", "rank": 0, "generation": 7, "state": "at_barrier"})
    wait_for(lambda: server.ranks()[0].state == "at_barrier")
    assert server.ranks()[0].state_generation == 7


# -- reports ----------------------------------------------------------------------------------------------------------

def test_report_becomes_finding(server, connect, reports):
    r = connect()
    r.register(2, job="llama")
    r.send({"type": "report", "rank": 2, "generation": 0, "error": "NCCL watchdog timeout", "component": None})
    wait_for(lambda: len(reports) == 1)
    f = reports[0]
    assert (f.check, f.code, f.component, f.severity) == ("recovery", "RANK_REPORTED_FAULT", "rank:llama:2",
                                                         Severity.ERROR)
    assert "NCCL watchdog timeout" in f.message
    assert f.evidence["error"] == "NCCL watchdog timeout" and f.evidence["pid"] == 1002


def test_report_may_name_its_component(server, connect, reports):
    r = connect()
    r.register(0)
    r.send({"type": "report", "rank": 0, "generation": 0, "error": "CUDA error", "component": f"gpu:{GPU0}"})
    wait_for(lambda: len(reports) == 1)
    assert reports[0].component == f"gpu:{GPU0}"


def test_failing_on_report_does_not_stop_the_server(sock_path, connect):
    def boom(_f: Finding) -> None:
        raise RuntimeError("agent queue gone")
    srv = RecoveryServer(sock_path, on_report=boom, generation=0)
    srv.start()
    try:
        r = connect()
        r.register(0)
        r.send({"type": "report", "rank": 0, "generation": 0, "error": "x", "component": None})
        assert srv.broadcast_fault("XID_79", "node", "x") == 1
        assert r.recv()["type"] == "fault"
    finally:
        srv.stop()


# -- framing ----------------------------------------------------------------------------------------------------------

def test_frame_sent_byte_by_byte(server, connect):
    r = connect()
    for i, byte in enumerate(encode({"type": "register", "rank": 0, "local_rank": 0, "pid": 1, "job_id": "j",
                                     "gpus": []})):
        r.sock.sendall(bytes([byte]))
        if i % 7 == 0:
            time.sleep(0.0005)  # give the server a chance to read the pieces separately
    assert r.recv() == {"type": "registered", "generation": 0}


def test_two_messages_in_one_send(server, connect, reports):
    r = connect()
    r.sock.sendall(encode({"type": "register", "rank": 5, "local_rank": 1, "pid": 9, "job_id": "j", "gpus": []})
                   + encode({"type": "report", "rank": 5, "generation": 0, "error": "boom", "component": None}))
    assert r.recv()["type"] == "registered"
    wait_for(lambda: len(reports) == 1)
    assert reports[0].component == "rank:j:5"


@pytest.mark.parametrize("bad", [
    struct.pack(">I", MAX_FRAME + 1) + b"x" * 16,                 # oversized
    struct.pack(">I", 8) + b"not json",                           # not JSON
    struct.pack(">I", 2) + b"[]",                                 # not a message object
    encode({"type": "register", "rank": "zero", "job_id": "j"}),  # a register missing its fields
], ids=["oversized", "not-json", "not-object", "bad-register"])
def test_bad_frame_closes_only_that_connection(server, connect, bad):
    good, evil = connect(), connect()
    good.register(0)
    evil.register(1)
    evil.sock.sendall(bad)
    assert evil.closed_by_server()
    wait_for(lambda: [r.rank for r in server.ranks()] == [0])
    assert server.broadcast_fault("XID_79", "node", "x") == 1
    assert good.recv()["generation"] == 1
    assert connect().register(2)["type"] == "registered"


def test_unknown_message_type_is_ignored(server, connect):
    r = connect()
    r.send({"type": "hello-from-the-future"})
    assert r.register(0)["type"] == "registered"


def test_stuck_reader_is_dropped_without_stalling_others(sock_path, connect):
    srv = RecoveryServer(sock_path, generation=0, max_buffer=100_000)
    srv.start()
    try:
        stuck, live = connect(), connect()
        stuck.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.register(0)
        live.register(1)
        reason = "x" * 30_000
        for n in range(1, 200):
            srv.broadcast_fault("XID_13", "gpu:x", reason)
            assert live.recv()["generation"] == n
            if len(srv.ranks()) == 1:
                break
        assert [r.rank for r in srv.ranks()] == [1]
        assert srv.broadcast_fault("XID_79", "node", "x") == 1
    finally:
        srv.stop()


# -- the socket file --------------------------------------------------------------------------------------------------

def test_socket_file_mode_and_directory(server, sock_path):
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(sock_path.parent).st_mode) == 0o755


def test_socket_group(tmp_path):
    group = grp.getgrgid(os.getgid()).gr_name
    path = tmp_path / "g.sock"
    srv = RecoveryServer(path, mode=0o600, group=group)
    srv.start()
    try:
        st = os.stat(path)
        assert st.st_gid == os.getgid() and stat.S_IMODE(st.st_mode) == 0o600
    finally:
        srv.stop()


def test_unknown_group_refuses_and_leaves_nothing(tmp_path):
    path = tmp_path / "g.sock"
    with pytest.raises(RecoveryServerError, match="no-such-group-here"):
        RecoveryServer(path, group="no-such-group-here").start()
    assert not path.exists()


def test_stale_socket_file_is_replaced(sock_path, connect):
    sock_path.parent.mkdir(parents=True)
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    crashed.bind(str(sock_path))
    crashed.close()  # an agent that died without unlinking
    srv = RecoveryServer(sock_path, generation=0)
    srv.start()
    try:
        assert connect().register(0)["type"] == "registered"
    finally:
        srv.stop()


def test_second_server_on_same_path_refuses(server, sock_path, connect):
    with pytest.raises(RecoveryServerError, match="live"):
        RecoveryServer(sock_path).start()
    assert connect().register(0)["type"] == "registered"  # the first one keeps its socket


def test_path_that_is_not_a_socket_is_left_alone(tmp_path):
    path = tmp_path / "recovery.sock"
    path.write_text("precious")
    with pytest.raises(RecoveryServerError, match="not a socket"):
        RecoveryServer(path).start()
    assert path.read_text() == "precious"


def test_stop_leaves_no_thread_and_no_socket_file(sock_path, connect):
    srv = RecoveryServer(sock_path)
    srv.start()
    r = connect()
    r.register(0)
    srv.stop()
    assert not sock_path.exists()
    assert not any(t.name == "recovery-server" for t in threading.enumerate())
    assert r.closed_by_server()
    assert srv.ranks() == [] and srv.broadcast_fault("XID_79", "node", "x") == 0
    srv.stop()  # idempotent
    srv.start()  # and restartable
    srv.stop()
    assert not sock_path.exists()


def test_normalize_gpu():
    assert normalize_gpu("00000000:3B:00.0") == GPU0 == normalize_gpu("3b:00.0")
    assert normalize_gpu(2) == "2" and normalize_gpu("GPU-abc") == "gpu-abc"


# -- which decisions signal ranks -------------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self, advance: float = 0.0) -> float:
        self.now += advance
        return self.now


def _decide(*findings: Finding, overrides: dict | None = None, modes: dict | None = None,
            step: float = 1.0) -> Decision:
    """The last decision the real policy makes for these findings in order."""
    policy = Policy(load_catalog(overrides), PolicyConfig(check_modes=modes or {}))
    state, clock = PolicyState(), Clock()
    decisions = [policy.observe(state, f, clock(step)) for f in findings]
    assert decisions[-1] is not None
    return decisions[-1]


G0 = f"gpu:{GPU0}"
HARDWARE_13 = {"XID_13": {"kind": "hardware"}}
CASES: dict[str, tuple[Callable[[], Decision], bool, set[str] | None]] = {
    "fatal xid activates reboot": (lambda: _decide(finding("XID_79", G0)), True, None),
    "double-bit ecc resets gpu": (lambda: _decide(finding("XID_48", G0)), True, None),
    "escalated on return": (lambda: _decide(finding("XID_48", G0), finding("XID_48", G0, healthy=True),
                                            finding("XID_48", G0)), True, None),
    "named remedy raised": (lambda: _decide(finding("XID_154", G0, recommended_action=Action.WATCH),
                                            finding("XID_154", G0, recommended_action=Action.REBOOT)), True, None),
    "held until corroborated": (lambda: _decide(finding("GPU_LOST", G0, check="pci")), False, None),
    "corroborated": (lambda: _decide(finding("GPU_LOST", G0, check="pci"),
                                     finding("GPU_LOST", G0, check="nvml.events")), True, None),
    "application xid 13": (lambda: _decide(finding("XID_13", G0)), True, {GPU0}),
    "application xid 94 (watch)": (lambda: _decide(finding("XID_94", G0)), True, {GPU0}),
    "application fault off any gpu": (lambda: _decide(finding("XID_13", "node")), False, None),
    "application made hardware": (lambda: _decide(finding("XID_13", G0), overrides=HARDWARE_13),
                                  False, None),
    "watch-level hardware fault": (lambda: _decide(finding("XID_63", G0)), False, None),
    "repeat of an active fault": (lambda: _decide(finding("XID_79", G0), finding("XID_79", G0), step=700),
                                  False, None),
    "cleared": (lambda: _decide(finding("XID_79", G0), finding("XID_79", G0, healthy=True)), False, None),
    "below threshold": (lambda: _decide(finding("PCIE_AER_NONFATAL", "pci:0000:00:1d.0")), False, None),
    "observe-mode check": (lambda: _decide(finding("XID_79", G0), modes={"kernel_log": CheckMode.OBSERVE}),
                           False, None),
    "a rank's own report": (lambda: _decide(finding("RANK_REPORTED_FAULT", G0, check="recovery"),
                                            overrides={"RANK_REPORTED_FAULT": {"action": "reboot"}}), False, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_should_signal_truth_table(name):
    make, expected, gpus = CASES[name]
    decision = make()
    catalog = load_catalog(HARDWARE_13 if name == "application made hardware" else None)  # the policy's own
    assert should_signal(decision, catalog) is expected, (decision.outcome, decision.action)
    if expected:
        assert signal_gpus(decision, catalog) == gpus


def test_repeat_case_really_is_a_repeat():
    d = CASES["repeat of an active fault"][0]()
    assert d.outcome is Outcome.REPEATED and d.action is Action.REBOOT


def test_signal_on_limits_node_level_faults():
    reboot = _decide(finding("XID_79", G0))
    only_replace = RecoveryConfig(signal_on=["UnschedulablePendingReplacement"])
    assert only_replace.signal_on == [Health.PENDING_REPLACEMENT]
    assert not should_signal(reboot, config=only_replace)
    assert should_signal(_decide(finding("XID_13", G0)), config=only_replace)
    assert not should_signal(_decide(finding("XID_13", G0)), config=RecoveryConfig(signal_application=False))


def test_config_parses_octal_modes():
    c = RecoveryConfig.model_validate({"mode": "0660", "dir_mode": "0o750", "group": "training"})
    assert (c.mode, c.dir_mode, c.group) == (0o660, 0o750, "training")
    assert RecoveryConfig(mode=0o640).mode == 0o640
    with pytest.raises(ValueError):
        RecoveryConfig.model_validate({"sockett": "/x"})


def test_signal_ranks_targets_the_decision(server, connect):
    on0, on1 = connect(), connect()
    on0.register(0, [GPU0])
    on1.register(1, [GPU1])
    assert signal_ranks(server, _decide(finding("XID_13", G0))) == 1
    assert on0.recv()["code"] == "XID_13"
    assert signal_ranks(server, _decide(finding("XID_63", G0))) == 0
    assert signal_ranks(server, _decide(finding("XID_79", G0))) == 2
    assert on0.recv()["generation"] == on1.recv()["generation"] == 2
