"""The rank side of the node-agent socket (protocol.py): register, receive `fault`, report, reconnect.

Stdlib only. One background thread owns the connection; `report()` and `send_state()` may be called from any thread.
A missing agent is not an error: the thread keeps trying to connect with exponential backoff, and reports made while
disconnected are queued (a few) and sent after the next registration.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
from typing import Any, Callable

from .protocol import DEFAULT_SOCKET, SOCKET_ENV, FrameError, FrameReader, encode

log = logging.getLogger("nodemedic.recovery")

MAX_QUEUED = 32


def default_socket_path() -> str:
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def default_job_id() -> str:
    for name in ("SLURM_JOB_ID", "NODEMEDIC_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return ""


def default_gpus() -> list[str]:
    """GPUs this rank may use, as the agent accepts them: NODEMEDIC_GPUS (comma list of PCI addresses or indices),
    else CUDA_VISIBLE_DEVICES; empty (= undeclared: the rank gets every fault of the node) otherwise."""
    for name in ("NODEMEDIC_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = os.environ.get(name, "").strip()
        if value:
            return [g.strip() for g in value.split(",") if g.strip()]
    return []


class AgentClient:
    """Connection to the node agent. `on_fault(message)` runs on the client thread for each fresh `fault`.

    Generations: the agent's `registered` reply sets the baseline (faults at or below it happened before this rank
    registered); a `fault` at or below the last generation acted on is stale and dropped (`stale_dropped` counts them).
    """

    def __init__(self, path: str | None = None, *, rank: int, local_rank: int, on_fault: Callable[[dict], None],
                 job_id: str | None = None, gpus: list[str] | None = None, pid: int | None = None,
                 backoff_initial_s: float = 0.05, backoff_max_s: float = 2.0):
        self.path = path or default_socket_path()
        self.rank, self.local_rank = rank, local_rank
        self.job_id = default_job_id() if job_id is None else job_id
        self.gpus = default_gpus() if gpus is None else [str(g) for g in gpus]
        self.pid = os.getpid() if pid is None else pid
        self._on_fault = on_fault
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._queue: collections.deque[dict] = collections.deque(maxlen=MAX_QUEUED)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.generation: int | None = None    # last agent generation acted on (or the registration baseline)
        self.registered = threading.Event()   # set while registered, cleared on disconnect
        self.registrations = 0                # how many times this client registered (reconnects + 1)
        self.stale_dropped = 0

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self) -> AgentClient:
        self._thread = threading.Thread(target=self._run, name="nodemedic-recovery-client", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._close()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- sending -----------------------------------------------------------------------------------------------------

    def report(self, error: str, component: str | None = None) -> None:
        """Tell the agent this rank hit a fault (becomes a finding there). Queued while disconnected."""
        self._send({"type": "report", "rank": self.rank, "generation": self.generation or 0,
                    "error": error[:2000], "component": component}, queue=True)

    def send_state(self, state: str) -> None:
        """`at_barrier` / `past_barrier`, best effort (not queued: a stale state is worse than none)."""
        self._send({"type": "state", "rank": self.rank, "generation": self.generation or 0, "state": state})

    def observe_generation(self, generation: int) -> None:
        """A fault of this agent's `generation` was acted on by another route (the job's store): drop it here."""
        with self._lock:
            if self.generation is None or generation > self.generation:
                self.generation = generation

    def _send(self, message: dict[str, Any], queue: bool = False) -> bool:
        sock = self._sock
        if sock is not None and self.registered.is_set():
            try:
                with self._send_lock:
                    sock.sendall(encode(message))
                return True
            except OSError:
                self._close()
        if queue:
            self._queue.append(message)
        return False

    # -- the connection thread ---------------------------------------------------------------------------------------

    def _close(self) -> None:
        self.registered.clear()
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _run(self) -> None:
        delay = self._backoff[0]
        while not self._stop.is_set():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(1.0)
                sock.connect(self.path)
            except OSError:
                sock.close()
                if self._stop.wait(delay):
                    return
                delay = min(delay * 2, self._backoff[1])
                continue
            delay = self._backoff[0]
            self._sock = sock
            try:
                self._serve(sock)
            except (OSError, FrameError) as exc:
                log.debug("recovery client: connection to %s lost: %s", self.path, exc)
            finally:
                if self._sock is sock:
                    self._close()
                else:
                    sock.close()
            if self._stop.wait(self._backoff[0]):
                return

    def _serve(self, sock: socket.socket) -> None:
        with self._send_lock:
            sock.sendall(encode({"type": "register", "rank": self.rank, "local_rank": self.local_rank,
                                 "pid": self.pid, "job_id": self.job_id, "gpus": self.gpus}))
        reader = FrameReader()
        sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data = sock.recv(65536)
            except socket.timeout:
                continue
            if not data:
                return
            for message in reader.feed(data):
                self._handle(message, sock)

    def _handle(self, message: dict[str, Any], sock: socket.socket) -> None:
        kind = message["type"]
        gen = message.get("generation")
        if kind == "registered" and isinstance(gen, int):
            with self._lock:
                # the agent's current generation is the baseline: older faults are not ours. A lower one than we
                # acted on means the agent lost its state; follow it, or every later fault would look stale.
                self.generation = gen
            self.registrations += 1
            self.registered.set()
            while self._queue:
                message = self._queue.popleft()
                with self._send_lock:
                    sock.sendall(encode(message))
        elif kind == "fault" and isinstance(gen, int):
            with self._lock:
                fresh = self.generation is None or gen > self.generation
                if fresh:
                    self.generation = gen
                else:
                    self.stale_dropped += 1
            if fresh:
                try:
                    self._on_fault(message)
                except Exception:  # never let a callback kill the connection thread
                    log.exception("recovery client: fault callback failed")
            else:
                log.debug("recovery client: dropped stale fault generation %s", gen)
