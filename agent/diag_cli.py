"""`nodemedic diag`: run the deep checks now, in the foreground, holding the node and feeding the policy.

With an agent running, the run's hold, results and end go through the agent's inbox, so the agent stays the one
writer of the node's state and platform; without one, this command applies them to the state store and the
platform itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from typing import Any, Iterator

from nodemedic.actions import RetryLater
from nodemedic.catalog import load_catalog
from nodemedic.checks.active.base import DeepCheckResult
from nodemedic.checks.platform.imds import Imds, resolve_instance_type
from nodemedic.config import Config
from nodemedic.checks.tools import cancel_scope
from nodemedic.daemon import apply_command, make_backends, write_command
from nodemedic.diag import (DiagRun, begin_command, build_plan, new_run_id, open_deep_log, result_command, run_plan,
                            select)
from nodemedic.model import DEEP_FAILED, DEEP_PASSED
from nodemedic.policy import Policy
from nodemedic.registry import node_context
from nodemedic.state import AgentLock, StateStore
from nodemedic.telemetry.deep_log import COMPLETED, DeepCheckLog

log = logging.getLogger("nodemedic.diag")

EXIT_PASSED, EXIT_FAILED, EXIT_ERROR = 0, 1, 2
INBOX_WAIT_S = 30.0


class DirectPublisher:
    """No agent running: apply each step to the state store under its lock, and the verdict to the platform."""

    def __init__(self, config: Config):
        self.config = config
        self.store = StateStore(config.state_dir)
        self.policy = Policy(load_catalog(config.catalog), config.policy_config())
        self.backends = make_backends(config)

    def send(self, cmd: dict[str, Any]) -> str | None:
        """Apply one command and push the verdict; returns why the platform could not be told, or None."""
        try:
            self.store.ensure_dir()
            with self.store.locked():
                state = self.store.load()
                apply_command(self.policy, state, cmd, time.time())
                self.store.save(state)
        except OSError as exc:
            return f"cannot update the state in {self.config.state_dir}: {exc} (pass --state-dir or run as root)"
        problems = []
        for backend in self.backends:
            try:
                backend.apply(state.verdict)
            except RetryLater as exc:
                problems.append(f"{backend.name}: {exc}")
            except Exception as exc:  # an unreachable platform: said, and the run decides what it means
                problems.append(f"{backend.name}: {type(exc).__name__}: {exc}")
        return "; ".join(problems) or None

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


class InboxPublisher:
    """An agent is running: hand each step to it, in order, through its inbox."""

    def __init__(self, config: Config, wait_s: float = INBOX_WAIT_S):
        self.config = config
        self.wait_s = wait_s

    def send(self, cmd: dict[str, Any]) -> str | None:
        path = write_command(self.config.state_dir, cmd)
        deadline = time.monotonic() + self.wait_s
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if path.exists():
            return f"the running agent has not taken {cmd['command']} within {self.wait_s:g}s (queued at {path})"
        return None

    def close(self) -> None:
        pass


@contextlib.contextmanager
def cancel_on_signals() -> Iterator[threading.Event]:
    """An event SIGINT and SIGTERM set while the block runs (the run then cancels its tools); handlers restored."""
    cancel = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: cancel.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield cancel
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _context(config: Config):  # type: ignore[no-untyped-def]
    imds = Imds(config.imds.endpoint, config.imds.timeout_s) if config.imds.enabled else None
    return node_context(config, resolve_instance_type(config.instance_type, imds))


def cmd_diag(args: argparse.Namespace, config: Config) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    dc = config.deep_checks
    level = args.level or dc.level
    ctx = _context(config)
    try:
        tests = select(build_plan(config, ctx, level), args.only)
    except ValueError as exc:
        print(f"nodemedic diag: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.list:
        for t in tests:
            print(f"{t.name:20} limit {t.timeout_s:g}s")
        return EXIT_PASSED
    running = AgentLock(config.state_dir).held_by_other()
    if args.background:
        if not running:
            print("nodemedic diag --background needs a running agent", file=sys.stderr)
            return EXIT_ERROR
        problem = InboxPublisher(config).send({"command": "diag", "level": level, "only": args.only,
                                               "trigger": "request"})
        print(problem or "the running agent will run the deep checks; follow them in its log and "
                         f"{dc.log_path}", file=sys.stderr if problem else sys.stdout)
        return EXIT_ERROR if problem else EXIT_PASSED

    busy = _run_in_progress(config)
    if busy:
        print(f"nodemedic diag: {busy}; not starting another", file=sys.stderr)
        return EXIT_ERROR
    hold = dc.hold_node and not args.no_hold
    publisher = InboxPublisher(config) if running else DirectPublisher(config)
    deep_log = open_deep_log(config, ctx.instance_type)
    run = DiagRun(new_run_id(), level, "cli", time.time())
    with cancel_on_signals() as cancel, contextlib.closing(deep_log), contextlib.closing(publisher):
        problem = publisher.send(begin_command(run, tests, hold, dc.hold_timeout_s))
        if problem and hold:
            run.note = f"the node could not be held out of scheduling: {problem}; tests not run"

        def on_result(result: DeepCheckResult) -> None:
            if args.verbose or (not args.json and sys.stderr.isatty()):
                print(f"  {result.name:18} {str(result.status):8} {result.summary}", file=sys.stderr, flush=True)
            if (why := publisher.send(result_command(result, run.run_id))) is not None:
                log.error("%s", why)
        run_plan(tests, run, cancel, deep_log, on_result=on_result)
        if (why := publisher.send({"command": "deep_check_end", "run_id": run.run_id, "status": run.status})):
            log.error("%s", why)
    _report(run, config, deep_log, args.json)
    return {DEEP_PASSED: EXIT_PASSED, DEEP_FAILED: EXIT_FAILED}.get(run.status, EXIT_ERROR)


def _run_in_progress(config: Config) -> str | None:
    """The deep-check run holding this node now, if any (its lease not yet out)."""
    store = StateStore(config.state_dir)
    if not store.path.exists():
        return None
    try:
        run = store.load().deep_run
    except OSError:
        return None
    if run is None or run.expires <= time.time():
        return None
    return f"deep-check run {run.run_id} ({run.trigger}, level {run.level}) is in progress"


def _report(run: DiagRun, config: Config, deep_log: DeepCheckLog, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"node": config.node_name, **run.summary(), "log": str(deep_log.path),
                          "results": [r.record() for r in run.results]}, indent=2, default=str))
        return
    print(f"deep checks on {config.node_name} (level {run.level}, run {run.run_id}): {run.status}"
          + (f" - {run.note}" if run.note else "") + (" (cancelled)" if run.cancelled else ""))
    width = max([len(r.name) for r in run.results] + [4])
    for r in run.results:
        print(f"  {r.name:{width}}  {str(r.status):8} {r.duration_s:7.1f}s  {r.summary[:160]}")
    for r in run.results:
        for f in r.findings:
            print(f"    {f.component}: {f.code} {f.message[:140]}")
    if deep_log.path is not None:
        print(f"records: {deep_log.path}")


def cmd_diag_cluster(args: argparse.Namespace, config: Config) -> int:
    """The all-reduce across nodes through srun, bisected on failure; or, for Kubernetes, the Job that runs it."""
    from nodemedic.actions.kubernetes import PREFIXES
    from nodemedic.checks.active import cluster

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    nccl_cfg = config.deep_checks.nccl
    binary = None if args.torch else (args.binary or nccl_cfg.binary)
    min_bytes = args.min_bytes or (nccl_cfg.min_bytes if binary else nccl_cfg.torch_min_bytes)
    max_bytes = args.max_bytes or (nccl_cfg.max_bytes if binary else nccl_cfg.torch_max_bytes)
    if args.kubernetes:
        if not args.image:
            print("nodemedic diag cluster --kubernetes needs --image (an image with nodemedic[torch])", file=sys.stderr)
            return EXIT_ERROR
        prefix = config.actions.kubernetes.prefix or PREFIXES.get(config.profile, PREFIXES["default"])
        objs = cluster.render_k8s_job(args.nodes, image=args.image, namespace=args.namespace,
                                      gpus_per_node=args.tasks_per_node or 8, tasks_per_node=args.tasks_per_node,
                                      min_bytes=args.min_bytes or nccl_cfg.torch_min_bytes,
                                      max_bytes=args.max_bytes or nccl_cfg.torch_max_bytes,
                                      threshold_busbw_gbs=args.threshold, efa_per_node=args.efa_per_node,
                                      taint_prefix=prefix)
        print(cluster.dump_yaml(objs), end="")
        return EXIT_PASSED
    instance_type = _context(config).instance_type  # the group is assumed to be of this node's type
    command: dict[str, Any] = {"binary": binary, "min_bytes": min_bytes, "max_bytes": max_bytes,
                               "gpus_per_task": args.gpus_per_task, "mpi": args.mpi}
    if args.srun_arg:
        command["extra_srun_args"] = args.srun_arg
    with cancel_on_signals() as cancel, contextlib.closing(open_deep_log(config, instance_type)) as deep_log, \
            cancel_scope(cancel):
        result = cluster.run_cluster(args.nodes, tasks_per_node=args.tasks_per_node or 8,
                                     threshold_busbw_gbs=args.threshold, instance_type=instance_type,
                                     bisect_on_failure=not args.no_bisect, timeout_s=args.timeout, **command)
        deep_log.write(COMPLETED, {"run_id": new_run_id(), "trigger": "cli-cluster", "cluster": result.record(),
                                   "status": str(result.result.status)}, time.time())
    r = result.result
    if args.json:
        print(json.dumps(result.record(), indent=2, default=str))
    else:
        print(f"{r.name}: {r.status} - {r.summary}")
        if result.bad_nodes:
            print(f"bad node(s): {', '.join(result.bad_nodes)}")
        for f in r.findings:
            print(f"  {f.component}: {f.code} {f.message[:160]}")
    return {"passed": EXIT_PASSED, "failed": EXIT_FAILED}.get(str(r.status), EXIT_ERROR)
