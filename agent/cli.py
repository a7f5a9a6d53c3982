"""The `nodemedic` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from typing import Any, Sequence

from nodemedic import __version__
from nodemedic.config import Config, ConfigError, load_config

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_CANNOT_CHECK = 0, 1, 2


def _config(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {}
    if getattr(args, "state_dir", None):
        overrides["state_dir"] = args.state_dir
    if getattr(args, "kernel_log", None):
        overrides["checks.kernel_log.path"] = args.kernel_log
        overrides["checks.kernel_log.source"] = "kmsg" if args.kernel_log.startswith("/dev/kmsg") else "file"
    if getattr(args, "lookback", None) is not None:
        overrides["checks.kernel_log.lookback_s"] = args.lookback
    if getattr(args, "metrics_port", None) is not None:
        overrides["metrics.port"] = args.metrics_port
    if getattr(args, "node_name", None):
        overrides["node_name"] = args.node_name
    if getattr(args, "dry_run", False):
        overrides["actions.dry_run"] = True
    if getattr(args, "log_level", None):
        overrides["log_level"] = args.log_level
    return load_config(args.config, overrides=overrides)


# -- run ------------------------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from nodemedic.daemon import Agent, AgentAlreadyRunning
    from nodemedic.telemetry.logs import setup_logging

    config = _config(args)
    setup_logging(config.log_level)
    agent = Agent(config)
    try:
        agent.run_forever()
    except AgentAlreadyRunning as exc:
        logging.getLogger("nodemedic").error("%s", exc)
        return EXIT_CANNOT_CHECK
    return 0


# -- check ----------------------------------------------------------------------------------------------------------
def cmd_check(args: argparse.Namespace) -> int:
    from nodemedic.catalog import load_catalog
    from nodemedic.checks.base import Watcher
    from nodemedic.checks.platform.imds import Imds, resolve_instance_type
    from nodemedic.model import CHECK_FAILED, Health
    from nodemedic.policy import Policy, PolicyState
    from nodemedic.registry import applicable, build_checks, node_context
    from nodemedic.runner import CheckRunner

    config = _config(args)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr, format="%(levelname)s %(message)s")
    imds = Imds(config.imds.endpoint, config.imds.timeout_s) if config.imds.enabled else None
    ctx = node_context(config, resolve_instance_type(config.instance_type, imds))
    # One pass: pollers and watchers over a log; event streams (NVML events, DCGM policy) have no past to read.
    checks = [c for c in applicable(build_checks(config, ctx, imds), ctx)
              if not isinstance(c, Watcher) or c.scannable]
    policy = Policy(load_catalog(config.catalog), config.policy_config())
    state = PolicyState()
    runner = CheckRunner(lambda f: None)
    rows, failed = [], []
    now = time.time()
    for check in checks:
        findings = runner.run_once(check)
        failures = [f for f in findings if f.code == CHECK_FAILED and not f.healthy]
        failed += failures
        faults = [f for f in findings if f.code != CHECK_FAILED and not f.healthy]
        rows.append({"check": check.name, "status": "failed" if failures else "ok", "findings": len(faults),
                     "error": failures[0].evidence.get("reason") if failures else None})
        policy.observe_all(state, [f for f in findings if f.code != CHECK_FAILED], now)
    verdict = state.verdict
    if verdict.health is not Health.SCHEDULABLE:
        code = EXIT_UNHEALTHY
    elif failed or not checks:
        code = EXIT_CANNOT_CHECK
    else:
        code = EXIT_HEALTHY
    active = sorted(state.active.values(), key=lambda f: (-f.action, f.component))
    if args.json:
        print(json.dumps({"node": config.node_name, "instance_type": ctx.instance_type, "checks": rows,
                          "verdict": verdict.model_dump(mode="json"),
                          "faults": [f.model_dump(mode="json") for f in active], "exit_code": code}, indent=2))
        return code
    print(f"node {config.node_name} ({ctx.instance_type or 'instance type unknown'})")
    _table(["CHECK", "STATUS", "FINDINGS", "ERROR"],
           [[r["check"], r["status"], str(r["findings"]), r["error"] or ""] for r in rows])
    if active:
        print()
        _table(["COMPONENT", "CODE", "ACTION", "SOURCES", "COUNT", "MESSAGE"],
               [[f.component, f.code, _action(f), ",".join(f.sources), str(f.count), f.message[:80]]
                for f in active])
    print(f"\nverdict: {verdict.health.value}" + (f" ({verdict.action})" if verdict.action != "none" else ""))
    if not checks:
        print("no checks apply to this node")
    return code


# -- status ---------------------------------------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    from nodemedic.model import Health
    from nodemedic.state import AgentLock, StateStore

    config = _config(args)
    store = StateStore(config.state_dir)
    if not store.path.exists():
        print(f"no state at {store.path}: the agent has not run with this state dir", file=sys.stderr)
        return EXIT_CANNOT_CHECK
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr, format="%(levelname)s %(message)s")
    state = store.load()
    running = AgentLock(config.state_dir).held_by_other()
    v = state.verdict
    code = EXIT_HEALTHY if v.health is Health.SCHEDULABLE else EXIT_UNHEALTHY
    if args.json:
        print(json.dumps({"node": config.node_name, "agent_running": running,
                          "verdict": v.model_dump(mode="json"),
                          "active": [f.model_dump(mode="json") for f in state.active.values()],
                          "history": [h.model_dump(mode="json") for h in state.history[-args.history:]]},
                         indent=2))
        return code
    print(f"node {config.node_name}: {v.health.value}" + (f" (needs {v.action})" if v.action != "none" else ""))
    print(f"agent {'running' if running else 'not running'}; verdict generation {v.generation}, updated "
          f"{_ago(v.updated_at)}")
    if v.fault_reasons:
        print(f"fault types: {', '.join(v.fault_types)}; reasons: {', '.join(v.fault_reasons)}")
    if state.deep_run is not None:
        print(f"deep checks: {v.deep_check} (run {state.deep_run.run_id}, level {state.deep_run.level}, "
              f"{state.deep_run.trigger}, started {_ago(state.deep_run.started)})")
    elif v.deep_check:
        print(f"last deep-check run: {v.deep_check}")
    if state.active:
        print()
        _table(["COMPONENT", "CODE", "ACTION", "SOURCES", "COUNT", "FIRST SEEN", "LAST SEEN", "MESSAGE"],
               [[f.component, f.code, _action(f), ",".join(f.sources), str(f.count), _ago(f.first_seen),
                 _ago(f.last_seen), f.message[:60]]
                for f in sorted(state.active.values(), key=lambda f: -f.last_seen)])
    recent = state.history[-args.history:]
    if recent:
        print("\nrecent faults:")
        _table(["TIME", "COMPONENT", "CODE", "ACTION", "MESSAGE"],
               [[_ts(h.time), h.component, h.code, h.action, h.message[:60]] for h in reversed(recent)])
    return code


# -- diag -----------------------------------------------------------------------------------------------------------
def cmd_diag(args: argparse.Namespace) -> int:
    from nodemedic import diag_cli

    if getattr(args, "diag_command", None) == "cluster":
        return diag_cli.cmd_diag_cluster(args, _config(args))
    return diag_cli.cmd_diag(args, _config(args))


# -- replay ---------------------------------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    from nodemedic.catalog import load_catalog
    from nodemedic.checks.kernel_log.parser import KernelLogClassifier
    from nodemedic.checks.kernel_log.timestamps import parse_timestamp
    from nodemedic.model import Health
    from nodemedic.policy import Policy, PolicyState
    from nodemedic.telemetry.logs import detection_event

    config = _config(args)
    policy = Policy(load_catalog(config.catalog), config.policy_config())
    state = PolicyState()
    classifier = KernelLogClassifier()
    clock, wall, lines = 0.0, False, 0
    events = []
    try:
        fh = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8", errors="replace")
    except OSError as exc:
        print(f"cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return EXIT_CANNOT_CHECK
    with fh:
        for raw in fh:
            lines += 1
            line = raw.rstrip("\n")
            finding = classifier.classify(line, clock)
            if finding is None:
                continue
            ts = parse_timestamp(line, args.year)
            if ts is not None:
                clock, wall = max(clock, ts[0]) if ts[1] == wall else ts[0], ts[1]
            finding.observed_at = clock
            decision = policy.observe(state, finding, clock)
            if decision is None:
                continue
            event = detection_event(decision, config.node_name)
            event["line_number"] = lines
            event["when"] = _ts(clock) if wall else f"+{clock:.6f}s after boot"
            events.append(event)
            if not args.json:
                print(f"{event['when']:>26}  line {lines:<6} {decision.outcome.value:<15} {decision.code:<24} "
                      f"{decision.component:<24} {decision.action!s:<9} -> {decision.health_after.value}")
    v = state.verdict
    if args.json:
        print(json.dumps({"lines": lines, "decisions": events, "verdict": v.model_dump(mode="json")}, indent=2,
                         default=str))
    else:
        print(f"\n{lines} lines, {len(events)} decisions, {state.suppressed} repeats folded; final verdict: "
              f"{v.health.value}" + (f" ({', '.join(v.fault_reasons)})" if v.fault_reasons else ""))
    return EXIT_HEALTHY if v.health is Health.SCHEDULABLE else EXIT_UNHEALTHY


# -- inject ---------------------------------------------------------------------------------------------------------
_RECOVERY_NAMES = {0: "None", 1: "GPU Reset Required", 2: "Node Reboot Required", 3: "Drain P2P",
                   4: "Drain and Reset"}


def xid_line(xid: int, pci: str, message: str | None = None, recovery_action: int = 2) -> str:
    """A kernel line in the r535+ driver's format (kernel_rc.c), as the driver would print this Xid."""
    from nodemedic.catalog import load_catalog

    dom, bus, dev = _split_pci(pci)
    where = f"PCI:{dom}:{bus}:{dev}"
    if xid == 154:
        return (f"NVRM: Xid ({where}): 154, GPU recovery action changed from 0x0 (None) to "
                f"0x{recovery_action:x} ({_RECOVERY_NAMES.get(recovery_action, 'Unknown')})")
    if xid == 79:
        return f"NVRM: Xid ({where}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    text = message or load_catalog().get(f"XID_{xid}").title or "injected by nodemedic"
    return f"NVRM: Xid ({where}): {xid}, pid='<unknown>', name=<unknown>, {text}"


def _split_pci(pci: str) -> tuple[str, str, str]:
    parts = pci.lower().removeprefix("pci:").split(":")
    if len(parts) == 2:
        parts = ["0000"] + parts
    if len(parts) != 3:
        raise ValueError(f"PCI address {pci!r} is not DOMAIN:BUS:DEVICE[.FN]")
    dom, bus, dev = parts
    dev = dev.split(".")[0]
    int(dom, 16), int(bus, 16), int(dev, 16)
    return f"{int(dom, 16):04x}", f"{int(bus, 16):02x}", f"{int(dev, 16):02x}"


def cmd_inject(args: argparse.Namespace) -> int:
    try:
        if args.what == "xid":
            text = xid_line(args.number, args.pci, args.message, args.recovery_action)
        else:
            text = args.text
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CANNOT_CHECK
    target = args.to
    if target is None:
        config = _config(args)
        target = config.checks.kernel_log.path
    if not target:
        print("name the log file to append to with --to (or set checks.kernel_log.path)", file=sys.stderr)
        return EXIT_CANNOT_CHECK
    if target.startswith("/dev/kmsg"):
        record = f"<4>{text}\n"
    else:
        stamp = time.strftime("%b %e %H:%M:%S", time.gmtime())
        record = f"{stamp} {socket.gethostname()} kernel: {text}\n"
    try:
        with open(target, "a", encoding="utf-8") as fh:
            fh.write(record)
    except OSError as exc:
        print(f"cannot write to {target}: {exc.strerror}", file=sys.stderr)
        return EXIT_CANNOT_CHECK
    print(record.rstrip("\n"))
    return 0


# -- clear ----------------------------------------------------------------------------------------------------------
def cmd_clear(args: argparse.Namespace) -> int:
    from nodemedic.catalog import load_catalog
    from nodemedic.daemon import apply_command, write_command
    from nodemedic.policy import Policy
    from nodemedic.state import AgentLock, StateStore

    if not (args.code or args.component or args.all):
        print("say what to clear: --code, --component, or --all", file=sys.stderr)
        return EXIT_CANNOT_CHECK
    config = _config(args)
    cmd = {"command": "clear", "code": args.code, "component": args.component}
    store = StateStore(config.state_dir)
    with store.locked():
        if not AgentLock(config.state_dir).held_by_other():
            state = store.load()
            policy = Policy(load_catalog(config.catalog), config.policy_config())
            decisions = apply_command(policy, state, cmd, time.time())
            store.save(state)
            print(f"cleared {len(decisions)} fault(s); node is {state.verdict.health.value}")
            return 0
    path = write_command(config.state_dir, cmd)
    deadline = time.monotonic() + args.wait
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if path.exists():
        print(f"the running agent has not taken the command yet; it stays queued at {path}", file=sys.stderr)
        return EXIT_UNHEALTHY
    state = store.load()
    print(f"the running agent applied it; node is {state.verdict.health.value}")
    return 0


# -- slurm ----------------------------------------------------------------------------------------------------------
def _slurm_hook(name: str):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace) -> int:
        from nodemedic import slurm_commands

        return int(getattr(slurm_commands, name)(_config(args), args))
    return run


# -- helpers --------------------------------------------------------------------------------------------------------
def _action(fault: Any) -> str:
    text = str(fault.action)
    if fault.held_action is not None:
        text += f" (wants {fault.held_action}: needs a second source)"
    return text + ("" if fault.enforced else " (observe)")


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _ts(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else "-"


def _ago(t: float) -> str:
    if not t:
        return "never"
    d = max(0, time.time() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= size:
            return f"{d / size:.0f}{unit} ago"
    return f"{d:.0f}s ago"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nodemedic", description="Per-node health agent for accelerator clusters")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", help="YAML config file (default $NODEMEDIC_CONFIG or /etc/nodemedic/nodemedic.yaml)")
        sp.add_argument("--state-dir", help="where the agent keeps its state")

    sp = sub.add_parser("run", help="run the agent in the foreground")
    common(sp)
    sp.add_argument("--kernel-log", help="follow this file (or /dev/kmsg) instead of finding the kernel log")
    sp.add_argument("--lookback", type=float, help="on start, also read this many seconds back")
    sp.add_argument("--metrics-port", type=int)
    sp.add_argument("--node-name")
    sp.add_argument("--dry-run", action="store_true", help="decide and log, but apply nothing")
    sp.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("check", help="one pass of every applicable passive check (exit 0 healthy, 1 unhealthy, "
                                      "2 could not check)")
    common(sp)
    sp.add_argument("--kernel-log", help="read this file instead of this boot's kernel log")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_check)

    sp = sub.add_parser("status", help="the current verdict and recent faults from the state store")
    common(sp)
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--history", type=int, default=10, help="how many recent faults to show")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("diag", help="run the active deep checks now (exit 0 passed, 1 failed, 2 could not run)")
    common(sp)
    sp.add_argument("--level", type=int, choices=[2, 4], help="2: minutes (default), 4: the full hours-long run")
    sp.add_argument("--only", nargs="+", metavar="NAME", help="just these tests or families (stress, stress.cpu, "
                                                               "dcgm, nccl, efa, gpu, neuron); --list shows them")
    sp.add_argument("--list", action="store_true", help="list the tests this node would run, and their limits")
    sp.add_argument("--no-hold", action="store_true", help="do not hold the node out of scheduling while testing")
    sp.add_argument("--background", action="store_true", help="ask the running agent to run them instead")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sp.set_defaults(func=cmd_diag)
    dsub = sp.add_subparsers(dest="diag_command")
    cp = dsub.add_parser("cluster", help="NCCL all-reduce across nodes through srun (bisects a failing group to "
                                         "name the bad nodes), or --kubernetes: print the Job that runs it")
    common(cp)
    cp.add_argument("--nodes", required=True, help="Slurm hostlist, e.g. gpu[01-16]")
    cp.add_argument("--tasks-per-node", type=int, help="ranks (GPUs) per node (default 8)")
    cp.add_argument("--threshold", type=float, help="bus bandwidth GB/s (default: the instance type's)")
    cp.add_argument("--binary", help="nccl-tests all_reduce_perf (MPI build); absent -> the torch worker")
    cp.add_argument("--torch", action="store_true", help="use the built-in torch.distributed worker")
    cp.add_argument("--min-bytes")
    cp.add_argument("--max-bytes")
    cp.add_argument("--gpus-per-task", type=int, default=1, help="srun --gpus-per-task (0: leave it out)")
    cp.add_argument("--mpi", help="srun --mpi (e.g. pmix) for nccl-tests' MPI build")
    cp.add_argument("--srun-arg", action="append", help="extra srun argument (repeatable), e.g. --partition=p5")
    cp.add_argument("--timeout", type=float, default=900.0, help="seconds for each srun step")
    cp.add_argument("--no-bisect", action="store_true", help="report the group's verdict only")
    cp.add_argument("--kubernetes", action="store_true", help="print a Service + Indexed Job manifest instead")
    cp.add_argument("--image", help="container image for --kubernetes")
    cp.add_argument("--namespace", default="default")
    cp.add_argument("--efa-per-node", type=int, help="vpc.amazonaws.com/efa to request per pod")
    cp.add_argument("--json", action="store_true")
    cp.add_argument("-v", "--verbose", action="store_true")
    cp.set_defaults(func=cmd_diag)

    sp = sub.add_parser("replay", help="feed a recorded kernel log through detection and policy, no side effects")
    common(sp)
    sp.add_argument("file", help="kernel log file, or - for standard input")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--year", type=int, help="year for syslog timestamps that carry none (default: this year)")
    sp.set_defaults(func=cmd_replay)

    sp = sub.add_parser("inject", help="append a realistic fault line to a watched log file")
    common(sp)
    isub = sp.add_subparsers(dest="what", required=True)
    xp = isub.add_parser("xid", help="an NVIDIA Xid line")
    xp.add_argument("number", type=int)
    xp.add_argument("--pci", required=True, help="GPU PCI address, e.g. 0000:3b:00.0")
    xp.add_argument("--message", help="the text after the Xid number")
    xp.add_argument("--recovery-action", type=int, default=2, help="for Xid 154: the new recovery action (0-4)")
    xp.add_argument("--to", help="log file to append to (or /dev/kmsg as root)")
    lp = isub.add_parser("line", help="any kernel line")
    lp.add_argument("text")
    lp.add_argument("--to", help="log file to append to (or /dev/kmsg as root)")
    sp.set_defaults(func=cmd_inject)

    sp = sub.add_parser("clear", help="operator recovery: clear active faults")
    common(sp)
    sp.add_argument("--code", help="only faults with this code, e.g. XID_79")
    sp.add_argument("--component", help="only faults on this component, e.g. gpu:0000:3b:00.0")
    sp.add_argument("--all", action="store_true", help="every active fault")
    sp.add_argument("--wait", type=float, default=10.0, help="seconds to wait for a running agent to apply it")
    sp.set_defaults(func=cmd_clear)

    sp = sub.add_parser("slurm", help="Slurm integration: scheduler hooks and the job's node list")
    ssub = sp.add_subparsers(dest="slurm_command", required=True)
    np_ = ssub.add_parser("nodelist", help="the running job's current nodes, master node and address "
                                          "(from scontrol, not the stale SLURM_JOB_NODELIST)")
    np_.add_argument("--job", help="job id (default $SLURM_JOB_ID)")
    np_.add_argument("--format", choices=["shell", "json", "hosts"], default="shell")
    np_.add_argument("--timeout", type=float, default=30.0, help="seconds for each scontrol call")
    np_.set_defaults(func=lambda args: __import__("nodemedic.slurm_nodelist", fromlist=["main"]).main(args))

    for hook, help_ in (("healthcheck", "HealthCheckProgram: drain from the agent's cached verdict (well under 1 s)"),
                        ("prolog", "Prolog: refuse a job on a node the agent holds unhealthy"),
                        ("epilog", "Epilog: record the job id with the faults found around it")):
        hp = ssub.add_parser(hook, help=help_)
        common(hp)
        hp.set_defaults(func=_slurm_hook(hook))

    sp = sub.add_parser("node", help="manual recovery of a Slurm node: the reasons recovery tooling keys on")
    common(sp)
    nsub = sp.add_subparsers(dest="node_command", required=True)
    for verb, help_ in (("reboot", "set the node to be rebooted (hyperpod: state=fail reason=Action:Reboot)"),
                        ("replace", "set the node to be replaced (hyperpod: state=fail reason=Action:Replace)"),
                        ("resume", "return the node to service")):
        vp = nsub.add_parser(verb, help=help_)
        vp.add_argument("node")
        if verb == "replace":
            vp.add_argument("--force", action="store_true", help="state=down: kills running jobs (asks first)")
            vp.add_argument("--yes", action="store_true", help="do not ask")
        vp.add_argument("--dry-run", action="store_true", help="print the scontrol command only")
    sp.set_defaults(func=_slurm_hook("node_command"))

    sp = sub.add_parser("version", help="print the version")
    sp.set_defaults(func=lambda args: print(f"nodemedic {__version__}") or 0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not hasattr(args, "config"):
        args.config = None
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"nodemedic: {exc}", file=sys.stderr)
        return EXIT_CANNOT_CHECK
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
