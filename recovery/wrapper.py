"""The re-executable code block: Wrapper / @recoverable, the fault handler and the re-execution loop.

Life of a fault in generation N (the block's `ctx.iteration`):
  1. Seen: the block raised (local), the node agent sent `fault` (agent), another rank recorded
     `<prefix>/fault/N` in the store (store, polled by the monitor thread), or no progress for soft_timeout_s.
  2. The fault-handler thread records it under `<prefix>/fault/N` (first writer wins) so every rank sees it, reports
     local faults to the agent, waits until the block is outside every `ctx.atomic()` section, injects FaultInterrupt
     into the block's thread (PyThreadState_SetAsyncExc), aborts the process groups off that thread with a time limit
     (which releases a collective the block is blocked in), and re-injects until the block's thread acknowledges --
     unless the injected exception was already raised (then never again: it is delivered once).
  3. The block's thread leaves the block (FaultInterrupt or whatever its collective raised), acknowledges (clearing any
     injection not raised yet), waits for the abort, runs finalize, the health check (failing: exit with the restart
     code), and the store barrier of generation N+1; then calls the block again with iteration N+1.
  Past hard_timeout_s from the fault without the block running again, the process exits with the restart code
  (default 75, EX_TEMPFAIL) so the launcher restarts processes instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from . import store as storelib
from .client import AgentClient, default_socket_path
from .torch_support import abort_torch_distributed, cuda_health_check, run_with_limit

log = logging.getLogger("nodemedic.recovery")

RESTART_EXIT_CODE = 75  # EX_TEMPFAIL: "try again" -- the launcher should restart the processes
_IDLE, _RUNNING, _RECOVERING = "idle", "running", "recovering"


class FaultInterrupt(BaseException):
    """Raised inside the block when a fault is delivered. A BaseException, so `except Exception` does not eat it."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        wrapper = _ACTIVE.get(threading.get_ident())
        if wrapper is not None:  # instantiated in the block's thread: the injection was raised
            wrapper._delivered = True
            wrapper.deliveries += 1


class RestartLimitExceeded(RuntimeError):
    """The block faulted more than max_restarts times."""


# The block's thread id -> its Wrapper, for FaultInterrupt.__init__ and the unraisable hook.
_ACTIVE: dict[int, Wrapper] = {}
_hook_lock = threading.Lock()
_previous_unraisablehook: Callable | None = None


def _unraisablehook(unraisable: Any) -> None:
    # An injection raised where Python cannot propagate it (a __del__, a weakref callback) is lost: deliver again.
    if isinstance(unraisable.exc_value, FaultInterrupt) or unraisable.exc_type is FaultInterrupt:
        wrapper = _ACTIVE.get(threading.get_ident())
        if wrapper is not None:
            wrapper._delivered = False
            return
    (_previous_unraisablehook or sys.__unraisablehook__)(unraisable)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                                      ctypes.py_object(exc) if exc is not None else None)


@dataclass
class Fault:
    iteration: int
    source: str                       # local | agent | store | soft_timeout
    reason: str
    rank: int | None = None           # the rank that saw it first
    code: str = ""
    component: str | None = None
    agent_generation: int | None = None
    host: str = ""
    at: float = field(default_factory=time.time)
    detected: float = field(default_factory=time.monotonic, repr=False)
    aborted: threading.Event = field(default_factory=threading.Event, repr=False)
    recovered: threading.Event = field(default_factory=threading.Event, repr=False)

    def to_json(self) -> str:
        keep = ("source", "reason", "rank", "code", "component", "agent_generation", "host", "at")
        return json.dumps({k: getattr(self, k) for k in keep})

    @classmethod
    def from_store(cls, payload: str, iteration: int) -> Fault:
        try:
            data = json.loads(payload)
        except ValueError:
            data = {"reason": payload}
        return cls(iteration=iteration, source="store", reason=str(data.get("reason", "")), rank=data.get("rank"),
                   code=data.get("code") or "", component=data.get("component"),
                   agent_generation=data.get("agent_generation"), host=data.get("host") or "",
                   at=data.get("at") or time.time())


class Context:
    """What the block gets: where it is, and the hooks it calls. A new one per generation."""

    def __init__(self, wrapper: Wrapper, iteration: int, rank: int, world_size: int, fault: Fault | None):
        self._wrapper = wrapper
        self.iteration = iteration            # the restart generation: 0 on the first call
        self.rank = rank                      # this generation's rank (renumbered after a shrink)
        self.world_size = world_size
        self.local_rank = wrapper.local_rank
        self.initial_rank = wrapper.initial_rank
        self.initial_world_size = wrapper.initial_world_size
        self.fault = fault                    # the fault that ended the previous generation (None at first)
        self.store = wrapper.store

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """A section a fault is never delivered inside (an optimizer step); delivery waits until it exits."""
        return self._wrapper._atomic()

    def heartbeat(self) -> None:
        """Progress mark for the soft timeout (leaving an atomic section counts too)."""
        self._wrapper._last_progress = time.monotonic()

    def init_process_group(self, backend: str = "gloo", **kwargs: Any) -> None:
        """torch.distributed.init_process_group for this generation: rank, world size and a rendezvous under
        `<prefix>/pg/<iteration>` in the wrapper's store."""
        import torch.distributed as dist

        if self.store is None:
            raise RuntimeError("Context.init_process_group needs the Wrapper's store")
        store = dist.PrefixStore(f"{self._wrapper.key_prefix}/pg/{self.iteration}", self.store)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, **kwargs)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


class Wrapper:
    """Marks a re-executable block: `Wrapper(...)(fn)` returns a function that calls `fn(ctx, *args, **kwargs)` until
    it returns. See the module docstring for the fault path and README-style notes in the package docstring."""

    def __init__(self, *, health_check: Callable[[Context], Any] | None = cuda_health_check,
                 abort: Callable[[Context], Any] | None = abort_torch_distributed,
                 finalize: Callable[[Context], Any] | None = None,
                 max_restarts: int | None = 3,
                 soft_timeout_s: float | None = None, hard_timeout_s: float = 60.0,
                 store: Any = None, socket_path: str | None | bool = None,
                 restart_exit_code: int = RESTART_EXIT_CODE,
                 rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
                 job_id: str | None = None, gpus: list[str] | None = None,
                 barrier_timeout_s: float = 30.0, shrink: bool = False, min_world_size: int = 1,
                 abort_timeout_s: float = 5.0, poll_interval_s: float = 0.005, key_prefix: str = "nodemedic",
                 exit_fn: Callable[[int], Any] = os._exit):
        self.health_check, self.abort, self.finalize = health_check, abort, finalize
        self.max_restarts = max_restarts
        self.soft_timeout_s, self.hard_timeout_s = soft_timeout_s, hard_timeout_s
        self.store = store
        self.socket_path = default_socket_path() if socket_path is None or socket_path is True else socket_path
        self.restart_exit_code = restart_exit_code
        self.initial_rank = _env_int("RANK", 0) if rank is None else rank
        self.initial_world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
        self.local_rank = _env_int("LOCAL_RANK", 0) if local_rank is None else local_rank
        self.job_id, self.gpus = job_id, gpus
        self.barrier_timeout_s, self.shrink, self.min_world_size = barrier_timeout_s, shrink, min_world_size
        self.abort_timeout_s, self.poll_interval_s, self.key_prefix = abort_timeout_s, poll_interval_s, key_prefix
        self.exit_fn = exit_fn
        self.client: AgentClient | None = None
        self.faults: list[Fault] = []         # every fault acted on, oldest first
        self.deliveries = 0                   # FaultInterrupts raised in the block (at most one per fault)
        self._cond = threading.Condition(threading.RLock())
        self._state = _IDLE
        self._iteration = 0
        self._rank = self.initial_rank
        self._ctx: Context | None = None
        self._fault: Fault | None = None
        self._pending_agent: Fault | None = None
        self._acked = self._delivered = self._injected = False
        self._atomic_depth = 0
        self._last_progress = time.monotonic()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._board: Any = None               # the store the runtime's threads use (own TCPStore client if possible)
        self._tid = 0
        self._host = socket.gethostname()

    # -- public entry ------------------------------------------------------------------------------------------------

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return self._run(fn, args, kwargs)

        return wrapped

    # -- the block's thread ------------------------------------------------------------------------------------------

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._state != _IDLE:
            raise RuntimeError("this Wrapper is already running a block")
        self._setup()
        try:
            iteration, rank, world, previous = 0, self.initial_rank, self.initial_world_size, None
            while True:
                ctx = Context(self, iteration, rank, world, previous)
                self._begin(ctx)
                error: BaseException | None = None
                try:
                    result = fn(ctx, *args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - every exit of the block is judged below
                    error = exc
                while True:  # an injection raised between the block's exit and the acknowledgement lands here
                    try:
                        fault = self._acknowledge(error)
                        break
                    except FaultInterrupt as late:
                        error = error or late
                if fault is None:
                    if error is not None:
                        raise error
                    return result
                iteration += 1
                if self.max_restarts is not None and iteration > self.max_restarts:
                    fault.recovered.set()
                    raise RestartLimitExceeded(f"fault after {self.max_restarts} restarts: {fault.reason}") from error
                del error
                rank, world = self._recover(ctx, fault, iteration)
                previous = fault
        finally:
            self._teardown()

    def _begin(self, ctx: Context) -> None:
        with self._cond:
            previous = self._fault
            self._ctx, self._iteration, self._rank = ctx, ctx.iteration, ctx.rank
            self._fault = None
            self._acked = self._delivered = self._injected = False
            self._atomic_depth = 0
            self._last_progress = time.monotonic()
            self._state = _RUNNING
            pending, self._pending_agent = self._pending_agent, None
        if previous is not None:
            previous.recovered.set()
        if pending is not None:  # an agent fault that arrived while recovering: it applies to this generation
            pending.iteration = ctx.iteration
            self._raise_fault(pending)

    def _acknowledge(self, error: BaseException | None) -> Fault | None:
        with self._cond:
            self._state = _RECOVERING
            self._acked = True
            if self._injected:
                _set_async_exc(self._tid, None)  # an injection not raised yet is dropped: delivered at most once
            self._cond.notify_all()
            fault = self._fault
            if fault is None and isinstance(error, Exception):
                fault = self._fault = Fault(self._iteration, "local", f"{type(error).__name__}: {error}",
                                            rank=self._rank, host=self._host)
                self._start_handler(fault, inject=False)
            return fault

    def _recover(self, ctx: Context, fault: Fault, iteration: int) -> tuple[int, int]:
        self.faults.append(fault)
        log.warning("recovery: rank %d leaving generation %d: %s fault: %s", ctx.rank, ctx.iteration, fault.source,
                    fault.reason)
        fault.aborted.wait(self.abort_timeout_s + 1.0)
        if self.finalize is not None:
            try:
                self.finalize(ctx)
            except Exception as exc:
                self._exit(f"finalize failed: {exc!r}")
        try:
            healthy = self.health_check is None or self.health_check(ctx) is not False
        except Exception as exc:
            log.warning("recovery: health check raised %r", exc)
            healthy = False
        if not healthy:
            self._exit("health check failed")
        if self.client is not None:
            self.client.send_state("at_barrier")
        rank, world = ctx.rank, ctx.world_size
        if self._board is not None and ctx.world_size > 1:
            try:
                rank, world = storelib.barrier(self._board, self.key_prefix, iteration, ctx.rank, ctx.world_size,
                                               timeout_s=self.barrier_timeout_s, shrink=self.shrink,
                                               min_world_size=self.min_world_size)
            except (storelib.BarrierTimeout, storelib.Excluded) as exc:
                self._exit(str(exc))
            except Exception as exc:  # the store itself is gone
                self._exit(f"store barrier failed: {exc!r}")
        if self.client is not None:
            self.client.send_state("past_barrier")
        return rank, world

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        with self._cond:
            if self._state == _RUNNING and self._fault is not None and not self._acked:
                # a fault waits for delivery: deliver it here, synchronously, instead of entering the section
                if self._injected:
                    _set_async_exc(self._tid, None)
                    self._injected = False
                raise FaultInterrupt(self._fault.reason)
            self._atomic_depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._atomic_depth -= 1
                self._last_progress = time.monotonic()
                self._cond.notify_all()

    def _exit(self, why: str) -> None:
        log.error("recovery: rank %d exits with %d for a process restart: %s", self._rank, self.restart_exit_code, why)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        self.exit_fn(self.restart_exit_code)
        if threading.get_ident() == self._tid:
            raise SystemExit(self.restart_exit_code)

    # -- faults from other threads -----------------------------------------------------------------------------------

    def raise_fault(self, reason: str, source: str = "external") -> None:
        """Signal a fault from any thread (e.g. a user watchdog); same path as one from the agent."""
        with self._cond:
            fault = Fault(self._iteration, source, reason, rank=self._rank, host=self._host)
        self._raise_fault(fault)

    def _raise_fault(self, fault: Fault) -> bool:
        with self._cond:
            if self._state == _RUNNING and fault.iteration == self._iteration and self._fault is None:
                self._fault = fault
                self._start_handler(fault, inject=True)
                return True
            if self._state == _RECOVERING and fault.source == "agent":
                self._pending_agent = fault
            return False

    def _on_agent_fault(self, message: dict[str, Any]) -> None:
        with self._cond:
            fault = Fault(self._iteration, "agent", str(message.get("reason") or message.get("code") or "agent fault"),
                          rank=self._rank, code=str(message.get("code") or ""), component=message.get("component"),
                          agent_generation=message.get("generation"), host=self._host)
            if self._state == _IDLE:
                return
        self._raise_fault(fault)

    def _start_handler(self, fault: Fault, inject: bool) -> None:
        t = threading.Thread(target=self._handle, args=(fault, inject), name="nodemedic-fault-handler", daemon=True)
        self._threads.append(t)
        t.start()

    def _handle(self, fault: Fault, inject: bool) -> None:
        """The fault-handler thread: propagate, deliver, abort, watch the hard timeout."""
        deadline = fault.detected + self.hard_timeout_s
        if self._board is not None and fault.source != "store":
            try:
                storelib.publish_fault(self._board, self.key_prefix, fault.iteration, fault.to_json())
            except Exception as exc:
                log.warning("recovery: cannot record the fault in the store: %r", exc)
        if self.client is not None and fault.source in ("local", "soft_timeout"):
            self.client.report(fault.reason)
        if inject:
            with self._cond:  # the atomic lock: wait for the block to leave every atomic section
                while self._atomic_depth > 0 and not self._acked and time.monotonic() < deadline:
                    self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                if not self._acked:
                    if self._atomic_depth > 0:
                        return self._exit("an atomic section outlived the hard timeout")
                    self._inject()
        ok = run_with_limit(lambda: self.abort(self._ctx), self.abort_timeout_s, "abort") if self.abort else True
        fault.aborted.set()
        if not ok:
            log.warning("recovery: abort did not finish within %.1f s", self.abort_timeout_s)
        while not fault.recovered.wait(0.02):
            if self._stop.is_set():
                return
            with self._cond:
                if inject and not self._acked and not self._delivered and self._atomic_depth == 0:
                    self._inject()  # replaces an injection still pending; never a second one raised
            if time.monotonic() >= deadline:
                return self._exit(f"not recovered within the hard timeout of {self.hard_timeout_s:g} s "
                                  f"({fault.source} fault: {fault.reason})")

    def _inject(self) -> None:
        # called with self._cond held
        self._injected = True
        _set_async_exc(self._tid, FaultInterrupt)

    def _monitor(self) -> None:
        """Polls the store for this generation's fault key and watches the soft timeout."""
        failures = 0
        while not self._stop.wait(self.poll_interval_s):
            with self._cond:
                if self._state != _RUNNING or self._fault is not None:
                    continue
                iteration = self._iteration
            if self._board is not None:
                try:
                    payload = storelib.read_fault(self._board, self.key_prefix, iteration)
                    failures = 0
                except Exception as exc:
                    failures += 1
                    if failures == 1:
                        log.warning("recovery: store poll failed: %r", exc)
                    payload = None
                if payload is not None:
                    fault = Fault.from_store(payload, iteration)
                    if (fault.agent_generation is not None and fault.host == self._host
                            and self.client is not None):
                        self.client.observe_generation(fault.agent_generation)
                    self._raise_fault(fault)
                    continue
            if self.soft_timeout_s is not None and time.monotonic() - self._last_progress > self.soft_timeout_s:
                self._raise_fault(Fault(iteration, "soft_timeout",
                                        f"no progress for {self.soft_timeout_s:g} s", rank=self._rank,
                                        host=self._host))

    # -- set-up and teardown -----------------------------------------------------------------------------------------

    def _setup(self) -> None:
        global _previous_unraisablehook
        self._tid = threading.get_ident()
        self._stop.clear()
        self._board = _private_client(self.store)
        with _hook_lock:
            if not _ACTIVE:
                _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, _unraisablehook
            _ACTIVE[self._tid] = self
        if self.socket_path:
            self.client = AgentClient(self.socket_path, rank=self.initial_rank, local_rank=self.local_rank,
                                      on_fault=self._on_agent_fault, job_id=self.job_id, gpus=self.gpus).start()
        t = threading.Thread(target=self._monitor, name="nodemedic-recovery-monitor", daemon=True)
        self._threads.append(t)
        t.start()

    def _teardown(self) -> None:
        global _previous_unraisablehook
        with self._cond:
            self._state = _IDLE
            if self._fault is not None:
                self._fault.recovered.set()
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(self.abort_timeout_s + 1.0)
        self._threads.clear()
        if self.client is not None:
            self.client.stop()
        self._board = None
        with _hook_lock:
            _ACTIVE.pop(self._tid, None)
            if not _ACTIVE and sys.unraisablehook is _unraisablehook:
                sys.unraisablehook = _previous_unraisablehook or sys.__unraisablehook__
                _previous_unraisablehook = None


def _private_client(store: Any) -> Any:
    """The runtime's own connection to a TCPStore, so its polling never queues behind a blocking call the training
    code makes on the shared one; any other store is used as given."""
    if store is None:
        return None
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(store, dist.TCPStore):
        import datetime

        try:
            return dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=30))
        except Exception as exc:  # pragma: no cover
            log.warning("recovery: no private store connection (%r); sharing the job's", exc)
    return store


def recoverable(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """`@recoverable` or `@recoverable(store=..., max_restarts=...)`: Wrapper(**options)(fn)."""
    if fn is not None:
        return Wrapper(**options)(fn)
    return lambda f: Wrapper(**options)(f)
