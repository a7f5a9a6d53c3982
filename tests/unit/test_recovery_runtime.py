"""The in-process recovery runtime without torch: ranks are threads sharing an in-memory store, the agent is a fake
Unix-socket server speaking protocol.py."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from pathlib import Path

import pytest

from nodemedic.recovery import (RESTART_EXIT_CODE, FaultInterrupt, NodeAgentHealthCheck, NodeUnhealthy,
                                RestartLimitExceeded, Wrapper, recoverable)
from nodemedic.recovery.client import AgentClient
from nodemedic.recovery.protocol import FrameReader, encode
from nodemedic.recovery.store import BarrierTimeout, barrier


class MemoryStore:
    """The torch.distributed.Store methods the runtime uses, for threads of one process."""

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key, value):
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def get(self, key, timeout=5.0):
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, timeout):
                raise TimeoutError(key)
            return self._data[key]

    def check(self, keys):
        with self._cond:
            return all(k in self._data for k in keys)

    def add(self, key, amount):
        with self._cond:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def compare_set(self, key, expected, desired):
        with self._cond:
            current = self._data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self._data[key] = desired.encode()
            return self._data[key] if key in self._data else expected.encode()


class FakeAgent:
    """Accepts registrations on a Unix socket and sends `fault` frames to every connected rank."""

    def __init__(self, path: Path, generation: int = 100):
        self.path, self.generation = str(path), generation
        self.registrations: list[dict] = []
        self.messages: list[dict] = []
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        readers: dict[socket.socket, FrameReader] = {}
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                if key.fileobj is self._listener:
                    conn, _ = self._listener.accept()
                    readers[conn] = FrameReader()
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                data = conn.recv(65536)
                if not data:
                    sel.unregister(conn)
                    conn.close()
                    continue
                for message in readers[conn].feed(data):
                    self.messages.append(message)
                    if message["type"] == "register":
                        self.registrations.append(message)
                        conn.sendall(encode({"type": "registered", "generation": self.generation}))
                        self._conns.append(conn)
        sel.close()
        for conn in readers:
            conn.close()

    def send(self, message: dict, split: bool = False) -> None:
        frame = encode(message)
        for conn in list(self._conns):
            try:
                if split:  # a partial frame, then the rest
                    conn.sendall(frame[:3])
                    time.sleep(0.02)
                    conn.sendall(frame[3:])
                else:
                    conn.sendall(frame)
            except OSError:
                self._conns.remove(conn)

    def fault(self, generation: int | None = None, **kw) -> int:
        if generation is None:
            self.generation += 1
            generation = self.generation
        self.send({"type": "fault", "generation": generation, "code": kw.get("code", "XID_13"),
                   "component": kw.get("component", "gpu:0"), "reason": kw.get("reason", "test fault")})
        return generation

    def wait_registered(self, count: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.registrations) < count:
            assert time.monotonic() < deadline, f"{len(self.registrations)} of {count} registrations"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()
        Path(self.path).unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith("nodemedic-")]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not left, f"leaked threads: {left}"


@pytest.fixture
def agent(tmp_path):
    a = FakeAgent(tmp_path / "recovery.sock")
    yield a
    a.stop()


def options(**kw):
    base = dict(socket_path=False, health_check=None, abort=None, hard_timeout_s=10.0, poll_interval_s=0.002)
    base.update(kw)
    return base


def wait_for(predicate, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def spin(ctx, seconds: float = 5.0):
    """Compute in Python (where an injected exception lands) until interrupted."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.001)
    raise AssertionError("was not interrupted")


# -- re-execution ----------------------------------------------------------------------------------------------------

def test_local_exception_reexecutes_with_finalize_then_health_check():
    calls = []

    @recoverable(**options(finalize=lambda ctx: calls.append(("finalize", ctx.iteration)),
                           health_check=lambda ctx: calls.append(("health", ctx.iteration)) or True))
    def block(ctx, x):
        calls.append(("block", ctx.iteration))
        if ctx.iteration < 2:
            raise ValueError(f"boom {ctx.iteration}")
        return x * 2, ctx.fault.reason

    assert block(21) == (42, "ValueError: boom 1")
    assert calls == [("block", 0), ("finalize", 0), ("health", 0), ("block", 1), ("finalize", 1), ("health", 1),
                     ("block", 2)]


def test_restart_limit_and_non_faults():
    w = Wrapper(**options(max_restarts=1))
    with pytest.raises(RestartLimitExceeded):
        w(lambda ctx: 1 / 0)()
    assert len(w.faults) == 1

    def interrupted(ctx):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # not a fault: propagates, no re-execution
        Wrapper(**options())(interrupted)()


def test_failing_health_check_exits_with_restart_code():
    codes = []
    w = Wrapper(**options(health_check=lambda ctx: False, exit_fn=codes.append))
    with pytest.raises(SystemExit) as info:
        w(lambda ctx: 1 / 0)()
    assert info.value.code == RESTART_EXIT_CODE == codes[0] == 75


def run_ranks(world: int, block, **kw):
    """`world` ranks as threads sharing a MemoryStore; returns {rank: result or exception}."""
    store = MemoryStore()
    results: dict[int, object] = {}
    wrappers = [Wrapper(**options(store=store, rank=r, world_size=world, **kw)) for r in range(world)]

    def rank_main(r):
        try:
            results[r] = wrappers[r](block)()
        except BaseException as exc:  # noqa: BLE001
            results[r] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results, wrappers, store


def test_fault_on_one_rank_reaches_the_others_through_the_store():
    def block(ctx):
        if ctx.iteration == 0:
            if ctx.rank == 1:
                time.sleep(0.05)
                raise RuntimeError("rank 1 failed")
            spin(ctx)
        return ctx.iteration, ctx.rank, ctx.world_size

    results, wrappers, store = run_ranks(3, block)
    assert results == {0: (1, 0, 3), 1: (1, 1, 3), 2: (1, 2, 3)}
    assert [w.faults[0].source for w in wrappers] == ["store", "local", "store"]
    assert [w.deliveries for w in wrappers] == [1, 0, 1]
    assert b"rank 1 failed" in store.get("nodemedic/fault/0")


def test_barrier_timeout_exits_or_shrinks():
    store = MemoryStore()
    with pytest.raises(BarrierTimeout):
        barrier(store, "p", 1, 0, 2, timeout_s=0.1)
    store = MemoryStore()
    # ranks 0 and 2 of 3 arrive; rank 1 never does: the survivors go on as ranks 0 and 1 of 2
    out = {}
    ts = [threading.Thread(target=lambda r=r: out.setdefault(r, barrier(store, "p", 1, r, 3, timeout_s=0.2,
                                                                          shrink=True))) for r in (0, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(5)
    assert out == {0: (0, 2), 2: (1, 2)}


def test_dead_rank_exits_with_restart_code_or_shrinks():
    def block(ctx):
        if ctx.iteration == 0:
            if ctx.rank == 1:
                raise RuntimeError("rank 1 failed")
            spin(ctx)
        return ctx.rank, ctx.world_size

    def rank_1_dies(ctx):
        if ctx.initial_rank == 1:
            raise SystemExit(9)  # never reaches the barrier

    kw = dict(barrier_timeout_s=0.3, health_check=rank_1_dies, exit_fn=lambda code: None)
    results, _, _ = run_ranks(2, block, **kw)
    assert isinstance(results[0], SystemExit) and results[0].code == RESTART_EXIT_CODE
    results, _, _ = run_ranks(3, block, shrink=True, **kw)
    assert results[0] == (0, 2) and results[2] == (1, 2)


def test_soft_timeout_is_a_fault():
    @recoverable(**options(soft_timeout_s=0.1))
    def block(ctx):
        if ctx.iteration == 0:
            spin(ctx)
        return ctx.fault.source

    assert block() == "soft_timeout"


# -- delivery --------------------------------------------------------------------------------------------------------

def test_fault_inside_atomic_is_deferred_until_it_exits():
    events = []
    w = Wrapper(**options())

    def block(ctx):
        if ctx.iteration == 0:
            try:
                with ctx.atomic():
                    events.append("enter")
                    threading.Timer(0.05, w.raise_fault, args=("external",)).start()
                    time.sleep(0.3)  # the fault arrives in here
                    events.append("exit")
                spin(ctx)
            except FaultInterrupt:
                events.append("interrupted")
                raise
        return ctx.iteration

    assert w(block)() == 1
    assert events == ["enter", "exit", "interrupted"]
    assert w.deliveries == 1


def test_exception_never_delivered_twice():
    seen = []
    w = Wrapper(**options())

    def block(ctx):
        if ctx.iteration == 0:
            try:
                threading.Timer(0.05, w.raise_fault, args=("external",)).start()
                spin(ctx)
            except FaultInterrupt as exc:
                seen.append(exc)
                time.sleep(0.3)  # slow cleanup while unwinding: the handler's re-injection loop must not hit it
                seen.append("cleanup done")
                raise
        return ctx.iteration

    assert w(block)() == 1
    assert len(seen) == 2 and seen[1] == "cleanup done"
    assert w.deliveries == 1


def test_swallowed_injection_is_delivered_at_the_next_atomic():
    w = Wrapper(**options())

    def block(ctx):
        if ctx.iteration == 0:
            threading.Timer(0.05, w.raise_fault, args=("external",)).start()
            try:
                spin(ctx)
            except BaseException:
                pass  # badly behaved training code
            with ctx.atomic():
                raise AssertionError("entered an atomic section with a fault pending")
        return ctx.iteration

    assert w(block)() == 1


def test_hard_timeout_exits_with_restart_code():
    exited = threading.Event()
    codes = []
    release = threading.Event()
    w = Wrapper(**options(hard_timeout_s=0.2, max_restarts=0,
                          exit_fn=lambda code: (codes.append(code), exited.set())))

    def block(ctx):
        with ctx.atomic():  # never leaves in time: the fault cannot be delivered
            threading.Timer(0.02, w.raise_fault, args=("external",)).start()
            release.wait(5)
        return "done"

    t = threading.Thread(target=lambda: pytest.raises(RestartLimitExceeded, w(block)))
    t.start()
    assert exited.wait(5)
    release.set()
    t.join(5)
    assert codes == [RESTART_EXIT_CODE]


# -- the agent socket ------------------------------------------------------------------------------------------------

def test_agent_fault_reexecutes_and_stale_generations_are_dropped(agent):
    reached = threading.Event()
    w = Wrapper(**options(socket_path=agent.path, rank=3, local_rank=1, job_id="42", gpus=["0000:3b:00.0"]))

    def block(ctx):
        if ctx.iteration == 0:
            reached.set()
            spin(ctx)
        if ctx.iteration == 1:
            # the same generation again and an older one: both stale
            agent.fault(generation=agent.generation)
            agent.fault(generation=5)
            wait_for(lambda: w.client.stale_dropped == 2, what="stale faults dropped")
            time.sleep(0.05)
        return ctx.iteration

    def drive():
        agent.wait_registered(1)
        assert reached.wait(5)
        agent.fault()

    threading.Thread(target=drive).start()
    assert w(block)() == 1
    reg = agent.registrations[0]
    assert (reg["rank"], reg["local_rank"], reg["job_id"], reg["gpus"]) == (3, 1, "42", ["0000:3b:00.0"])
    assert w.faults[0].source == "agent" and w.faults[0].agent_generation == 101
    assert [m["state"] for m in agent.messages if m["type"] == "state"] == ["at_barrier", "past_barrier"]


def test_local_fault_is_reported_to_the_agent(agent):
    w = Wrapper(**options(socket_path=agent.path))

    def block(ctx):
        if ctx.iteration == 0:
            wait_for(w.client.registered.is_set, what="registration")
            raise RuntimeError("CUDA error: an illegal memory access")
        wait_for(lambda: any(m["type"] == "report" for m in agent.messages), what="report")
        return ctx.iteration

    assert w(block)() == 1
    report = next(m for m in agent.messages if m["type"] == "report")
    assert "illegal memory access" in report["error"] and report["generation"] == 100


def test_missing_agent_is_allowed(tmp_path):
    @recoverable(**options(socket_path=str(tmp_path / "nobody.sock")))
    def block(ctx):
        if ctx.iteration == 0:
            raise RuntimeError("still recovers")
        return ctx.iteration

    assert block() == 1


def test_client_reconnects_after_agent_restart_and_handles_split_and_batched_frames(tmp_path):
    path = tmp_path / "agent.sock"
    first = FakeAgent(path, generation=7)
    got = []
    client = AgentClient(str(path), rank=0, local_rank=0, on_fault=got.append, job_id="j", gpus=[],
                         backoff_initial_s=0.01, backoff_max_s=0.05).start()
    try:
        first.wait_registered(1)
        wait_for(client.registered.is_set)
        first.send({"type": "fault", "generation": 8, "code": "a", "component": "c", "reason": "r"}, split=True)
        wait_for(lambda: len(got) == 1, what="split frame")
        first.stop()  # the agent restarts
        wait_for(lambda: not client.registered.is_set(), what="disconnect")
        second = FakeAgent(path, generation=20)
        try:
            second.wait_registered(1)
            wait_for(lambda: client.registrations == 2, what="re-registration")
            assert client.generation == 20
            frames = (encode({"type": "fault", "generation": 21, "code": "b", "component": "c", "reason": "r"})
                      + encode({"type": "fault", "generation": 21, "code": "b", "component": "c", "reason": "r"}))
            for conn in second._conns:
                conn.sendall(frames)  # two in one write: the second is stale
            wait_for(lambda: client.stale_dropped == 1, what="stale duplicate")
            assert [m["generation"] for m in got] == [8, 21]
        finally:
            second.stop()
    finally:
        client.stop()


# -- the node verdict as a health check --------------------------------------------------------------------------------

def write_state(path: Path, health: str) -> Path:
    path.write_text(json.dumps({"version": 1, "verdict": {"health": health, "action": "drain",
                                                          "fault_reasons": ["XID 79 on gpu:0"]}}))
    return path


def test_node_agent_health_check(tmp_path):
    state = tmp_path / "state.json"
    check = NodeAgentHealthCheck(state)
    assert check("s") == "s"  # no agent state file: healthy
    with pytest.raises(NodeUnhealthy):
        NodeAgentHealthCheck(state, missing_ok=False)()
    write_state(state, "Schedulable")
    assert check("s") == "s"
    write_state(state, "UnschedulablePendingReboot")
    with pytest.raises(NodeUnhealthy, match="XID 79"):
        check()
    codes = []  # as the Wrapper's health check: an unhealthy node exits for a process restart
    with pytest.raises(SystemExit):
        Wrapper(**options(health_check=check, exit_fn=codes.append))(lambda ctx: 1 / 0)()
    assert codes == [RESTART_EXIT_CODE]


def test_node_agent_health_check_in_nvidia_resiliency_ext(tmp_path):
    inprocess = pytest.importorskip("nvidia_resiliency_ext.inprocess")
    state = write_state(tmp_path / "state.json", "Schedulable")
    composed = inprocess.Compose(NodeAgentHealthCheck(state), lambda s: s)
    assert composed("frozen") == "frozen"
    write_state(state, "Unschedulable")
    with pytest.raises(NodeUnhealthy):
        composed("frozen")
