"""The daemon: checks feed findings to the policy; decisions are logged, persisted, and handed to actions."""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nodemedic import __version__
from nodemedic.actions import ActionBackend, ActionDispatcher
from nodemedic.actions.local import LocalBackend
from nodemedic.catalog import load_catalog
from nodemedic.checks.active.base import DeepCheckResult
from nodemedic.checks.base import Check, Poller, Watcher
from nodemedic.checks.platform.imds import Imds, resolve_instance_type
from nodemedic.config import Config
from nodemedic.diag import (GRACE_S, DiagRun, begin_command, build_plan, new_run_id, open_deep_log,
                            result_command, run_plan, select)
from nodemedic.model import CHECK_FAILED, DEEP_ERROR, DEEP_PASSED, Action, Finding, Health, Severity
from nodemedic.policy import DeepCheckRun, Decision, Policy, PolicyState
from nodemedic.recovery_server import RecoveryServer, RecoveryServerError, signal_ranks
from nodemedic.registry import applicable, build_checks, node_context
from nodemedic.runner import CheckRunner
from nodemedic.state import AgentLock, StateStore
from nodemedic.telemetry.deep_log import DeepCheckLog
from nodemedic.telemetry.logs import DetectionLog
from nodemedic.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

INBOX = "inbox"
SAVE_EVERY_S = 10.0        # repeats only bump counters: persist them lazily
QUEUE_LIMIT = 10_000       # findings waiting for the policy; a full queue slows the watchers, never drops
READY_TIMEOUT_S = 5.0      # how long start() waits for watchers to be positioned before saying ready


def read_boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


class AgentAlreadyRunning(RuntimeError):
    pass


class Agent:
    def __init__(self, config: Config, checks: list[Check] | None = None, backends: list[ActionBackend] | None = None,
                 clock: Callable[[], float] = time.time, boot_id: str | None = None):
        self.config = config
        self.clock = clock
        self.store = StateStore(config.state_dir)
        self.lock = AgentLock(config.state_dir)
        self.policy = Policy(load_catalog(config.catalog), config.policy_config())
        imds = Imds(config.imds.endpoint, config.imds.timeout_s) if config.imds.enabled else None
        self.instance_type = resolve_instance_type(config.instance_type, imds)
        self.ctx = node_context(config, self.instance_type)
        self.checks = applicable(build_checks(config, self.ctx, imds) if checks is None else checks, self.ctx)
        self.metrics = Metrics(config.node_name, self.instance_type)
        self.detections = DetectionLog(config.node_name, self.instance_type)
        self.backends = backends if backends is not None else self._default_backends()
        self.dispatcher = ActionDispatcher(self.backends,
                                           on_error=lambda name, exc: self.metrics.action_errors.labels(name).inc())
        self.runner = CheckRunner(self.submit, lambda name, s: self.metrics.check_duration.labels(name).observe(s))
        self.boot_id = boot_id if boot_id is not None else read_boot_id()
        self.state = PolicyState()
        self.metrics_port: int | None = None
        # Findings and commands (operator inbox, deep-check runs) share one queue, so they apply in order.
        self._queue: queue.Queue[Finding | dict[str, Any]] = queue.Queue(QUEUE_LIMIT)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._dirty = False
        self._decided = False
        self._last_save = 0.0
        self.recovery = (RecoveryServer.from_config(config.recovery, on_report=self.submit)
                         if config.recovery.enabled else None)
        self.deep_log: DeepCheckLog | None = None
        self.deep_run: DiagRun | None = None      # the run in progress, for status and tests
        self.deep_runs = 0
        self._deep_requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._deep_cancel = threading.Event()
        self._deep_thread: threading.Thread | None = None

    def _default_backends(self) -> list[ActionBackend]:
        return make_backends(self.config, on_intent=self._operator_request,
                             on_refused=lambda why: self.metrics.quarantine_refused.inc())

    def _operator_request(self, health: Health) -> None:
        """A person asked for a reboot or replacement on the platform: a finding like any other, decided by policy."""
        action = Action.REPLACE if health is Health.PENDING_REPLACEMENT else Action.REBOOT
        self.submit(Finding(check="operator", component="node", code="OPERATOR_REQUEST",
                            message=f"operator set the node to {health.value}", severity=Severity.WARNING,
                            evidence={"requested": health.value}, recommended_action=action))

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.store.ensure_dir()
        if not self.lock.acquire():
            raise AgentAlreadyRunning(f"another nodemedic agent is running with state dir {self.config.state_dir}")
        with self.store.locked():
            self.state = self.store.load()
        now = self.clock()
        if self.boot_id:
            for d in self.policy.on_boot(self.state, self.boot_id, now):
                self._record(d)
        run = self.state.deep_run
        if run is not None and run.trigger != "cli":
            # This agent's own run died with it: no verdict, and the node must not stay held for it.
            log.warning("deep-check run %s was interrupted by an agent restart: ending it as %s", run.run_id,
                        DEEP_ERROR)
            self.policy.deep_check_end(self.state, run.run_id, DEEP_ERROR, now)
        self._save()
        log.info("nodemedic %s starting on node %s (instance type %s); state %s; resumed %s with %d active "
                 "fault(s); checks: %s; actions: %s", __version__, self.config.node_name,
                 self.instance_type or "unknown", self.store.path, self.state.verdict.health.value,
                 len(self.state.active), ", ".join(c.name for c in self.checks) or "none",
                 ", ".join(b.name for b in self.backends))
        if self.config.metrics.enabled:
            try:
                self.metrics_port = self.metrics.serve(self.config.metrics.host, self.config.metrics.port)
                log.info("metrics on http://%s:%d/metrics", self.config.metrics.host, self.metrics_port)
            except OSError as exc:  # a taken port costs the metrics endpoint, never detection
                log.error("metrics endpoint %s:%d unavailable: %s", self.config.metrics.host,
                          self.config.metrics.port, exc)
        self._publish_verdict()
        self.dispatcher.start()
        self.dispatcher.submit(self.state.verdict)  # reconcile the platform with what we remember
        if self.recovery is not None:
            try:
                self.recovery.start()
            except (OSError, RecoveryServerError) as exc:  # costs in-process recovery, never detection
                log.error("recovery socket %s unavailable: %s", self.config.recovery.socket, exc)
                self.recovery = None
        watchers = [c for c in self.checks if isinstance(c, Watcher)]
        for w in watchers:
            self._threads.append(self.runner.start_watcher(w, self._stop))
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = [w.name for w in watchers if not w.wait_ready(max(0.0, deadline - time.monotonic()))]
        pollers = [c for c in self.checks if isinstance(c, Poller)]
        if pollers:
            t = threading.Thread(target=self._schedule, args=(pollers,), name="pollers", daemon=True)
            t.start()
            self._threads.append(t)
        if self.config.deep_checks.enabled:
            self.deep_log = open_deep_log(self.config, self.instance_type)
            self._deep_thread = threading.Thread(target=self._deep_loop, name="deep-checks", daemon=True)
            self._deep_thread.start()
        # Readiness means every watcher is positioned on its source: anything logged from now on is seen.
        log.info("nodemedic ready" + (f" (not yet watching: {', '.join(waiting)})" if waiting else ""))

    def stop(self) -> None:
        self._stop.set()
        self._deep_cancel.set()
        self._deep_requests.put(None)
        if self._deep_thread is not None:
            # A cancelled run kills its tools and queues its end before the queue is drained below.
            self._deep_thread.join(timeout=GRACE_S + 10)
        for t in self._threads:
            t.join(timeout=5)
        if self.recovery is not None:
            self.recovery.stop()
        self._drain()
        if self._dirty:
            self._save()
        self.dispatcher.stop()
        self.metrics.close()
        if self.deep_log is not None:
            self.deep_log.close()
        self.lock.release()

    def run_forever(self) -> None:
        """Run until SIGTERM/SIGINT."""
        def _signal(signum, _frame):  # type: ignore[no-untyped-def]
            log.info("signal %d: stopping", signum)
            self._stop.set()
        signal.signal(signal.SIGTERM, _signal)
        signal.signal(signal.SIGINT, _signal)
        self.start()
        try:
            self.loop()
        finally:
            self.stop()

    # -- the loop ----------------------------------------------------------------------------------------------------
    def submit(self, finding: Finding) -> None:
        """Called from check threads. Blocks while the policy is QUEUE_LIMIT findings behind."""
        while not self._stop.is_set():
            try:
                self._queue.put(finding, timeout=0.5)
                return
            except queue.Full:
                continue

    def loop(self) -> None:
        next_tick = 0.0
        while not self._stop.is_set():
            try:
                finding = self._queue.get(timeout=1.0)
            except queue.Empty:
                finding = None
            if finding is not None:
                self._take(finding)
                self._drain()
            if self._decided:
                # Decisions are logged as they are made; the state file is written once per burst of them.
                self._save()
            mono = time.monotonic()
            if mono >= next_tick:
                next_tick = mono + 1.0
                self._process_inbox()
                if self.policy.deep_check_expire(self.state, self.clock()):
                    log.error("a deep-check run outlived its lease: its hold on the node is lifted")
                    self._publish_verdict()
                    self._save()
                if self._dirty and mono - self._last_save >= SAVE_EVERY_S:
                    self._save()

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._take(item)

    def _take(self, item: Finding | dict[str, Any]) -> None:
        if isinstance(item, Finding):
            self.handle(item)
        else:
            self.apply(item)

    def command(self, cmd: dict[str, Any], done: threading.Event | None = None) -> None:
        """Queue a command for the loop thread (which alone touches the policy state); `done` is set once applied."""
        if done is not None:
            cmd = {**cmd, "_done": done}
        self._queue.put(cmd)  # blocking even while stopping: a run's end must reach the state before it is saved

    def apply(self, cmd: dict[str, Any]) -> None:
        """Apply one command on the loop thread: its findings are handled like any other, then the verdict moves."""
        done = cmd.pop("_done", None)
        try:
            if cmd.get("command") == "diag":
                if self._deep_thread is None:
                    log.error("deep checks were requested but are disabled (deep_checks.enabled: false)")
                else:
                    self.request_deep_check(cmd.get("level"), cmd.get("only"), str(cmd.get("trigger") or "request"))
                return
            decisions = apply_command(self.policy, self.state, cmd, self.clock(), observe=self.handle)
        except (KeyError, ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            log.error("ignoring malformed command %s: %s", cmd.get("command"), exc)
            return
        finally:
            if done is not None:
                done.set()
        for d in decisions:
            self._record(d)
        self._publish_verdict()
        self._dirty = self._decided = True

    def handle(self, finding: Finding) -> Decision | None:
        self.metrics.finding(finding)
        decision = self.policy.observe(self.state, finding, self.clock())
        self._dirty = True
        if decision is None:
            self.metrics.suppressed.inc(finding.repeats)
            return None
        self.metrics.suppressed.inc(finding.repeats - 1)
        self._record(decision)
        self._decided = True
        return decision

    def _record(self, decision: Decision) -> None:
        if self.recovery is not None:
            # First, before logging: ranks must stop their step within milliseconds.
            signal_ranks(self.recovery, decision, self.policy.catalog, self.config.recovery)
        self.detections.emit(decision)
        self.metrics.decision(decision)
        self._publish_verdict()  # cheap: backends act only when the verdict's generation moves

    def _publish_verdict(self) -> None:
        counts: dict[str, int] = {str(a): 0 for a in Action}
        for f in self.state.active.values():
            if f.enforced:
                counts[str(f.action)] += 1
        self.metrics.verdict(self.state.verdict, counts)
        self.dispatcher.submit(self.state.verdict)

    def _save(self) -> None:
        try:
            with self.store.locked():
                self.store.save(self.state)
            self._dirty = self._decided = False
        except OSError as exc:
            # Keep running: the decision is logged and held in memory; saving is retried on the next change.
            log.error("could not persist state to %s: %s", self.store.path, exc)
        self._last_save = time.monotonic()

    def _schedule(self, pollers: list[Poller]) -> None:
        due = {p.name: 0.0 for p in pollers}
        while not self._stop.is_set():
            mono = time.monotonic()
            for p in pollers:
                if mono >= due[p.name]:
                    for f in self.runner.run_once(p):
                        self.submit(f)
                    due[p.name] = time.monotonic() + p.interval_s
            self._stop.wait(max(0.05, min(due.values()) - time.monotonic()))

    # -- deep checks -------------------------------------------------------------------------------------------------
    def request_deep_check(self, level: int | None = None, only: list[str] | None = None,
                           trigger: str = "request") -> None:
        """Ask for a deep-check run; runs one at a time, in the order asked."""
        self._deep_requests.put({"level": level or self.config.deep_checks.level, "only": only, "trigger": trigger})

    def _deep_loop(self) -> None:
        dc = self.config.deep_checks
        next_due = time.monotonic() + dc.interval_s if dc.interval_s else None
        if dc.on_start:
            self.request_deep_check(trigger="on_start")
        while not self._stop.is_set():
            # Asleep until asked, due, or stopped (stop() wakes it with None): no polling while idle.
            wait = None if next_due is None else max(0.0, next_due - time.monotonic())
            try:
                req = self._deep_requests.get(timeout=wait)
            except queue.Empty:
                req = {"level": dc.level, "only": None, "trigger": "schedule"}
            if req is None or self._stop.is_set():
                return
            try:
                self.run_deep_checks(int(req["level"]), req.get("only"), str(req["trigger"]))
            except Exception:  # a broken run must not end scheduled runs
                log.exception("deep-check run failed")
            if dc.interval_s:
                next_due = time.monotonic() + dc.interval_s

    def run_deep_checks(self, level: int, only: list[str] | None = None, trigger: str = "request") -> DiagRun:
        """One run: hold the node, run the tests, feed the policy as each ends, publish the outcome, release."""
        dc = self.config.deep_checks
        run = DiagRun(new_run_id(), level, trigger, self.clock())
        other = self.state.deep_run
        if other is not None and other.expires > run.started:
            # One run at a time on a node: a `nodemedic diag` from a shell may hold it now.
            run.note = f"run {other.run_id} ({other.trigger}) is in progress: not started"
            run.finished = run.started
            log.warning("deep-check run (%s) skipped: %s", trigger, run.note)
            return run
        try:
            tests = select(build_plan(self.config, self.ctx, level), only)
        except ValueError as exc:
            run.note = str(exc)
            tests = []
        self.deep_run = run
        self.deep_runs += 1
        begun = threading.Event()
        self.command(begin_command(run, tests, dc.hold_node, dc.hold_timeout_s), done=begun)
        begun.wait(10)
        if not run.note and dc.hold_node and not self.dispatcher.wait_idle(dc.hold_timeout_s):
            run.note = f"the node could not be held out of scheduling within {dc.hold_timeout_s:g}s: tests not run"
            log.error("deep-check run %s: %s", run.run_id, run.note)
        run_plan(tests, run, self._deep_cancel, self.deep_log, on_result=self._deep_result, clock=self.clock)
        self.metrics.deep_run(run)
        self.command({"command": "deep_check_end", "run_id": run.run_id, "status": run.status})
        log.log(logging.INFO if run.status == DEEP_PASSED else logging.WARNING,
                "deep-check run %s (%s, level %d): %s", run.run_id, trigger, level, run.status)
        self.deep_run = None
        return run

    def _deep_result(self, result: DeepCheckResult) -> None:
        self.metrics.deep_result(result)
        self.command(result_command(result))

    # -- operator commands ---------------------------------------------------------------------------------------
    def _process_inbox(self) -> None:
        inbox = Path(self.config.state_dir) / INBOX
        try:
            entries = sorted(inbox.glob("*.json"))
        except OSError:
            return
        for path in entries:
            try:
                cmd = json.loads(path.read_text())
                if not isinstance(cmd, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as exc:
                log.error("ignoring unreadable operator command %s: %s", path.name, exc)
            else:
                self.apply(cmd)
            self._save()
            try:
                path.unlink()
            except OSError:
                pass


def make_backends(config: Config, on_intent: Callable[[Health], None] | None = None,
                  on_refused: Callable[[str], None] | None = None) -> list[ActionBackend]:
    """The backend the config names (or detects), as the agent and one-shot commands use it."""
    actions = config.actions
    backend = actions.backend
    if backend == "auto":
        backend = detect_backend(actions)
    if backend == "kubernetes":
        from nodemedic.actions.kubernetes import KubernetesBackend
        return [KubernetesBackend(config.node_name, actions.kubernetes, profile=config.profile,
                                  dry_run=actions.dry_run, on_intent=on_intent, on_refused=on_refused)]
    if backend == "slurm":
        from nodemedic.actions.slurm import SlurmBackend
        return [SlurmBackend(actions.slurm, config.state_dir, profile=config.profile, dry_run=actions.dry_run)]
    # With no cluster around the agent runs embedded: it records and prints what it would apply.
    return [LocalBackend(config.node_name, Path(config.state_dir) / "local-actions.jsonl", dry_run=actions.dry_run)]


def detect_backend(actions: Any) -> str:
    """kubernetes inside a pod, slurm where scontrol and a slurm.conf are, else the embedded local backend."""
    kube = actions.kubernetes
    if os.environ.get("KUBERNETES_SERVICE_HOST") or kube.kubeconfig or kube.api_url:
        return "kubernetes"
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    if shutil.which(actions.slurm.scontrol) and Path(conf).exists():
        return "slurm"
    return "local"


def apply_command(policy: Policy, state: PolicyState, cmd: dict, now: float,
                  observe: Callable[[Finding], Decision | None] | None = None) -> list[Decision]:
    """A command from the CLI (directly or through the running agent's inbox) or from the agent's deep-check runs.

    Findings a command carries go to `observe` when given (the agent records those itself); otherwise to the
    policy, and their decisions are returned with the rest.
    """
    kind = cmd.get("command")
    decisions: list[Decision] = []

    def see(finding: Finding) -> None:
        if observe is not None:
            observe(finding)
        elif (d := policy.observe(state, finding, now)) is not None:
            decisions.append(d)

    if kind == "clear":
        return policy.operator_clear(state, now, code=cmd.get("code"), component=cmd.get("component"))
    if kind == "deep_check_begin":
        policy.deep_check_begin(state, DeepCheckRun.model_validate(cmd["run"]), now)
    elif kind == "deep_check_result":
        for data in cmd.get("findings") or []:
            see(Finding.from_dict(data))
        if cmd.get("passed"):
            for finding in passed_clears(state, str(cmd["passed"]), now):
                see(finding)
    elif kind == "deep_check_end":
        if not policy.deep_check_end(state, str(cmd["run_id"]), str(cmd["status"]), now):
            log.warning("deep-check run %s ended (%s) but is not the run holding the node", cmd["run_id"],
                        cmd["status"])
    else:
        raise ValueError(f"unknown command {cmd.get('command')!r}")
    return decisions


def passed_clears(state: PolicyState, check: str, now: float) -> list[Finding]:
    """A deep test that passes is the explicit all-clear for the faults it raised earlier."""
    return [Finding(check, f.component, f.code, f"deep check {check} passed", Severity.INFO, observed_at=now,
                    healthy=True)
            for f in state.active.values() if f.check == check and f.code != CHECK_FAILED]


def write_command(state_dir: str | os.PathLike[str], cmd: dict) -> Path:
    inbox = Path(state_dir) / INBOX
    inbox.mkdir(parents=True, exist_ok=True)
    path = inbox / f"{time.time_ns()}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cmd))
    os.replace(tmp, path)
    return path
