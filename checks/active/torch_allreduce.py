"""Built-in all-reduce bandwidth test on torch.distributed, standing in for nccl-tests' `all_reduce_perf`.

NCCL on GPUs, gloo on CPU. Rank 0 prints nccl-tests' layout (header, rank lines, size table, footer) so that
`nccl.parse_allreduce` and `nccl.judge` apply unchanged. `--nproc N` launches N local ranks; without it the process
is one rank of a job started by torchrun/srun (RANK/WORLD_SIZE/LOCAL_RANK, else SLURM_PROCID/NTASKS/LOCALID).
torch is imported only inside the worker: the agent imports this module cheaply and torch is an optional extra.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

from nodemedic.checks.active import nccl
from nodemedic.checks.active.base import DeepCheckResult, Status, tail, unavailable_status
from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import run_tool

MODULE = "nodemedic.checks.active.torch_allreduce"
SCRIPT = "torch_allreduce.py"  # the file named in failure lines, as nccl-tests names common.cu

EXIT_WRONG = 1       # wrong values found: nccl-tests' EXIT_FAILURE
EXIT_ERROR = 3       # the test could not run (rendezvous, a dead rank, an exception)
EXIT_NO_TORCH = 4    # torch is not installed for this interpreter: the check is skipped
EXIT_TIMEOUT = 124   # the deadline passed (like timeout(1))
EXIT_TERM = 143      # the launcher was terminated
EXIT_FAULT = 86      # the test-only "exit" fault: a rank that dies mid-run without a word

# Test-only fault injection, "<hang|exit|wrong>:<rank>": a rank hangs before its first collective, dies mid-run,
# or corrupts one reduced value. Deliberately not NODEMEDIC_*: it is no agent setting.
FAULT_ENV = "ALLREDUCE_TEST_FAULT"

RANK_EXIT_GRACE_S = 3.0   # after one rank fails, how long the others get to finish on their own
KILL_GRACE_S = 3.0        # SIGTERM, then SIGKILL after this long
WATCHDOG_SLACK_S = 10.0   # a worker's own deadline trails the launcher's, so the launcher reports first
PATTERN_PERIOD = 64       # element i of rank r holds (i % 64) + r + 1: integers, exact in float32 up to ~5000 ranks

INFO_BYTES = 512          # room for one rank's JSON host/pid/device description

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_BACKEND_LINE = re.compile(r"^#\s*torch\.distributed\.all_reduce backend (\w+)", re.MULTILINE)


def parse_size(text: str) -> int:
    """nccl-tests' size syntax: bytes, or a K/M/G suffix in powers of 1024 ("1M" -> 1048576)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"bad size {text!r} (expected e.g. 4096, 64K, 1M, 2G)")
    return int(m[1]) * _UNITS[m[2].upper()]


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """The sizes nccl-tests' `-b MIN -e MAX -f FACTOR` visits, each rounded down to whole float32 elements."""
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size // 4 * 4)
        size *= factor
    return out


def torch_available() -> bool:
    """Whether torch can be imported here, without importing it (that costs seconds and hundreds of MB)."""
    return importlib.util.find_spec("torch") is not None


def _failure(message: str, host: str | None = None, stream: Any = None) -> None:
    """Print a failure line in nccl-tests' form, which `nccl._FAILURE` recognises, naming the caller's line."""
    frame = inspect.currentframe()
    line = frame.f_back.f_lineno if frame is not None and frame.f_back is not None else 0
    text = " ".join(message.split())[:300].replace("'", '"')
    print(f"{host or _hostname()}: Test failure {SCRIPT}:{line} '{text}'", file=stream or sys.stdout, flush=True)


def _hostname() -> str:
    # nccl-tests prints the host name up to the first dot.
    return (socket.gethostname().split(".")[0] or "localhost").replace(" ", "_")


# -- who am I -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ranking:
    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def ranking(environ: Mapping[str, str], master_addr: str | None = None,
            master_port: int | None = None) -> Ranking:
    """Rank, world and local rank from torchrun-style variables, else Slurm's; master from the flags, else env."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_RANK", environ.get("SLURM_LOCALID", "0")))
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        rank, world = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
        local = int(environ.get("SLURM_LOCALID", "0"))
    else:
        rank, world, local = 0, 1, 0
    addr = master_addr or environ.get("MASTER_ADDR") or ("127.0.0.1" if world == 1 else None)
    if addr is None:
        raise ValueError(f"rank {rank} of {world}: no master address (pass --master-addr or set MASTER_ADDR)")
    port = master_port or int(environ.get("MASTER_PORT", "29500"))
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    return Ranking(rank, world, local, addr, port)


# -- output in nccl-tests' layout ---------------------------------------------------------------------------------

def _float_str(value: float, digits: int = 7) -> str:
    """nccl-tests' getFloatStr: as many decimals as fit the column."""
    power, bound = 0, 1
    while value >= bound and power < 30:
        power, bound = power + 1, bound * 10
    if power < digits - 2:
        return f"{value:.2f}"
    if power < digits - 1:
        return f"{value:.1f}"
    if power < digits:
        return f"{value:.0f}"
    return f"{value:.1e}"


def _bw_str(value: float) -> str:
    # Slow (CPU) paths would print 0.00 in nccl-tests' %6.2f; keep significant digits instead.
    return f"{value:6.2f}" if value >= 0.1 or value == 0 else f"{value:6.4f}"


@dataclass(frozen=True)
class Half:
    """One side (out-of-place or in-place) of a table row."""

    time_us: float
    algbw: float
    busbw: float
    wrong: int | None


def bandwidth(size: int, time_us: float, world: int) -> tuple[float, float]:
    """algbw = bytes / time and busbw = algbw * 2(n-1)/n, in GB/s (1e9 bytes per second)."""
    algbw = size / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0
    return algbw, algbw * 2 * (world - 1) / world


def format_row(size: int, oop: Half, ip: Half) -> str:
    def half(h: Half) -> str:
        wrong = "N/A" if h.wrong is None else str(h.wrong)
        return f"  {_float_str(h.time_us):>7}  {_bw_str(h.algbw)}  {_bw_str(h.busbw)}  {wrong:>5}"
    return f"{size:12d}  {size // 4:12d}  {'float':>8}  {'sum':>6}  {-1:6d}{half(oop)}{half(ip)}"


def format_header(min_bytes: int, max_bytes: int, factor: int, warmup: int, iters: int, check: bool) -> list[str]:
    return [f"# nThread 1 nGpus 1 minBytes {min_bytes} maxBytes {max_bytes} step: {factor}(factor) "
            f"warmup iters: {warmup} iters: {iters} agg iters: 1 validation: {int(check)} graph: 0", "#"]


def format_rank(rank: int, info: dict[str, Any]) -> str:
    return (f"#  Rank {rank:2d} Group  0 Pid {info['pid']:6d} on {info['host']:>10} device {info['device']:2d} "
            f"[{info['bus']}] {info['name']}")


TABLE_HEAD = [
    "#",
    "#                                                              out-of-place                       in-place",
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw"
    " #wrong",
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)",
]


def format_footer(wrong: int, avg_busbw: float) -> list[str]:
    return [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
            f"# Avg bus bandwidth    : {avg_busbw:g}", "#"]


# -- one rank -----------------------------------------------------------------------------------------------------

def _fault(rank: int) -> str | None:
    kind, _, who = os.environ.get(FAULT_ENV, "").partition(":")
    return kind if who.strip() == str(rank) and kind in ("hang", "exit", "wrong") else None


def _device_info(torch: Any, backend: str, local_rank: int) -> dict[str, Any]:
    info: dict[str, Any] = {"host": _hostname(), "pid": os.getpid()}
    if backend == "nccl":
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        info.update(device=index, bus=f"0x{bus:02x}" if isinstance(bus, int) else "gpu", name=props.name)
    else:
        info.update(device=local_rank, bus="cpu", name=f"{backend} cpu")
    return info


class _Worker:
    """One rank's measurements; collective calls in the same order on every rank."""

    def __init__(self, torch: Any, dist: Any, ranking_: Ranking, device: Any, fault: str | None):
        self.torch, self.dist, self.r, self.device, self.fault = torch, dist, ranking_, device, fault
        self.cuda = device.type == "cuda"

    def barrier(self) -> None:
        if self.cuda:  # NCCL's barrier otherwise guesses the device from the rank number
            self.dist.barrier(device_ids=[self.device.index])
        else:
            self.dist.barrier()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def timed(self, op: Callable[[], None], warmup: int, iters: int) -> float:
        """Mean microseconds per op, averaged over ranks as nccl-tests does by default."""
        for _ in range(warmup):
            op()
        self.sync()
        self.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            op()
        self.sync()
        elapsed = self.torch.tensor([(time.perf_counter() - start) / max(iters, 1) * 1e6], dtype=self.torch.float64,
                                    device=self.device)
        self.dist.all_reduce(elapsed)
        return float(elapsed.item()) / self.r.world

    def count_wrong(self, result: Any, send: Any) -> Any:
        # send - (rank+1) recovers i % 64, so the expected sum needs no extra buffer kept around.
        world = self.r.world
        expected = (send - (self.r.rank + 1)).mul_(world).add_(world * (world + 1) // 2)
        return self.torch.count_nonzero(result != expected)

    def measure(self, size: int, warmup: int, iters: int, check: bool) -> tuple[Half, Half]:
        torch, dist = self.torch, self.dist
        count = size // 4
        send = torch.arange(PATTERN_PERIOD, dtype=torch.float32, device=self.device)
        send = send.repeat(-(-count // PATTERN_PERIOD))[:count].add_(self.r.rank + 1).contiguous()
        recv, buf = torch.empty_like(send), send.clone()

        def out_of_place() -> None:
            recv.copy_(send)   # torch has no out-of-place all_reduce: reduce a copy, as the out-of-place column
            dist.all_reduce(recv)

        oop_us = self.timed(out_of_place, warmup, iters)
        ip_us = self.timed(lambda: dist.all_reduce(buf), warmup, iters)
        wrong: list[int | None] = [None, None]
        if check:
            out_of_place()
            buf.copy_(send)
            dist.all_reduce(buf)
            self.sync()
            if self.fault == "wrong":
                recv[0] += 1
            counts = torch.stack([self.count_wrong(recv, send), self.count_wrong(buf, send)]).to(torch.int64)
            dist.all_reduce(counts)   # #wrong is summed over ranks, as in nccl-tests
            wrong = [int(c) for c in counts.tolist()]
        return (Half(oop_us, *bandwidth(size, oop_us, self.r.world), wrong[0]),
                Half(ip_us, *bandwidth(size, ip_us, self.r.world), wrong[1]))


def _gather_info(torch: Any, dist: Any, info: dict[str, Any], device: Any, world: int) -> list[dict[str, Any]]:
    """Every rank's host/pid/device, gathered through a fixed-size byte tensor."""
    # all_gather_object would pickle through numpy, which the CPU wheels do not require.
    raw = json.dumps(info).encode()[:INFO_BYTES].ljust(INFO_BYTES)
    mine = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [json.loads(bytes(t.cpu().tolist()).decode("utf-8", "replace").strip() or "{}") for t in gathered]


def _pick_backend(torch: Any, requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl requested but CUDA is not available")
    return requested


def _start_watchdog(timeout_s: float) -> None:
    """A rank whose job outlives its deadline (a hung peer, a wedged device) exits rather than linger."""
    def expire() -> None:
        _failure(f"rank timed out after {timeout_s:g}s")
        os._exit(EXIT_TIMEOUT)
    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()


def run_worker(args: argparse.Namespace) -> int:
    """Run one rank; rank 0 prints the table. Returns the exit status (wrong values -> 1)."""
    _start_watchdog(args.timeout_s + WATCHDOG_SLACK_S)
    me = ranking(os.environ, args.master_addr, args.master_port)
    fault = _fault(me.rank)
    warnings.filterwarnings("ignore", message=".*NumPy.*")  # CPU wheels without numpy warn on import
    import torch
    import torch.distributed as dist

    backend = _pick_backend(torch, args.backend)
    if backend == "nccl":
        torch.cuda.set_device(me.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)  # ranks share the node's cores; gloo's reduction does not need intra-op threads
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=me.init_method, rank=me.rank, world_size=me.world,
                            timeout=timedelta(seconds=args.timeout_s))
    infos = _gather_info(torch, dist, _device_info(torch, backend, me.local_rank), device, me.world)
    lead = me.rank == 0
    if lead:
        lines = format_header(args.min_bytes, args.max_bytes, args.factor, args.warmup, args.iters, args.check)
        lines += [f"# torch.distributed.all_reduce backend {backend}, torch {torch.__version__}", "# Using devices"]
        lines += [format_rank(rank, info) for rank, info in enumerate(infos)] + TABLE_HEAD
        print("\n".join(lines), flush=True)
    if fault == "hang":
        while True:
            time.sleep(3600)

    worker, total_wrong, busbws = _Worker(torch, dist, me, device, fault), 0, []
    for index, size in enumerate(sizes(args.min_bytes, args.max_bytes, args.factor)):
        if fault == "exit" and index == 1:
            os._exit(EXIT_FAULT)  # like a rank killed mid-run: no failure line, no footer
        oop, ip = worker.measure(size, args.warmup, args.iters, args.check)
        total_wrong += (oop.wrong or 0) + (ip.wrong or 0)
        busbws += [oop.busbw, ip.busbw]
        if lead:
            print(format_row(size, oop, ip), flush=True)
    if lead:
        print("\n".join(format_footer(total_wrong, sum(busbws) / max(len(busbws), 1))), flush=True)
    worker.barrier()   # no rank exits before rank 0 printed the footer: the launcher reads an early exit as a crash
    dist.destroy_process_group()
    return EXIT_WRONG if total_wrong else 0


# -- the local launcher -------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> Callable[[], None] | None:
    """preexec_fn that has the kernel SIGKILL a rank if the launcher dies, even by SIGKILL (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(EXIT_ERROR)
    return preexec


def _worker_argv(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", MODULE, "--backend", args.backend, "--min-bytes", str(args.min_bytes),
            "--max-bytes", str(args.max_bytes), "--factor", str(args.factor), "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--check" if args.check else "--no-check", "--timeout-s", str(args.timeout_s)]


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every live rank, then SIGKILL what is left; reap them all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()) if sig is signal.SIGTERM else None)
            except subprocess.TimeoutExpired:
                pass


class _Terminated(Exception):
    pass


def _on_signal(signum: int, _frame: Any) -> None:
    raise _Terminated(signal.Signals(signum).name)


def _exits(codes: Sequence[int | None]) -> str:
    return ", ".join(f"rank {rank} status {c}" for rank, c in enumerate(codes) if c not in (None, 0))


def _wait(procs: Sequence[subprocess.Popen[bytes]], deadline: float) -> int:
    """Wait for every rank; a dead rank or the deadline ends the run (the caller kills the rest)."""
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if now >= deadline:
            waiting = [rank for rank, c in enumerate(codes) if c is None]
            _failure(f"timed out waiting for ranks {waiting}")
            return EXIT_TIMEOUT
        if failed_at is not None and now >= failed_at + RANK_EXIT_GRACE_S:
            _failure(f"ranks exited: {_exits(codes)}; stopping the other ranks")
            return EXIT_ERROR
        time.sleep(0.05)
    if all(c == 0 for c in codes):
        return 0
    if all(c == EXIT_WRONG for c in codes):
        return EXIT_WRONG
    _failure(f"ranks exited: {_exits(codes)}")
    return EXIT_ERROR


def launch(args: argparse.Namespace) -> int:
    """Start `args.nproc` local ranks rendezvousing on 127.0.0.1; none outlives the launcher."""
    if not torch_available():
        _failure("torch is not installed for this interpreter (pip install nodemedic[torch])")
        return EXIT_NO_TORCH
    port, argv, preexec = _free_port(), _worker_argv(args), _die_with_parent()
    procs: list[subprocess.Popen[bytes]] = []
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        deadline = time.monotonic() + args.timeout_s
        for rank in range(args.nproc):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.nproc), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(args.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=preexec))
        return _wait(procs, deadline)
    except _Terminated as exc:
        _failure(f"launcher received {exc}; ranks stopped")
        return EXIT_TERM
    finally:
        _stop(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- command line -------------------------------------------------------------------------------------------------

def _size_arg(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if value < 4:
        raise argparse.ArgumentTypeError("sizes must hold at least one float32 (4 bytes)")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=_positive, help="launch this many local ranks (default: be one rank)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--min-bytes", type=_size_arg, default=parse_size("1M"))
    p.add_argument("--max-bytes", type=_size_arg, default=parse_size("64M"))
    p.add_argument("--factor", type=int, default=2)
    p.add_argument("--iters", type=_positive, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--timeout-s", type=float, default=300.0)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.factor < 2:
        parser.error("--factor must be at least 2")
    if args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")
    if args.nproc is not None:
        return launch(args)
    try:
        return run_worker(args)
    except ImportError as exc:
        _failure(f"cannot import torch: {exc}")
        return EXIT_NO_TORCH
    except Exception as exc:  # noqa: BLE001 - any failure is reported in nccl-tests' form, never a traceback
        _failure(f"{type(exc).__name__}: {exc}")
        return EXIT_ERROR


# -- the deep check -----------------------------------------------------------------------------------------------

def run_torch_allreduce(nproc: int, backend: str = "auto", min_bytes: str = "1M", max_bytes: str = "64M",
                        iters: int = 20, warmup: int = 5, timeout_s: float = 300,
                        threshold_busbw_gbs: float | None = None, python: str = sys.executable) -> DeepCheckResult:
    """Run the built-in test on `nproc` local ranks and judge it as `nccl.run_allreduce` judges all_reduce_perf."""
    args = [python, "-m", MODULE, "--nproc", str(nproc), "--backend", backend, "--min-bytes", min_bytes,
            "--max-bytes", max_bytes, "--iters", str(iters), "--warmup", str(warmup), "--timeout-s", f"{timeout_s:g}"]
    started = time.monotonic()

    def done(status: Status, summary: str, evidence: dict[str, Any]) -> DeepCheckResult:
        return DeepCheckResult(nccl.CHECK, status, summary, evidence=evidence, duration_s=time.monotonic() - started)

    if python == sys.executable and not torch_available():
        return done(Status.SKIPPED, "torch is not installed (pip install nodemedic[torch]): built-in all-reduce "
                                    "test skipped", {"command": args})
    try:
        # The launcher keeps its own deadline; this one only backs it up, so the launcher gets to report first.
        out = run_tool(args, timeout_s + 2 * KILL_GRACE_S + 5)
    except CheckUnavailable as exc:
        return done(unavailable_status(exc), str(exc), {"command": args})
    evidence = {"command": args, "returncode": out.returncode, "output_tail": tail(out.output)}
    if out.returncode == EXIT_NO_TORCH:
        return done(Status.SKIPPED, f"torch is not installed for {python}: built-in all-reduce test skipped",
                    evidence)
    result = nccl.judge(nccl.parse_allreduce(out.output), threshold_busbw_gbs, nodes=1, devices=nproc)
    ran = _BACKEND_LINE.search(out.stdout)
    result.metrics["NcclOperations"] = f"torch.distributed.all_reduce ({ran[1] if ran else backend})"
    if out.returncode != 0 and result.status is not Status.FAILED:
        # A run that exits non-zero never passes, whatever it printed before.
        result.status = Status.ERROR
        result.summary = f"torch all-reduce exited {out.returncode}: {result.summary}"
    result.evidence = evidence
    result.duration_s = time.monotonic() - started
    return result


if __name__ == "__main__":
    status = main()
    if status not in (0, EXIT_WRONG):
        # A failed rank may hold a wedged communicator whose teardown blocks: leave without running it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
