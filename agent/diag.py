"""Deep-check runs: which tests a level runs, running them one at a time with limits, and what a run concluded.

A run is cancellable: every tool a test starts runs under the run's cancel scope, so cancelling (or a test passing its
limit) kills the tool's whole process group. A test that could not run reads as error or skipped, never as passed.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from nodemedic.checks.active import counts, dcgm_diag, efa, nccl, neuron, stress
from nodemedic.checks.active.base import DeepCheckResult, Status, unavailable_status
from nodemedic.checks.base import CheckUnavailable, NodeContext
from nodemedic.checks.tools import Cancelled, cancel_scope, find_tool
from nodemedic.config import Config
from nodemedic.model import DEEP_ERROR, DEEP_FAILED, DEEP_PASSED, Finding, check_failed, check_recovered
from nodemedic.telemetry.deep_log import COMPLETED, RESULT, STARTED, DeepCheckLog

log = logging.getLogger(__name__)

LEVELS = (2, 4)
BACKSTOP_S = 30.0   # past a test's own limit (its tools time out first and say why), the runner cancels it
GRACE_S = 15.0      # how long a cancelled test gets to kill its tools and return
DEEP_LOG_NAME = "deep-health-check.log"  # under the state dir when the configured log path is not writable


@dataclass
class DeepTest:
    name: str
    run: Callable[[], DeepCheckResult]
    timeout_s: float


@dataclass
class DiagRun:
    """One run: its results in order, and the status published for it."""

    run_id: str
    level: int
    trigger: str
    started: float
    finished: float = 0.0
    results: list[DeepCheckResult] = field(default_factory=list)
    cancelled: bool = False
    note: str = ""      # why the run ended early (not held, cancelled)

    @property
    def status(self) -> str:
        statuses = [r.status for r in self.results]
        if Status.FAILED in statuses:
            return DEEP_FAILED
        if self.cancelled or self.note or Status.ERROR in statuses or Status.PASSED not in statuses:
            return DEEP_ERROR  # a run that never reached a verdict, or ran nothing, is not a pass
        return DEEP_PASSED

    def summary(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "level": self.level, "trigger": self.trigger, "status": self.status,
                "cancelled": self.cancelled, "note": self.note, "duration_s": round(self.finished - self.started, 3),
                "tests": {r.name: str(r.status) for r in self.results}}


def result_findings(result: DeepCheckResult) -> list[Finding]:
    """What one test tells the policy: a failure's findings; a check failure when it could not run; else all clear."""
    if result.status is Status.FAILED:
        return list(result.findings)
    if result.status is Status.ERROR:
        return [check_failed(result.name, result.summary, deep_check=True)]
    if result.status is Status.PASSED:
        # A warning-level finding of a passing test (a DCGM warning) is still worth the policy's eye.
        return [*result.findings, check_recovered(result.name)]
    return []


def result_command(result: DeepCheckResult, run_id: str | None = None) -> dict[str, Any]:
    """The command that hands one test's outcome to the agent (its own loop, or its inbox from the CLI)."""
    return {"command": "deep_check_result", "run_id": run_id, "check": result.name, "status": str(result.status),
            "findings": [f.to_dict() for f in result_findings(result)],
            "passed": result.name if result.status is Status.PASSED else None}


def begin_command(run: DiagRun, tests: list[DeepTest], hold: bool, hold_timeout_s: float) -> dict[str, Any]:
    """The command that holds the node for `run`, with a lease covering every test's limit and the hold itself."""
    lease = hold_timeout_s + sum(t.timeout_s + BACKSTOP_S + GRACE_S for t in tests)
    return {"command": "deep_check_begin", "run": {
        "run_id": run.run_id, "started": run.started, "expires": run.started + lease, "hold": hold,
        "level": run.level, "trigger": run.trigger}}


def open_deep_log(config: Config, instance_type: str | None) -> DeepCheckLog:
    """The configured deep-check log, falling back to the state dir where that path is not writable."""
    dc = config.deep_checks
    return DeepCheckLog(dc.log_path, config.node_name, instance_type, dc.log_max_bytes, dc.log_backups,
                        fallback=Path(config.state_dir) / DEEP_LOG_NAME)


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


# -- the plan ---------------------------------------------------------------------------------------------------------

def _skipped(name: str, why: str) -> Callable[[], DeepCheckResult]:
    return lambda: DeepCheckResult(name, Status.SKIPPED, why)


def visible_gpus() -> int | None:
    """GPUs NVML sees here, for a node with no instance profile; None without NVML."""
    try:
        from nodemedic.checks.nvidia.nvml import load_pynvml

        nvml = load_pynvml()
        nvml.nvmlInit()
    except Exception:  # no bindings, no driver: not a GPU node as far as the plan can tell
        return None
    try:
        return int(nvml.nvmlDeviceGetCount())
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _nccl_test(config: Config, ctx: NodeContext, timeout: float) -> Callable[[], DeepCheckResult]:
    cfg = config.deep_checks.nccl
    gpus = cfg.gpus or ctx.expected_gpus
    if gpus is None and ctx.profile is None:
        gpus = visible_gpus() or None
    threshold = cfg.threshold_gbs if cfg.threshold_gbs is not None else nccl.threshold_for(ctx.instance_type, 1)
    if gpus and find_tool(cfg.binary):
        return lambda: nccl.run_allreduce(cfg.binary, gpus, cfg.min_bytes, cfg.max_bytes, timeout, threshold)
    if not cfg.torch_fallback:
        return _skipped(nccl.CHECK, f"{cfg.binary} not found and the torch fallback is off")
    from nodemedic.checks.active import torch_allreduce

    if not torch_allreduce.torch_available():
        return _skipped(nccl.CHECK, f"{cfg.binary} not found and torch is not installed (nodemedic[torch])")
    nproc = gpus or cfg.cpu_ranks
    # On a node without GPUs the run exercises gloo on CPU: the instance type's GPU threshold does not apply.
    limit = threshold if gpus else cfg.threshold_gbs
    return lambda: torch_allreduce.run_torch_allreduce(nproc, cfg.torch_backend, cfg.torch_min_bytes,
                                                       cfg.torch_max_bytes, timeout_s=timeout,
                                                       threshold_busbw_gbs=limit)


def _efa_pingpong(config: Config, ctx: NodeContext, timeout: float) -> Callable[[], DeepCheckResult]:
    cfg = config.deep_checks.efa
    limits = {k: v for k, v in (("max_latency_us", cfg.max_latency_us),
                                ("min_bandwidth_mbps", cfg.min_bandwidth_mbps)) if v is not None}

    def run() -> DeepCheckResult:
        if cfg.provider != "efa":
            # Other providers (tcp in tests) have no per-device domains worth a loopback each.
            return efa.run_pingpong(cfg.provider, None, iterations=cfg.iterations, timeout_s=timeout,
                                    thresholds=limits)
        try:
            devices = efa.list_devices(cfg.provider, 30)
        except CheckUnavailable as exc:
            return DeepCheckResult(efa.CHECK, unavailable_status(exc), str(exc))
        if not devices:
            return DeepCheckResult(efa.CHECK, Status.SKIPPED, "no EFA devices")
        chosen = devices[:cfg.max_devices]
        each = timeout / len(chosen)  # the test's limit covers every device it pings
        return merge(efa.CHECK, [efa.run_pingpong(cfg.provider, d, iterations=cfg.iterations, timeout_s=each,
                                                  thresholds=limits) for d in chosen])
    return run


def merge(name: str, results: list[DeepCheckResult]) -> DeepCheckResult:
    """Per-device results as one: the worst status, every finding, metrics keyed by what each ran on."""
    order = [Status.FAILED, Status.ERROR, Status.PASSED, Status.SKIPPED]
    status = min((r.status for r in results), key=order.index, default=Status.SKIPPED)
    return DeepCheckResult(name, status, "; ".join(r.summary for r in results),
                           [f for r in results for f in r.findings],
                           {"devices": [r.metrics for r in results]}, {"devices": [r.evidence for r in results]},
                           sum(r.duration_s for r in results))


def build_plan(config: Config, ctx: NodeContext, level: int = 2) -> list[DeepTest]:
    """Every deep test this node runs at `level`, in the order they run (quick and cheap first)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level}")
    dc = config.deep_checks
    profile = ctx.profile
    nvlinks = dc.dcgm.expected_nvlinks if dc.dcgm.expected_nvlinks is not None else \
        (profile.nvlinks_per_gpu if profile is not None else None)
    tests: list[DeepTest] = []

    def add(name: str, enabled: bool, default_timeout: float, factory: Callable[[float], Callable[[], DeepCheckResult]],
            configured: float | None) -> None:
        if enabled:
            timeout = configured or default_timeout
            tests.append(DeepTest(name, factory(timeout), timeout))

    add(counts.GPU_CHECK, dc.gpu_count.enabled, 60,
        lambda t: lambda: counts.run_gpu_counts(ctx.expected_gpus, profile.nvlinks_per_gpu if profile else None),
        dc.gpu_count.timeout_s)
    expected_efa = dc.efa.expected_devices if dc.efa.expected_devices is not None else \
        (profile.efa if profile is not None else None)
    add(counts.EFA_CHECK, dc.efa.enabled and dc.efa.provider == "efa", 30,
        lambda t: lambda: counts.run_efa_count(expected_efa, dc.efa.provider, t), dc.efa.timeout_s)
    add(dcgm_diag.CHECK, dc.dcgm.enabled, dcgm_diag.DEFAULT_TIMEOUTS[level],
        lambda t: lambda: dcgm_diag.run_diag(level, nvlinks, dc.dcgm.binary, t, host=dc.dcgm.host),
        dc.dcgm.timeout_s)
    add(nccl.CHECK, dc.nccl.enabled, 900 if level == 2 else 1800, lambda t: _nccl_test(config, ctx, t),
        dc.nccl.timeout_s)
    add(efa.CHECK, dc.efa.enabled, 60.0 * dc.efa.max_devices, lambda t: _efa_pingpong(config, ctx, t),
        dc.efa.timeout_s)
    nc = dc.neuron
    # Neuron tests where the node has Neuron devices (its profile says so, or neuron-ls is installed).
    on_neuron = nc.enabled and bool((profile is not None and profile.neuron_devices) or find_tool(nc.neuron_ls))
    add(neuron.COUNT_CHECK, on_neuron, 30,
        lambda t: lambda: neuron.run_neuron_ls_count(profile.neuron_devices if profile else None, nc.neuron_ls, t),
        nc.timeout_s)
    add(neuron.HW_CHECK, on_neuron and nc.hw_check, 900 if level == 2 else 3600,
        lambda t: lambda: neuron.run_hw_check(binary=nc.nccom_test, neuron_ls_binary=nc.neuron_ls, timeout_s=t,
                                              iters=20 if level == 2 else 200),
        nc.timeout_s)
    add(neuron.NCCOM_CHECK, on_neuron, 600 if level == 2 else 1800,
        lambda t: lambda: neuron.run_nccom(binary=nc.nccom_test, max_bytes=nc.nccom_max_bytes,
                                           threshold_busbw_gbs=nc.nccom_threshold_gbs, timeout_s=t,
                                           neuron_ls_binary=nc.neuron_ls),
        nc.timeout_s)
    duration = dc.stress.duration_s if level == 2 else dc.stress.full_duration_s
    for kind in dc.stress.kinds:
        add(f"stress.{kind}", dc.stress.enabled, duration + 60,
            lambda t, kind=kind: lambda: stress.run_stress(kind, duration, dc.stress.scratch_dir,
                                                           dc.stress.memory_fraction, dc.stress.binary,
                                                           timeout_margin_s=t - duration),
            dc.stress.timeout_s)
    return tests


def select(tests: list[DeepTest], only: list[str] | None) -> list[DeepTest]:
    """Keep the tests `only` names, whole (`stress.cpu`) or by family (`stress`); an unknown name is an error."""
    if not only:
        return tests
    known = {t.name for t in tests} | {t.name.partition(".")[0] for t in tests}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise ValueError(f"unknown deep check(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return [t for t in tests if t.name in only or t.name.partition(".")[0] in only]


# -- running ----------------------------------------------------------------------------------------------------------

def run_test(test: DeepTest, cancel: threading.Event, backstop_s: float = BACKSTOP_S,
             grace_s: float = GRACE_S) -> DeepCheckResult:
    """Run one test in a thread under its own cancel scope; past its limit, or on `cancel`, its tools are killed."""
    own = threading.Event()
    box: list[DeepCheckResult] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            with cancel_scope(own):
                box.append(test.run())
        except BaseException as exc:  # noqa: BLE001 - one test's crash is its own error, not the run's
            errors.append(exc)

    started = time.monotonic()
    worker = threading.Thread(target=contextvars.copy_context().run, args=(target,), name=f"deep-{test.name}",
                              daemon=True)
    worker.start()
    limit = started + test.timeout_s + backstop_s
    why = ""
    while worker.is_alive():
        worker.join(0.1)
        if not worker.is_alive():
            break  # finished: its own result stands, even if a cancel came in the same instant
        if cancel.is_set():
            why = "cancelled"
        elif time.monotonic() >= limit:
            why = f"timed out after {test.timeout_s + backstop_s:g}s"
        if why:
            own.set()
            worker.join(grace_s)
            break
    elapsed = time.monotonic() - started
    if worker.is_alive():
        log.error("deep check %s did not stop within %gs of being %s", test.name, grace_s, why)
    if box and not why:
        result = box[0]
    elif why or (errors and isinstance(errors[0], Cancelled)):
        result = DeepCheckResult(test.name, Status.ERROR, f"{test.name} {why or 'cancelled'}")
    elif errors:
        exc = errors[0]
        status = unavailable_status(exc) if isinstance(exc, CheckUnavailable) else Status.ERROR
        result = DeepCheckResult(test.name, status, f"{test.name} crashed: {type(exc).__name__}: {exc}")
    else:  # pragma: no cover - the thread always leaves a result or an error
        result = DeepCheckResult(test.name, Status.ERROR, f"{test.name} returned nothing")
    if not result.duration_s:
        result.duration_s = elapsed
    return result


def run_plan(tests: list[DeepTest], run: DiagRun, cancel: threading.Event, deep_log: DeepCheckLog | None = None,
             on_result: Callable[[DeepCheckResult], None] | None = None, clock: Callable[[], float] = time.time,
             backstop_s: float = BACKSTOP_S) -> DiagRun:
    """Run `tests` in order into `run`; after a cancel the rest are recorded as skipped, not silently dropped.

    A run that already carries a note (the node could not be held, a bad selection) runs nothing and is only logged.
    """
    if run.note:
        run.finished = clock()
        if deep_log is not None:
            deep_log.write(COMPLETED, run.summary(), run.finished)
        return run
    if deep_log is not None:
        deep_log.write(STARTED, {"run_id": run.run_id, "level": run.level, "trigger": run.trigger,
                                 "tests": [t.name for t in tests]}, clock())
    for test in tests:
        if cancel.is_set():
            run.cancelled = True
            result = DeepCheckResult(test.name, Status.SKIPPED, "not run: the run was cancelled")
        else:
            log.info("deep check %s starting (limit %gs)", test.name, test.timeout_s)
            result = run_test(test, cancel, backstop_s)
            run.cancelled = run.cancelled or cancel.is_set()
            log.log(logging.WARNING if result.status in (Status.FAILED, Status.ERROR) else logging.INFO,
                    "deep check %s: %s (%s, %.1fs)", test.name, result.status, result.summary, result.duration_s)
        run.results.append(result)
        if deep_log is not None:
            deep_log.write(RESULT, {"run_id": run.run_id, "level": run.level, **result.record()}, clock())
        if on_result is not None:
            on_result(result)
    run.finished = clock()
    if deep_log is not None:
        deep_log.write(COMPLETED, run.summary(), run.finished)
    return run
