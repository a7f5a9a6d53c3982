"""Slurm-facing commands: HealthCheckProgram/prolog/epilog hooks and manual reboot/replace/resume of a node.

The hooks answer from the agent's persisted state, never by running checks: Slurm kills a HealthCheckProgram at
60 s, and a prolog delays every job start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from argparse import Namespace

from nodemedic.actions.slurm import HYPERPOD_REASONS, SlurmBackend
from nodemedic.config import Config
from nodemedic.model import Health
from nodemedic.slurmctl import Slurm, SlurmError
from nodemedic.state import StateStore

JOBS_LOG = "slurm-jobs.jsonl"


def _backend(config: Config) -> SlurmBackend:
    return SlurmBackend(config.actions.slurm, config.state_dir, profile=config.profile,
                        dry_run=config.actions.dry_run)


def _verdict(config: Config):  # type: ignore[no-untyped-def]
    store = StateStore(config.state_dir)
    if not store.path.exists():
        return None
    return store.load()


def healthcheck(config: Config, args: Namespace) -> int:
    """Drain (through the backend, as the agent would) if the cached verdict is unhealthy; 0 healthy, 1 not."""
    state = _verdict(config)
    if state is None:
        print(f"nodemedic: no state at {config.state_dir}: the agent has not run here", file=sys.stderr)
        return 0
    verdict = state.verdict
    if verdict.health is Health.SCHEDULABLE:
        return 0
    try:
        _backend(config).apply(verdict)
    except SlurmError as exc:
        print(f"nodemedic: {verdict.health.value}, but Slurm could not be updated: {exc}", file=sys.stderr)
    print(f"nodemedic: {verdict.health.value} ({', '.join(verdict.fault_reasons)})")
    return 1


def prolog(config: Config, args: Namespace) -> int:
    """Refuse a job on a node the agent holds unhealthy (non-zero exit: Slurm requeues the job elsewhere)."""
    state = _verdict(config)
    if state is None or state.verdict.health is Health.SCHEDULABLE:
        return 0
    verdict = state.verdict
    try:
        _backend(config).apply(verdict)  # drain with our own reason first, so we can resume it later
    except SlurmError as exc:
        print(f"nodemedic: could not drain: {exc}", file=sys.stderr)
    print(f"nodemedic: refusing job {os.environ.get('SLURM_JOB_ID', '?')}: node is {verdict.health.value} "
          f"({', '.join(verdict.fault_reasons)})", file=sys.stderr)
    return 1


def epilog(config: Config, args: Namespace) -> int:
    """Record the job that just ended with the faults the agent holds and saw recently. Always succeeds."""
    state = _verdict(config)
    now = time.time()
    record = {"job_id": os.environ.get("SLURM_JOB_ID"), "user": os.environ.get("SLURM_JOB_USER"),
              "time": now, "health": state.verdict.health.value if state else None,
              "active": sorted(f.code for f in state.active.values()) if state else [],
              "recent": [h.model_dump(mode="json") for h in state.history if now - h.time < 3600] if state else []}
    try:
        config.state_dir.mkdir(parents=True, exist_ok=True)
        with open(config.state_dir / JOBS_LOG, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    except OSError as exc:  # an epilog failure would drain the node: never fail for bookkeeping
        print(f"nodemedic: could not record job: {exc}", file=sys.stderr)
    return 0


def node_command(config: Config, args: Namespace) -> int:
    """`nodemedic node reboot|replace|resume NODE`: the reasons recovery tooling keys on, set by a person."""
    cfg = config.actions.slurm
    slurm = Slurm(cfg.scontrol, cfg.timeout_s)
    node = args.node
    if args.node_command == "resume":
        cmd = slurm.command(node, "resume")
    else:
        health = Health.PENDING_REBOOT if args.node_command == "reboot" else Health.PENDING_REPLACEMENT
        if config.profile == "hyperpod":
            reason = HYPERPOD_REASONS[health]
        else:
            reason = f"{cfg.reason_prefix} operator requested {args.node_command}"
        state = "fail"
        if getattr(args, "force", False):
            # down kills the running jobs: only with a confirmation
            if not args.yes and not _confirm(f"Force-replace {node}: state=down kills its running jobs. Go on?"):
                print("not done", file=sys.stderr)
                return 1
            state = "down"
        cmd = slurm.command(node, state, reason)
    if config.actions.dry_run:
        print("dry run: would run " + " ".join(cmd))
        return 0
    try:
        slurm.execute(cmd)
    except SlurmError as exc:
        print(f"nodemedic: {exc}", file=sys.stderr)
        return 2
    print(" ".join(cmd))
    return 0


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        print(f"{question} (no terminal to ask: pass --yes)", file=sys.stderr)
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")
