"""EFA deep checks: list libfabric domains with `fi_info`, run an `fi_pingpong` loopback and judge its figures.

The pingpong runs a server and a client on this node (`efa` in production, `tcp` in tests); both processes are
always reaped. tests/fixtures/efa/NOTES.md lists the real captures the parsers follow.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from nodemedic.checks.active.base import DeepCheckResult, Status, tail
from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import check_cancelled, communicate, find_tool, run_tool
from nodemedic.model import Finding, Severity

CHECK = "efa.pingpong"
SLOW = "EFA_PINGPONG_SLOW"
THRESHOLD_KEYS = ("max_latency_us", "min_bandwidth_mbps")
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_NUM = r"\d+(?:\.\d+)?"
_ROW = re.compile(rf"^(?P<size>\d+[kmgKMG]?)\s+(?P<sent>\d+)\s+=?(?P<ack>\d+)\s+(?P<total>{_NUM}[kmgtKMGT]?)\s+"
                  rf"(?P<time>{_NUM})s\s+(?P<mbps>{_NUM})\s+(?P<usec>{_NUM})\s+(?P<mxfers>{_NUM})\s*$")
_HEADER = re.compile(r"^bytes\s+#sent\s+#ack\s+total\s+time\s+MB/sec\s+usec/xfer\s+Mxfers/sec\s*$")
_LOG_LABEL = re.compile(r"^(Server|Client) Log:\s*$", re.IGNORECASE)
# Open MPI --tag-output ("[1,0]<stdout>:") wraps every line when fi_info runs under mpirun.
_MPI_TAG = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:")
# fi_info prints "fi_getinfo: -61"; fi_pingpong prints "fi_getinfo(): util/pingpong.c:1489, ret=-61 (No data ...)".
_NODATA = re.compile(r"fi_getinfo\(?\)?:.*?(?:-61\b|No data available)")
_LISTEN_POLL_S = 0.02


@dataclass(frozen=True)
class PingpongRow:
    """One line of fi_pingpong's table; sizes with k/m suffixes are expanded to bytes (1k = 1024)."""

    size_bytes: int
    sent: int
    acked: int
    total_bytes: int
    time_s: float
    mb_per_s: float
    usec_per_xfer: float
    mxfers_per_s: float


def parse_size(text: str) -> int:
    """`64`, `1k`, `1.2m` -> bytes (fi_pingpong's size_str uses powers of 1024)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(round(float(m.group(1)) * _SUFFIX[m.group(2).lower()]))


def parse_pingpong(text: str) -> list[PingpongRow]:
    """The client's table: the one under `Client Log:` when an efa_test.sh log holds both, else the last one."""
    tables: list[tuple[str | None, list[PingpongRow]]] = []
    label: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if m := _LOG_LABEL.match(line):
            label = m.group(1).lower()
        elif _HEADER.match(line):
            tables.append((label, []))
            label = None
        elif tables and (m := _ROW.match(line)):
            tables[-1][1].append(PingpongRow(parse_size(m["size"]), int(m["sent"]), int(m["ack"]),
                                             parse_size(m["total"]), float(m["time"]), float(m["mbps"]),
                                             float(m["usec"]), float(m["mxfers"])))
    tables = [t for t in tables if t[1]]
    if not tables:
        return []
    return next((rows for lab, rows in tables if lab == "client"), tables[-1][1])


def pingpong_metrics(rows: list[PingpongRow], first_row_is_warmup: bool = True) -> dict[str, Any]:
    """Latency (usec/xfer at the smallest size) and bandwidth (MB/sec at the largest size).

    The first row of a one-connection table carries the connection setup (1124.90 vs 15.85 us in the efa_test.sh
    sample), so with `first_row_is_warmup` the latency comes from the smallest size after it.
    """
    if not rows:
        return {}
    by_size = sorted(rows, key=lambda r: r.size_bytes)
    timed = rows[1:] if first_row_is_warmup and len(rows) > 1 else rows
    smallest = min(timed, key=lambda r: r.size_bytes)
    largest = by_size[-1]
    return {"latency_us": smallest.usec_per_xfer, "latency_size_bytes": smallest.size_bytes,
            "bandwidth_mbps": largest.mb_per_s, "bandwidth_size_bytes": largest.size_bytes,
            "first_row_latency_us": rows[0].usec_per_xfer, "sizes": [r.size_bytes for r in rows]}


def judge(metrics: dict[str, Any], thresholds: dict[str, float] | None,
          component: str) -> tuple[Status, list[Finding], str]:
    """Compare with `max_latency_us` / `min_bandwidth_mbps`; no thresholds means figures are only reported."""
    figures = f"{metrics['latency_us']:g} us at {metrics['latency_size_bytes']} B, " \
              f"{metrics['bandwidth_mbps']:g} MB/s at {metrics['bandwidth_size_bytes']} B"
    problems = []
    limits = thresholds or {}
    if "max_latency_us" in limits and metrics["latency_us"] > limits["max_latency_us"]:
        problems.append(f"latency {metrics['latency_us']:g} us > {limits['max_latency_us']:g} us")
    if "min_bandwidth_mbps" in limits and metrics["bandwidth_mbps"] < limits["min_bandwidth_mbps"]:
        problems.append(f"bandwidth {metrics['bandwidth_mbps']:g} MB/s < {limits['min_bandwidth_mbps']:g} MB/s")
    if problems:
        message = f"fi_pingpong loopback on {component}: {'; '.join(problems)}"
        evidence = {"thresholds": dict(limits), **{k: metrics[k] for k in ("latency_us", "latency_size_bytes",
                                                                            "bandwidth_mbps", "bandwidth_size_bytes")}}
        return Status.FAILED, [Finding(CHECK, component, SLOW, message, Severity.ERROR, evidence)], message
    judged = "" if limits else " (no thresholds: not judged)"
    return Status.PASSED, [], f"fi_pingpong loopback on {component}: {figures}{judged}"


def parse_fi_info(text: str, provider: str = "efa", ep_type: str | None = "FI_EP_RDM") -> list[str]:
    """Domain names (`rdmap16s27-rdm`) offered by `provider`, in order, once each; `ep_type=None` keeps all."""
    entries: list[dict[str, str]] = []
    for raw in text.splitlines():
        line = _MPI_TAG.sub("", raw).strip()
        key, sep, value = line.partition(":")
        if not sep or key not in ("provider", "fabric", "domain", "type"):
            continue
        if key == "provider":
            entries.append({})
        if entries:
            entries[-1][key] = value.strip()
    domains: list[str] = []
    for e in entries:
        # Layered providers read "tcp;ofi_rxm": the core provider is any of the parts.
        if provider not in e.get("provider", "").split(";") or "domain" not in e:
            continue
        if ep_type is not None and e.get("type", ep_type) != ep_type:
            continue
        if e["domain"] not in domains:
            domains.append(e["domain"])
    return domains


def list_devices(provider: str = "efa", timeout_s: float = 30) -> list[str]:
    """Domains from `fi_info -p <provider>`; none when the provider is absent (ENODATA); missing tool raises."""
    out = run_tool(["fi_info", "-p", provider], timeout_s)
    if out.returncode != 0:
        if _NODATA.search(out.output) or out.returncode == 61:
            return []
        raise CheckUnavailable(f"fi_info exited {out.returncode}: {out.output.strip()[:200]}")
    return parse_fi_info(out.stdout, provider)


@functools.lru_cache(maxsize=4)
def libfabric_version(fi_info: str = "fi_info") -> tuple[int, int] | None:
    """(major, minor) from `fi_info --version`, or None when it cannot be told."""
    try:
        out = run_tool([fi_info, "--version"], 10)
    except CheckUnavailable:
        return None
    m = re.search(r"^libfabric:\s*(\d+)\.(\d+)", out.output, re.MULTILINE)
    return (int(m.group(1)), int(m.group(2))) if m else None


def pingpong_options(provider: str, device: str | None, iterations: int, size: int | None,
                     fabric: str | None = None) -> list[str]:
    """Options shared by server and client (both sides must agree on sizes and iterations)."""
    opts = ["-e", "rdm", "-p", provider]
    if fabric:
        opts += ["-f", fabric]
    if device:
        opts += ["-d", device]
    opts += ["-I", str(iterations)]
    # No -S: fi_pingpong's default ladder (64 B .. 1 MiB, as efa_test.sh prints); `-S all` is a 44-size sweep.
    return opts + (["-S", str(size)] if size is not None else [])


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(pid: int, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _reap(proc: subprocess.Popen[bytes] | None) -> str:
    """Kill (if still running) and wait for one process; return what it printed."""
    if proc is None:
        return ""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILLed processes end
        proc.kill()
        out, _ = proc.communicate()
    return (out or b"").decode("utf-8", "replace")


@dataclass
class _PairRun:
    outcome: str  # "ok", "timeout", "server_exited", "server_not_listening", "client_failed"
    port: int
    server_cmd: list[str]
    client_cmd: list[str]
    server_rc: int | None = None
    client_rc: int | None = None
    server_output: str = ""
    client_output: str = ""


def _run_pair(exe: str, opts: list[str], port: int, deadline: float) -> _PairRun:
    server_cmd = [exe, *opts, "-B", str(port)]
    client_cmd = [exe, *opts, "-P", str(port), "localhost"]
    run = _PairRun("ok", port, server_cmd, client_cmd)
    server = client = None
    try:
        # Own sessions so a kill reaches anything they start, and a terminal ^C does not race our cleanup.
        server = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        while not _listening(server.pid, port):
            check_cancelled("fi_pingpong")
            if server.poll() is not None:
                run.outcome = "server_exited"
                return run
            if time.monotonic() >= deadline:
                run.outcome = "server_not_listening"
                return run
            time.sleep(_LISTEN_POLL_S)
        client = subprocess.Popen(client_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            out, _ = communicate(client, max(0.0, deadline - time.monotonic()), "fi_pingpong")
        except subprocess.TimeoutExpired:
            run.outcome = "timeout"
            return run
        run.client_output = out.decode("utf-8", "replace")
        run.client_rc = client.returncode
        try:
            # The server ends on its own once the client is done; give it a moment, not the whole budget.
            server.wait(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
        if client.returncode != 0:
            run.outcome = "client_failed"
        return run
    finally:
        client_tail = _reap(client)
        run.client_output = run.client_output or client_tail
        if client is not None and run.client_rc is None:
            run.client_rc = client.returncode
        run.server_output = _reap(server)
        run.server_rc = server.returncode if server is not None else None



def run_pingpong(provider: str = "efa", device: str | None = None, sizes: list[int] | None = None,
                 iterations: int = 100, port: int | None = None, timeout_s: float = 60,
                 thresholds: dict[str, float] | None = None) -> DeepCheckResult:
    """fi_pingpong server + client on localhost, judged against `thresholds` (max_latency_us, min_bandwidth_mbps).

    `sizes=None` runs fi_pingpong's default ladder (64 B..1 MiB) in one connection; a list runs one connection
    per size (each then includes its connection setup, amortized over `iterations`).
    """
    started = time.monotonic()
    deadline = started + timeout_s
    component = f"efa:{device}" if device else "efa:loopback"

    def result(status: Status, summary: str, findings: list[Finding] | None = None,
               metrics: dict[str, Any] | None = None, evidence: dict[str, Any] | None = None) -> DeepCheckResult:
        return DeepCheckResult(CHECK, status, summary, findings or [], metrics or {}, evidence or {},
                               time.monotonic() - started)

    unknown = set(thresholds or {}) - set(THRESHOLD_KEYS)
    if unknown:
        return result(Status.ERROR, f"unknown threshold(s) {sorted(unknown)}; known: {', '.join(THRESHOLD_KEYS)}")
    exe = find_tool("fi_pingpong")
    if exe is None:
        return result(Status.SKIPPED, "fi_pingpong not found")
    version = libfabric_version()
    # libfabric 2.x offers an `efa-direct` fabric too; fi_pingpong needs the `efa` (RDM over SRD) one.
    fabric = "efa" if provider == "efa" and version is not None and version[0] >= 2 else None

    rows: list[PingpongRow] = []
    runs: list[dict[str, Any]] = []
    for size in ([None] if sizes is None else sorted(set(sizes))):
        opts = pingpong_options(provider, device, iterations, size, fabric)
        for attempt in range(3):
            run = _run_pair(exe, opts, port or free_port(), deadline)
            # A port taken between our pick and the server's bind: pick again (only when we picked).
            if run.outcome == "server_exited" and port is None and not _NODATA.search(run.server_output) \
                    and attempt < 2 and time.monotonic() < deadline:
                continue
            break
        runs.append({"server": run.server_cmd, "client": run.client_cmd, "outcome": run.outcome,
                     "server_rc": run.server_rc, "client_rc": run.client_rc,
                     "client_tail": tail(run.client_output, 20), "server_tail": tail(run.server_output, 20)})
        evidence = {"runs": runs, "libfabric": ".".join(map(str, version)) if version else None}
        said = f"{run.server_output}\n{run.client_output}"
        if _NODATA.search(said):
            return result(Status.SKIPPED, f"libfabric provider {provider!r} not available"
                          + (f" for device {device}" if device else "") + " (fi_getinfo -61, ENODATA)",
                          evidence=evidence)
        if run.outcome != "ok":
            why = {"timeout": f"client did not finish within {timeout_s:g}s",
                   "server_exited": f"server exited ({run.server_rc}) before listening",
                   "server_not_listening": f"server not listening on port {run.port} within {timeout_s:g}s",
                   "client_failed": f"client exited {run.client_rc}"}[run.outcome]
            last = " | ".join(line.strip() for line in said.strip().splitlines()[-2:])
            return result(Status.ERROR, f"fi_pingpong {why}" + (f": {last[:200]}" if last else ""),
                          evidence=evidence)
        got = parse_pingpong(run.client_output)
        if not got:
            return result(Status.ERROR, "fi_pingpong client printed no result table", evidence=evidence)
        rows.extend(got)

    evidence = {"runs": runs, "libfabric": ".".join(map(str, version)) if version else None,
                "rows": [asdict(r) for r in rows]}
    metrics = {**pingpong_metrics(rows, first_row_is_warmup=sizes is None), "iterations": iterations,
               "provider": provider}
    status, findings, summary = judge(metrics, thresholds, component)
    return result(status, summary, findings, metrics, evidence)
