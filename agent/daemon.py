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
from nodemedic.checks.base import Check, Poller, Watcher
from nodemedic.config import Config
from nodemedic.checks.platform.imds import Imds, resolve_instance_type
from nodemedic.model import Action, Finding, Health, Severity
from nodemedic.policy import Decision, Policy, PolicyState
from nodemedic.recovery_server import RecoveryServer, RecoveryServerError, signal_ranks
from nodemedic.registry import applicable, build_checks, node_context
from nodemedic.runner import CheckRunner
from nodemedic.state import AgentLock, StateStore
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
        self._queue: queue.Queue[Finding] = queue.Queue(QUEUE_LIMIT)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._dirty = False
        self._decided = False
        self._last_save = 0.0
        self.recovery = (RecoveryServer.from_config(config.recovery, on_report=self.submit)
                         if config.recovery.enabled else None)

    def _default_backends(self) -> list[ActionBackend]:
        actions = self.config.actions
        kube = actions.kubernetes
        backend = actions.backend
        if backend == "auto":
            backend = detect_backend(actions)
        if backend == "kubernetes":
            from nodemedic.actions.kubernetes import KubernetesBackend
            return [KubernetesBackend(self.config.node_name, kube, profile=self.config.profile,
                                      dry_run=actions.dry_run, on_intent=self._operator_request,
                                      on_refused=lambda why: self.metrics.quarantine_refused.inc())]
        if backend == "slurm":
            from nodemedic.actions.slurm import SlurmBackend
            return [SlurmBackend(actions.slurm, self.config.state_dir, profile=self.config.profile,
                                 dry_run=actions.dry_run)]
        # With no cluster around the agent runs embedded: it records and prints what it would apply.
        return [LocalBackend(self.config.node_name, Path(self.config.state_dir) / "local-actions.jsonl",
                             dry_run=actions.dry_run)]

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
        # Readiness means every watcher is positioned on its source: anything logged from now on is seen.
        log.info("nodemedic ready" + (f" (not yet watching: {', '.join(waiting)})" if waiting else ""))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.recovery is not None:
            self.recovery.stop()
        self._drain()
        if self._dirty:
            self._save()
        self.dispatcher.stop()
        self.metrics.close()
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
                self.handle(finding)
                self._drain()
            if self._decided:
                # Decisions are logged as they are made; the state file is written once per burst of them.
                self._save()
            mono = time.monotonic()
            if mono >= next_tick:
                next_tick = mono + 1.0
                self._process_inbox()
                if self._dirty and mono - self._last_save >= SAVE_EVERY_S:
                    self._save()

    def _drain(self) -> None:
        while True:
            try:
                finding = self._queue.get_nowait()
            except queue.Empty:
                return
            self.handle(finding)

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
                decisions = apply_command(self.policy, self.state, cmd, self.clock())
            except (OSError, ValueError, TypeError) as exc:
                log.error("ignoring unreadable operator command %s: %s", path.name, exc)
                decisions = []
            for d in decisions:
                self._record(d)
            self._save()
            try:
                path.unlink()
            except OSError:
                pass


def detect_backend(actions: Any) -> str:
    """kubernetes inside a pod, slurm where scontrol and a slurm.conf are, else the embedded local backend."""
    kube = actions.kubernetes
    if os.environ.get("KUBERNETES_SERVICE_HOST") or kube.kubeconfig or kube.api_url:
        return "kubernetes"
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    if shutil.which(actions.slurm.scontrol) and Path(conf).exists():
        return "slurm"
    return "local"


def apply_command(policy: Policy, state: PolicyState, cmd: dict, now: float) -> list[Decision]:
    """An operator's command, from the CLI directly or through the running agent's inbox."""
    if cmd.get("command") != "clear":
        raise ValueError(f"unknown command {cmd.get('command')!r}")
    return policy.operator_clear(state, now, code=cmd.get("code"), component=cmd.get("component"))


def write_command(state_dir: str | os.PathLike[str], cmd: dict) -> Path:
    inbox = Path(state_dir) / INBOX
    inbox.mkdir(parents=True, exist_ok=True)
    path = inbox / f"{time.time_ns()}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cmd))
    os.replace(tmp, path)
    return path
