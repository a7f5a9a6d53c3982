"""The agent side of in-process recovery: a Unix socket that training ranks on this node register with.

The agent tells registered ranks to abort their step (a `fault` message) when a decision says so, and turns faults
the ranks report into findings. Wire format and message types: nodemedic.recovery.protocol.
"""

from __future__ import annotations

import errno
import functools
import grp
import logging
import os
import re
import selectors
import socket
import stat
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nodemedic.catalog import Catalog, Kind, load_catalog
from nodemedic.model import Action, Finding, Health, Severity
from nodemedic.policy import Decision, Outcome
from nodemedic.recovery.protocol import DEFAULT_SOCKET, FrameError, FrameReader, encode

log = logging.getLogger(__name__)

REPORT_CHECK = "recovery"
REPORT_CODE = "RANK_REPORTED_FAULT"
MAX_BUFFER = 1 << 20   # queued bytes for one rank; a reader this far behind is stuck and is dropped
RECV_SIZE = 65536
_PCI = re.compile(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")


class RecoveryServerError(RuntimeError):
    """The server cannot start: the path is served by a live agent, is not a socket, or cannot be set up."""


# -- configuration and the signalling rule ---------------------------------------------------------------------------

NODE_LEVEL = [Health.UNSCHEDULABLE, Health.PENDING_REBOOT, Health.PENDING_REPLACEMENT]
FAULT_OUTCOMES = frozenset({Outcome.ACTIVATED, Outcome.ESCALATED, Outcome.RAISED, Outcome.CORROBORATED})
APPLICATION_OUTCOMES = frozenset({Outcome.NO_ACTION, Outcome.ACTIVATED})


class RecoveryConfig(BaseModel):
    """The `recovery:` section: where the socket is, who may connect, and which decisions signal ranks."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    socket: str = Field(default=DEFAULT_SOCKET, description="Unix socket training ranks connect to")
    mode: int = Field(default=0o660, ge=0, le=0o777, description="socket file permissions")
    dir_mode: int = Field(default=0o755, ge=0, le=0o777, description="permissions of a socket directory it creates")
    group: str | None = Field(default=None, description="group owning the socket (name or gid); default the agent's")
    signal_on: list[Health] = Field(
        default_factory=lambda: list(NODE_LEVEL),
        description="a new, escalated, raised or corroborated fault whose remedy means one of these health values "
                    "signals every rank")
    signal_application: bool = Field(
        default=True, description="application-level faults on a GPU (Xid 13, 31, 43, 45, 68, 69, 94) signal the "
                                  "ranks using that GPU")

    @field_validator("mode", "dir_mode", mode="before")
    @classmethod
    def _octal(cls, v: Any) -> Any:
        """A string is read as octal ("0660", "660", "0o660"); YAML's 0660 already arrives as an int."""
        return int(v.removeprefix("0o"), 8) if isinstance(v, str) else v


def should_signal(decision: Decision, catalog: Catalog | None = None, config: RecoveryConfig | None = None) -> bool:
    """Whether a decision tells ranks to abort their step: a node-level fault, or an in-process-recoverable one.

    Node level: outcome activated/escalated/raised/corroborated with an action whose health is in `signal_on`
    (default: action >= reset_gpu, the node or a GPU is going away); the backend acts on the verdict as well.
    In-process recoverable: a catalog kind "application" fault on a GPU component, outcome no_action or activated,
    sent only to ranks using that GPU (see `signal_gpus`). Never: observe-mode decisions, clears and repeats (ranks
    already acted), and faults the ranks reported themselves (they propagate those through their own store).
    """
    config = config or RecoveryConfig()
    if not decision.enforced or decision.check == REPORT_CHECK:
        return False
    if decision.outcome in FAULT_OUTCOMES and decision.action >= Action.RESET_GPU:
        return Health.for_action(decision.action) in config.signal_on
    return config.signal_application and _is_application(decision, catalog)


def signal_gpus(decision: Decision, catalog: Catalog | None = None) -> set[str] | None:
    """The GPUs whose ranks a signalled decision concerns: the faulted GPU for an application fault, else all (None)."""
    if decision.action >= Action.RESET_GPU or not _is_application(decision, catalog):
        return None
    return {decision.component.partition(":")[2]}


def signal_ranks(server: RecoveryServer, decision: Decision, catalog: Catalog | None = None,
                 config: RecoveryConfig | None = None) -> int:
    """Apply the rule to one decision: broadcast a fault to the ranks it concerns; returns how many were signalled."""
    if not should_signal(decision, catalog, config):
        return 0
    return server.broadcast_fault(decision.code, decision.component, decision.reason, signal_gpus(decision, catalog))


def _is_application(decision: Decision, catalog: Catalog | None) -> bool:
    if decision.outcome not in APPLICATION_OUTCOMES or not decision.component.startswith("gpu:"):
        return False
    return (catalog or _builtin_catalog()).get(decision.code).kind is Kind.APPLICATION


@functools.cache
def _builtin_catalog() -> Catalog:
    return load_catalog()


# -- GPU identities ---------------------------------------------------------------------------------------------------

def normalize_gpu(gpu: str | int) -> str:
    """A PCI address as the checks write it (0000:3b:00.0, from NVML's 00000000:3B:00.0 too); anything else as is."""
    text = str(gpu).strip().lower()
    m = _PCI.match(text)
    if m is None:
        return text
    dom, bus, dev, fn = m.groups()
    return f"{int(dom or '0', 16):04x}:{bus}:{dev}.{fn}"


def _is_pci(gpu: str) -> bool:
    return _PCI.match(gpu) is not None


def uses_any(rank_gpus: frozenset[str], targets: set[str]) -> bool:
    """Whether a rank may use one of `targets`; when the two cannot be compared (index vs PCI) it may."""
    if not rank_gpus or rank_gpus & targets:
        return True
    # An index names a GPU only inside the rank's CUDA_VISIBLE_DEVICES: it proves nothing against a PCI address,
    # and a missed signal hangs the job while a spurious one costs one re-execution.
    return not (all(map(_is_pci, rank_gpus)) and all(map(_is_pci, targets)))


# -- the server -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RankInfo:
    """One registered rank, as it declared itself, with the last state it reported."""

    rank: int
    local_rank: int
    pid: int
    job_id: str
    gpus: frozenset[str] = frozenset()
    state: str | None = None
    state_generation: int | None = None


@dataclass(eq=False, slots=True)
class _Conn:
    sock: socket.socket
    reader: FrameReader = field(default_factory=FrameReader)
    out: bytearray = field(default_factory=bytearray)
    rank: RankInfo | None = None
    doomed: str | None = None  # why it must close; set by any thread, acted on by the server thread
    closed: bool = False


class RecoveryServer:
    """Unix stream socket server on one selector thread: rank registrations in, `fault` broadcasts out."""

    def __init__(self, path: str | os.PathLike[str], mode: int = 0o660, group: str | None = None,
                 on_report: Callable[[Finding], None] | None = None, *, dir_mode: int = 0o755,
                 max_buffer: int = MAX_BUFFER, generation: int | None = None):
        self.path = Path(path)
        self.mode = mode
        self.group = group
        self.dir_mode = dir_mode
        self.on_report = on_report
        self.max_buffer = max_buffer
        # Seeded from the clock so a restarted agent's faults are never below what ranks already acted on.
        self._generation = int(time.time() * 1000) if generation is None else generation
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._inode: int | None = None

    @classmethod
    def from_config(cls, config: RecoveryConfig, on_report: Callable[[Finding], None] | None = None) -> RecoveryServer:
        return cls(config.socket, config.mode, config.group, on_report, dir_mode=config.dir_mode)

    # -- public API ------------------------------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self._generation

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ranks(self) -> list[RankInfo]:
        """A snapshot of the live registered ranks."""
        with self._lock:
            return [c.rank for c in self._conns.values() if c.rank is not None and c.doomed is None]

    def start(self) -> None:
        """Create the directory and socket file, then serve on a daemon thread."""
        if self._thread is not None:
            raise RecoveryServerError("recovery server already started")
        self._prepare_path()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            self._inode = os.stat(self.path).st_ino
            # Permissions are set before listen(): until then nobody can connect, whatever the umask allowed.
            self._set_owner()
            listener.listen(64)
            listener.setblocking(False)
        except (OSError, RecoveryServerError):
            listener.close()
            self._unlink_own()
            raise
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve, name="recovery-server", daemon=True)
        self._thread.start()
        log.info("recovery socket listening on %s (mode %o%s)", self.path, self.mode,
                 f", group {self.group}" if self.group else "")

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection and the listener, and remove the socket file."""
        if self._thread is None:
            return
        self._stopping.set()
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("recovery server thread did not stop within %.1fs", timeout)
        self._thread = None
        self._close_all()

    def broadcast_fault(self, code: str, component: str, reason: str, gpus: set[str] | None = None) -> int:
        """Send the next generation's `fault` to every registered rank (or those using `gpus`); returns how many."""
        targets = None if gpus is None else {normalize_gpu(g) for g in gpus}
        with self._lock:
            self._generation += 1
            frame = encode({"type": "fault", "generation": self._generation, "code": code,
                            "component": component, "reason": reason})
            sent = sum(self._queue(c, frame) for c in self._conns.values()
                       if c.rank is not None and c.doomed is None
                       and (targets is None or uses_any(c.rank.gpus, targets)))
            generation = self._generation
        self._wake()
        log.info("recovery: signalled %d rank(s) with fault generation %d (%s on %s)", sent, generation, code,
                 component)
        return sent

    # -- setup -----------------------------------------------------------------------------------------------------
    def _prepare_path(self) -> None:
        directory = self.path.parent
        if not directory.exists():
            directory.mkdir(parents=True, exist_ok=True)
            os.chmod(directory, self.dir_mode)  # mkdir's mode is filtered by the umask
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise RecoveryServerError(f"{self.path} exists and is not a socket; refusing to replace it")
        if _answers(self.path):
            raise RecoveryServerError(f"another recovery server is live on {self.path}")
        log.info("removing stale recovery socket %s", self.path)
        self.path.unlink(missing_ok=True)

    def _set_owner(self) -> None:
        os.chmod(self.path, self.mode)
        if self.group is None:
            return
        try:
            gid = int(self.group) if self.group.isdigit() else grp.getgrnam(self.group).gr_gid
            os.chown(self.path, -1, gid)
        except (KeyError, OSError) as exc:
            raise RecoveryServerError(f"cannot give {self.path} to group {self.group!r}: {exc}") from None

    # -- the loop (server thread only) ------------------------------------------------------------------------------
    def _serve(self) -> None:
        assert self._selector is not None
        while not self._stopping.is_set():
            for key, events in self._selector.select(timeout=1.0):
                try:
                    self._dispatch(key, events)
                except Exception:  # a bug in one connection's handling must not end the server
                    log.exception("recovery server: error handling %s", key.data)
                    if isinstance(key.data, _Conn):
                        self._close(key.data)
            self._service()

    def _dispatch(self, key: selectors.SelectorKey, events: int) -> None:
        if key.data == "accept":
            self._accept()
        elif key.data == "wake":
            self._drain_wake()
        else:
            conn: _Conn = key.data
            if events & selectors.EVENT_READ:
                self._read(conn)
            if events & selectors.EVENT_WRITE and not conn.closed and conn.doomed is None:
                self._flush(conn)

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: keep serving who is already connected
                log.warning("recovery server: accept failed: %s", exc)
                return
            sock.setblocking(False)
            conn = _Conn(sock)
            with self._lock:
                self._conns[id(conn)] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._close(conn, f"receive failed: {exc}")
        if not data:
            return self._close(conn)
        try:
            messages = conn.reader.feed(data)
        except FrameError as exc:
            log.warning("recovery server: closing %s: %s", _who(conn), exc)
            return self._close(conn)
        for message in messages:
            try:
                self._handle(conn, message)
            except FrameError as exc:
                log.warning("recovery server: closing %s: %s", _who(conn), exc)
                return self._close(conn)

    def _handle(self, conn: _Conn, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "register":
            self._register(conn, message)
        elif kind == "report":
            self._report(conn, message)
        elif kind == "state":
            self._state(conn, message)
        else:
            log.debug("recovery server: ignoring %r message from %s", kind, _who(conn))

    def _register(self, conn: _Conn, message: dict[str, Any]) -> None:
        info = parse_register(message)
        with self._lock:
            conn.rank = info
            self._queue(conn, encode({"type": "registered", "generation": self._generation}))
        log.info("recovery: rank %d (local %d, pid %d) of job %s registered, GPUs %s", info.rank, info.local_rank,
                 info.pid, info.job_id, ", ".join(sorted(info.gpus)) or "undeclared")

    def _report(self, conn: _Conn, message: dict[str, Any]) -> None:
        finding = report_finding(message, conn.rank)
        log.warning("recovery: %s", finding.message)
        if self.on_report is None:
            return
        try:
            self.on_report(finding)
        except Exception:
            log.exception("recovery server: on_report failed for %s", finding.component)

    def _state(self, conn: _Conn, message: dict[str, Any]) -> None:
        state, gen = message.get("state"), message.get("generation")
        if not isinstance(state, str) or not _is_int(gen):
            raise FrameError("state message needs a string state and an integer generation")
        with self._lock:
            if conn.rank is not None:
                conn.rank = replace(conn.rank, state=state, state_generation=gen)

    def _service(self) -> None:
        """Close connections marked for closing and start writing whatever broadcasts queued."""
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            if conn.doomed is not None:
                self._close(conn, conn.doomed)
            elif conn.out:
                self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        assert self._selector is not None
        with self._lock:
            try:
                n = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                conn.doomed = f"send failed: {exc}"
                return
            del conn.out[:n]
            pending = bool(conn.out)
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0)
        if self._selector.get_key(conn.sock).events != events:
            self._selector.modify(conn.sock, events, conn)

    def _queue(self, conn: _Conn, frame: bytes) -> bool:
        """Append a frame to a connection's buffer (lock held); a reader too far behind is marked for closing."""
        if len(conn.out) + len(frame) > self.max_buffer:
            conn.doomed = f"reader {len(conn.out)} bytes behind"
            return False
        conn.out += frame
        return True

    def _close(self, conn: _Conn, why: str | None = None) -> None:
        if why:
            log.warning("recovery server: dropping %s: %s", _who(conn), why)
        if conn.closed:
            return
        conn.closed = True
        with self._lock:
            self._conns.pop(id(conn), None)
        if conn.rank is not None:
            log.info("recovery: rank %d of job %s left", conn.rank.rank, conn.rank.job_id)
        if self._selector is not None:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.sock.close()

    # -- wake-up and teardown --------------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._wake_w is None:
            return
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # a wake-up already pending is enough
            pass

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _close_all(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            self._close(conn)
        for s in (self._listener, self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if self._selector is not None:
            self._selector.close()
        self._listener = self._wake_r = self._wake_w = self._selector = None
        self._unlink_own()

    def _unlink_own(self) -> None:
        """Remove the socket file unless another server has replaced it since."""
        try:
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass
        self._inode = None


# -- message parsing ------------------------------------------------------------------------------------------------

def parse_register(message: dict[str, Any]) -> RankInfo:
    """Validate a `register` message; a malformed one is a FrameError (the connection closes)."""
    ints = {k: message.get(k) for k in ("rank", "local_rank", "pid")}
    bad = [k for k, v in ints.items() if not _is_int(v)]
    job, gpus = message.get("job_id"), message.get("gpus", [])
    if not isinstance(job, str):
        bad.append("job_id")
    if not isinstance(gpus, list) or not all(isinstance(g, (str, int)) and not isinstance(g, bool) for g in gpus):
        bad.append("gpus")
    if bad:
        raise FrameError(f"register message with missing or invalid {', '.join(bad)}")
    return RankInfo(ints["rank"], ints["local_rank"], ints["pid"], job,  # type: ignore[arg-type]
                    frozenset(normalize_gpu(g) for g in gpus))


def report_finding(message: dict[str, Any], rank: RankInfo | None) -> Finding:
    """A rank's `report` as a finding: component rank:<job>:<rank> unless the rank named one."""
    job = rank.job_id if rank is not None else str(message.get("job_id", "unknown"))
    number = message.get("rank", rank.rank if rank is not None else "?")
    component = message.get("component")
    if not isinstance(component, str) or not component:
        component = f"rank:{job}:{number}"
    error = str(message.get("error", "unspecified error"))
    evidence = dict(message)
    evidence.setdefault("job_id", job)
    if rank is not None:
        evidence.setdefault("pid", rank.pid)
    return Finding(check=REPORT_CHECK, component=component, code=REPORT_CODE,
                   message=f"rank {number} of job {job} reported: {error}", severity=Severity.ERROR,
                   evidence=evidence)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _who(conn: _Conn) -> str:
    r = conn.rank
    return f"rank {r.rank} of job {r.job_id} (pid {r.pid})" if r is not None else "an unregistered client"


def _answers(path: Path) -> bool:
    """Whether a live server accepts connections on the socket file."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        # Anything else (a full backlog, a timeout) means something is there: do not take its socket away.
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()
