"""The multi-node deep check: one NCCL all-reduce across a group of nodes, and a bisection that names the bad ones.

On Slurm the group runs as one `srun` step (nccl-tests' MPI build with one GPU per rank when `all_reduce_perf` is
given and present, else the built-in torch.distributed worker, `nodemedic.checks.active.torch_allreduce`); rank 0's
nccl-tests-style output is parsed and judged by `nccl.judge`. A group that fails is split into pairs, and each member
of a failing pair is tested against a node from a passing pair, so one slow or corrupting node is named instead of
failing everyone. A run that could not reach a verdict (ERROR, SKIPPED) never blames a node.

On Kubernetes, `render_k8s_job` gives a headless Service and an Indexed Job that run the same worker, one pod per node.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from nodemedic.checks.active import nccl
from nodemedic.checks.active.base import DeepCheckResult, Status, tail, unavailable_status
from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import check_cancelled, find_tool, run_tool
from nodemedic.model import Finding, Severity

CHECK = "nccl.cluster"
WORKER_MODULE = "nodemedic.checks.active.torch_allreduce"
DEFAULT_PORT = 29517
JOB_NAME = "nodemedic-nccl-cluster"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
HEALTH_TAINT = "node-health-status"  # agent/actions/kubernetes.py: f"{prefix}node-health-status"
DEFAULT_TAINT_PREFIX = "nodemedic.io/"
_NO_TORCH = "cannot import torch"  # torch_allreduce's failure line when a rank has no torch

RunGroup = Callable[[list[str]], DeepCheckResult]


# -- Slurm hostlists ----------------------------------------------------------------------------------------------

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _split_top(expr: str) -> list[str]:
    """Split on commas outside brackets: `a[1,3],b` -> [`a[1,3]`, `b`]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expr!r}")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append(expr[start:])
    return [p.strip() for p in parts if p.strip()]


def _range_values(spec: str, expr: str) -> list[str]:
    """`01-03,7` -> ["01", "02", "03", "7"]: zero padding follows the lower bound, as Slurm's does."""
    values: list[str] = []
    for item in spec.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in hostlist {expr!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in hostlist {expr!r}")
        width = len(lo) if lo.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def _expand_one(term: str, expr: str) -> list[str]:
    m = _BRACKET.search(term)
    if m is None:
        if "[" in term or "]" in term:
            raise ValueError(f"bad hostlist term {term!r} in {expr!r}")
        return [term]
    head, tail = term[:m.start()], term[m.end():]
    # Several bracket groups multiply out, leftmost varying slowest (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2).
    return [f"{head}{v}{rest}" for v in _range_values(m[1], expr) for rest in _expand_one(tail, expr)]


def parse_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist (`node[01-04],gpu7`) in pure Python; duplicates dropped, order kept."""
    hosts: list[str] = []
    for term in _split_top(expr.strip()):
        for host in _expand_one(term, expr):
            if host not in hosts:
                hosts.append(host)
    if not hosts:
        raise ValueError(f"empty hostlist {expr!r}")
    return hosts


def expand_hostlist(expr: str | Sequence[str], scontrol: str = "scontrol", timeout_s: float = 10.0,
                    env: dict[str, str] | None = None) -> list[str]:
    """Hosts of a hostlist expression: `scontrol show hostnames` when it answers (Slurm's own parser knows every
    form), else the pure-Python parser. A list is taken as hosts (each may itself be an expression)."""
    if not isinstance(expr, str):
        expr = ",".join(expr)
    if "[" not in expr:
        return parse_hostlist(expr)  # nothing for scontrol to add
    try:
        out = run_tool([scontrol, "show", "hostnames", expr], timeout_s, env=env)
    except CheckUnavailable:
        return parse_hostlist(expr)
    hosts = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return hosts if out.returncode == 0 and hosts else parse_hostlist(expr)


_NUMBERED = re.compile(r"^(?P<prefix>.*?)(?P<num>\d+)$")


def compress_hostlist(hosts: Sequence[str]) -> str:
    """The inverse for the common case: `node01,node02,node03,gpu7` -> `node[01-03],gpu7` (order of first
    appearance per prefix; Slurm orders a step's tasks by its own node order anyway)."""
    groups: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[str, int] | str] = []
    for host in hosts:
        m = _NUMBERED.match(host)
        if m is None:
            order.append(host)
            continue
        num = m["num"]
        key = (m["prefix"], len(num) if num.startswith("0") and len(num) > 1 else 0)
        if key not in groups:
            groups[key] = []
            order.append(key)
        if int(num) not in groups[key]:
            groups[key].append(int(num))
    parts = []
    for item in order:
        if isinstance(item, str):
            parts.append(item)
            continue
        (prefix, width), nums = item, sorted(groups[item])
        ranges = _ranges(nums)
        if len(nums) == 1:
            parts.append(f"{prefix}{str(nums[0]).zfill(width)}")
        else:
            parts.append(prefix + "[" + ",".join(
                str(lo).zfill(width) if lo == hi else f"{str(lo).zfill(width)}-{str(hi).zfill(width)}"
                for lo, hi in ranges) + "]")
    return ",".join(parts)


def _ranges(nums: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for n in nums:
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out


# -- the srun step ------------------------------------------------------------------------------------------------

def build_srun_command(nodes: Sequence[str], tasks_per_node: int, *, binary: str | None = "all_reduce_perf",
                       srun: str = "srun", min_bytes: str = "1G", max_bytes: str = "16G", gpus_per_task: int = 1,
                       mpi: str | None = None, extra_srun_args: Sequence[str] = (), master_addr: str | None = None,
                       master_port: int = DEFAULT_PORT, python: str = sys.executable, backend: str = "auto",
                       iters: int | None = None, time_limit_s: float | None = None,
                       job_name: str = JOB_NAME) -> list[str]:
    """The srun command line for one all-reduce across `nodes`, `tasks_per_node` ranks (one GPU each) per node.

    `binary` is used when it resolves (an absolute path or on PATH): nccl-tests' MPI build, `-g 1` per rank, which
    needs srun's PMI (`mpi`, e.g. "pmix", when the site's MpiDefault is not). Otherwise the built-in torch worker
    runs, its ranks meeting at `master_addr:master_port` (the first node by default).
    """
    if not nodes:
        raise ValueError("no nodes")
    if tasks_per_node < 1:
        raise ValueError("tasks_per_node must be at least 1")
    args = [srun, f"--nodes={len(nodes)}", f"--nodelist={compress_hostlist(nodes)}",
            f"--ntasks-per-node={tasks_per_node}", f"--ntasks={len(nodes) * tasks_per_node}",
            # One rank's death ends the step at once instead of leaving the others blocked in a collective.
            "--kill-on-bad-exit=1", "--label", f"--job-name={job_name}"]
    if time_limit_s is not None:
        # Slurm's own limit, so that the step's tasks end even if srun itself is lost (SIGKILLed, its host gone).
        args.append(f"--time={max(1, math.ceil(time_limit_s / 60))}")
    if gpus_per_task > 0:
        args.append(f"--gpus-per-task={gpus_per_task}")
    if mpi:
        args.append(f"--mpi={mpi}")
    args.extend(extra_srun_args)
    exe = find_tool(binary) if binary else None
    if exe is not None:
        return [*args, exe, "-b", min_bytes, "-e", max_bytes, "-f", "2", "-g", "1",
                *(["-n", str(iters)] if iters else [])]
    worker = [python, "-m", WORKER_MODULE, "--backend", backend, "--min-bytes", min_bytes, "--max-bytes", max_bytes,
              "--factor", "2", *(["--iters", str(iters)] if iters else [])]
    if time_limit_s is not None:
        worker += ["--timeout-s", f"{time_limit_s:g}"]  # each rank's own watchdog: a hung peer ends the rank too
    return [*args, *worker, "--master-addr", master_addr or nodes[0], "--master-port", str(master_port)]



def run_group(nodes: Sequence[str], *, tasks_per_node: int = 8, threshold_busbw_gbs: float | None = None,
              timeout_s: float = 900.0, env: dict[str, str] | None = None, **command: Any) -> DeepCheckResult:
    """Run one all-reduce step across `nodes` and judge it (nccl.judge: bandwidth and correctness).

    SKIPPED when srun is not installed; ERROR when the step timed out, was cancelled, exited non-zero without a
    wrong-results verdict or printed no complete table; FAILED on wrong results or bus bandwidth below threshold.
    `command` goes to build_srun_command (binary, srun, min/max bytes, gpus_per_task, mpi, master_addr, ...).
    """
    nodes = list(nodes)
    started = time.monotonic()
    command.setdefault("time_limit_s", timeout_s)
    args = build_srun_command(nodes, tasks_per_node, **command)
    evidence: dict[str, Any] = {"command": args, "nodes": nodes}
    try:
        out = run_tool(args, timeout_s, env=step_env(env))
    except CheckUnavailable as exc:
        # No srun: not a Slurm host (SKIPPED); a timeout or cancel: the group never reached a verdict (ERROR).
        # run_tool has already killed srun's process group; srun's SIGTERM handler cancels the step's tasks.
        return DeepCheckResult(CHECK, unavailable_status(exc), f"{exc} ({_describe(nodes, tasks_per_node)})",
                               evidence=evidence, duration_s=time.monotonic() - started)
    run = nccl.parse_allreduce(out.output)
    if not run.rows and WORKER_MODULE in args and _NO_TORCH in out.output:
        # The built-in worker, with no nccl-tests, needs torch on the nodes: not installed means not runnable here.
        summary = (f"torch is not installed on the nodes (pip install nodemedic[torch]) and no nccl-tests binary "
                   f"was given ({_describe(nodes, tasks_per_node)})")
        return DeepCheckResult(CHECK, Status.SKIPPED, summary,
                               evidence={**evidence, "returncode": out.returncode, "output_tail": tail(out.output, 40)},
                               duration_s=time.monotonic() - started)
    result = nccl.judge(run, threshold_busbw_gbs, nodes=len(nodes), devices=len(nodes) * tasks_per_node)
    if out.returncode != 0 and result.status is not Status.FAILED:
        # A step that exits non-zero never passes, whatever rank 0 printed before the others died.
        result.status = Status.ERROR
        result.summary = f"srun exited {out.returncode}: {result.summary}"
    result.name = CHECK
    result.summary = f"{_describe(nodes, tasks_per_node)}: {result.summary}"
    result.evidence = {**evidence, "returncode": out.returncode, "output_tail": tail(out.output, 40)}
    result.duration_s = time.monotonic() - started
    return result


# torchrun-style variables a caller may carry (nodemedic started from inside a training job): srun exports the
# environment to every task, and the worker would take these over SLURM_PROCID/SLURM_NTASKS.
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def step_env(env: dict[str, str] | None) -> dict[str, str]:
    """The environment srun runs with: the caller's, less any rank variables of its own."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in _RANK_VARS}


def _describe(nodes: Sequence[str], tasks_per_node: int) -> str:
    return f"{len(nodes)} node(s) {compress_hostlist(nodes)} x {tasks_per_node} rank(s)"


# -- bisection ----------------------------------------------------------------------------------------------------

@dataclass
class PairRun:
    """One run of the bisection: which nodes, what it said."""

    nodes: list[str]
    status: Status
    summary: str
    max_busbw_gbs: float | None
    code: str | None              # the judge's finding code when FAILED
    purpose: str                  # "pair", "odd-one-out" or "vs-known-good"

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "status": str(self.status), "summary": self.summary,
                "max_busbw_gbs": self.max_busbw_gbs, "code": self.code, "purpose": self.purpose}


@dataclass
class BisectResult:
    bad_nodes: list[str] = field(default_factory=list)
    good_nodes: list[str] = field(default_factory=list)     # passed at least one run
    unverified: list[str] = field(default_factory=list)     # no verdict: their runs errored, or no reference
    runs: list[PairRun] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    conclusion: str = ""

    def record(self) -> dict[str, Any]:
        return {"bad_nodes": self.bad_nodes, "good_nodes": self.good_nodes, "unverified": self.unverified,
                "conclusion": self.conclusion, "runs": [r.to_dict() for r in self.runs],
                "findings": [f.to_dict() for f in self.findings]}


def _code(result: DeepCheckResult) -> str | None:
    return result.findings[0].code if result.findings else None


class _Bisector:
    def __init__(self, run_group: RunGroup):
        self.run_group = run_group
        self.out = BisectResult()

    def run(self, nodes: list[str], purpose: str) -> DeepCheckResult:
        check_cancelled("cluster bisection")
        result = self.run_group(nodes)
        self.record(nodes, result, purpose)
        return result

    def record(self, nodes: list[str], result: DeepCheckResult, purpose: str) -> None:
        self.out.runs.append(PairRun(list(nodes), result.status, result.summary,
                                     result.metrics.get("NcclMaxAlgoBw"), _code(result), purpose))


def bisect(nodes: Sequence[str], run_group: RunGroup, group: DeepCheckResult | None = None) -> BisectResult:
    """Name the node(s) that make a failed group fail, by pairs.

    Pairs (n0,n1),(n2,n3)...; an odd one out runs with a node from a passing pair. Each member of a failing pair runs
    against a known-good node (from a passing pair): a member that fails there is bad. With no passing pair there is
    no reference, so no single node is blamed. Only FAILED runs blame; ERROR/SKIPPED runs leave nodes unverified.
    `group`, when it is the result for exactly one pair (two nodes), is reused instead of running that pair again.
    """
    nodes = list(dict.fromkeys(nodes))
    b = _Bisector(run_group)
    out = b.out
    if len(nodes) < 2:
        out.unverified = nodes
        out.conclusion = "fewer than two nodes: nothing to pair"
        return out
    pairs = [nodes[i:i + 2] for i in range(0, len(nodes) - 1, 2)]
    odd = nodes[-1] if len(nodes) % 2 else None
    results: list[DeepCheckResult] = []
    for pair in pairs:
        if group is not None and len(nodes) == 2:
            b.record(pair, group, "pair")
            results.append(group)
        else:
            results.append(b.run(pair, "pair"))
    good = [n for pair, r in zip(pairs, results) if r.status is Status.PASSED for n in pair]
    failing = [(pair, r) for pair, r in zip(pairs, results) if r.status is Status.FAILED]
    errored = [n for pair, r in zip(pairs, results) if r.status not in (Status.PASSED, Status.FAILED) for n in pair]

    if not good:
        out.unverified = nodes
        out.conclusion = ("no pair passed, so there is no known-good node to test against: the fault is shared "
                          "(fabric, switch, configuration) or bad nodes sit in every pair; no single node is blamed")
        return out
    reference = good[0]
    verdicts: dict[str, DeepCheckResult] = {}
    suspects = [n for pair, _ in failing for n in pair] + ([odd] if odd else [])
    for node in suspects:
        verdicts[node] = b.run([node, reference], "odd-one-out" if node == odd else "vs-known-good")
    pair_of = {n: (pair, r) for pair, r in failing for n in pair}
    for node in suspects:
        result = verdicts[node]
        if result.status is Status.FAILED:
            out.bad_nodes.append(node)
            out.findings.append(_blame(node, reference, result, pair_of.get(node)))
        elif result.status is Status.PASSED:
            good.append(node)
        else:
            errored.append(node)
    out.good_nodes = [n for n in nodes if n in good and n not in out.bad_nodes]
    out.unverified = [n for n in nodes if n in errored and n not in out.bad_nodes and n not in good]
    out.conclusion = _conclusion(out, failing)
    return out


def _blame(node: str, reference: str, result: DeepCheckResult, pair: tuple[list[str], DeepCheckResult] | None
           ) -> Finding:
    judged = result.findings[0] if result.findings else None
    code = judged.code if judged else nccl.BUSBW_LOW
    severity = judged.severity if judged else Severity.ERROR
    evidence: dict[str, Any] = {
        "vs_known_good": {"nodes": [node, reference], "summary": result.summary,
                          "max_busbw_gbs": result.metrics.get("NcclMaxAlgoBw"),
                          "threshold_gbs": result.metrics.get("NcclThresholdAlgoBw")},
        "known_good": reference,
    }
    if pair is not None:
        evidence["pair"] = {"nodes": pair[0], "summary": pair[1].summary,
                            "max_busbw_gbs": pair[1].metrics.get("NcclMaxAlgoBw")}
    what = "wrong results" if code == nccl.WRONG_RESULTS else "low bus bandwidth"
    message = f"node {node} fails the all-reduce with known-good {reference} ({what}): {result.summary}"
    return Finding(CHECK, f"node:{node}", code, message, severity, evidence)


def _conclusion(out: BisectResult, failing: list[tuple[list[str], DeepCheckResult]]) -> str:
    parts = []
    if out.bad_nodes:
        parts.append(f"bad: {', '.join(out.bad_nodes)}")
    cleared = [p for p, _ in failing if not any(n in out.bad_nodes for n in p)
               and all(n in out.good_nodes for n in p)]
    if cleared:
        parts.append("failed together but each passed with a known-good node (a pair-specific path or a flaky "
                     f"run), not blamed: {'; '.join(','.join(p) for p in cleared)}")
    if out.unverified:
        parts.append(f"no verdict (runs errored): {', '.join(out.unverified)}")
    if not failing and not out.bad_nodes:
        parts.append("every pair passed: the group's failure needs the whole group (scale, topology), "
                     "no single node is blamed")
    return "; ".join(parts) or "no node blamed"


# -- the whole check ----------------------------------------------------------------------------------------------

@dataclass
class ClusterResult:
    result: DeepCheckResult                 # the overall verdict, named nccl.cluster
    group: DeepCheckResult                  # the all-nodes run
    bisection: BisectResult | None = None
    bad_nodes: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """One JSON-able record for the deep-check log."""
        return {**self.result.record(), "group": self.group.record(), "bad_nodes": self.bad_nodes,
                "bisection": self.bisection.record() if self.bisection else None}


def run_cluster(nodes: str | Sequence[str], *, tasks_per_node: int = 8, threshold_busbw_gbs: float | None = None,
                pair_threshold_busbw_gbs: float | None = None, instance_type: str | None = None,
                bisect_on_failure: bool = True, timeout_s: float = 900.0, pair_timeout_s: float | None = None,
                env: dict[str, str] | None = None, run: Callable[..., DeepCheckResult] = run_group,
                **command: Any) -> ClusterResult:
    """Run the all-reduce across `nodes` (a hostlist expression or a list); bisect a FAILED group into pairs.

    Thresholds: `threshold_busbw_gbs` for the group (default: the instance type's, nccl_thresholds.yaml) and
    `pair_threshold_busbw_gbs` for the two-node runs (default: the instance type's multi_node value, else the
    group's). `command` is passed to build_srun_command through run_group.
    """
    started = time.monotonic()
    hosts = expand_hostlist(nodes, env=env) if isinstance(nodes, str) else list(dict.fromkeys(nodes))
    if threshold_busbw_gbs is None:
        threshold_busbw_gbs = nccl.threshold_for(instance_type, len(hosts))
    if pair_threshold_busbw_gbs is None:
        pair_threshold_busbw_gbs = nccl.threshold_for(instance_type, 2) if instance_type else None
        pair_threshold_busbw_gbs = pair_threshold_busbw_gbs if pair_threshold_busbw_gbs is not None \
            else threshold_busbw_gbs

    group = run(hosts, tasks_per_node=tasks_per_node, threshold_busbw_gbs=threshold_busbw_gbs,
                timeout_s=timeout_s, env=env, **command)

    def pair_run(pair: list[str]) -> DeepCheckResult:
        return run(pair, tasks_per_node=tasks_per_node, threshold_busbw_gbs=pair_threshold_busbw_gbs,
                   timeout_s=pair_timeout_s or timeout_s, env=env, **command)

    bisection = None
    if group.status is Status.FAILED and bisect_on_failure and len(hosts) >= 2:
        try:
            bisection = bisect(hosts, pair_run, group=group)
        except CheckUnavailable as exc:  # cancelled between runs: the group's own verdict stands, unnamed
            bisection = BisectResult(unverified=hosts, conclusion=f"bisection stopped: {exc}")
    overall = _overall(hosts, group, bisection)
    overall.duration_s = time.monotonic() - started
    return ClusterResult(overall, group, bisection, list(bisection.bad_nodes) if bisection else [])


def _overall(hosts: list[str], group: DeepCheckResult, bisection: BisectResult | None) -> DeepCheckResult:
    metrics = {**group.metrics, "nodes": hosts}
    evidence = {"group": group.evidence}
    if group.status is not Status.FAILED:
        return DeepCheckResult(CHECK, group.status, group.summary, [], metrics, evidence)
    if bisection is not None:
        evidence["bisection"] = bisection.record()
    if bisection is not None and bisection.bad_nodes:
        summary = f"{group.summary}; bisection names {', '.join(bisection.bad_nodes)}"
        return DeepCheckResult(CHECK, Status.FAILED, summary, list(bisection.findings), metrics, evidence)
    # No single node to blame: the group's own finding stands, attributed to the group, with the reason why.
    why = bisection.conclusion if bisection is not None else "not bisected"
    findings = [Finding(CHECK, f"nodes:{compress_hostlist(hosts)}", f.code, f"{f.message} ({why})", f.severity,
                        {**f.evidence, "nodes": hosts, "bisection": why}) for f in group.findings]
    return DeepCheckResult(CHECK, Status.FAILED, f"{group.summary}; {why}", findings, metrics, evidence)


# -- Kubernetes ---------------------------------------------------------------------------------------------------

# Each pod starts one worker per local rank: rank = node index * ranks per node + local rank. Every worker's
# status counts; node 0 then judges local rank 0's output so the Job's own success is the verdict.
_POD_SCRIPT = """\
set -u
T={tasks}
i=0
pids=""
while [ "$i" -lt "$T" ]; do
  RANK=$((NODE_RANK * T + i)) LOCAL_RANK=$i LOCAL_WORLD_SIZE=$T {worker} > /tmp/rank-$i.out 2>&1 &
  pids="$pids $!"
  i=$((i + 1))
done
rc=0
for p in $pids; do wait "$p" || rc=$?; done
cat /tmp/rank-*.out
if [ "$NODE_RANK" = 0 ]; then
  exec {judge} --returncode "$rc" /tmp/rank-0.out
fi
exit "$rc"
"""


def render_k8s_job(nodes: str | Sequence[str], *, image: str, namespace: str = "default", name: str = JOB_NAME,
                   gpus_per_node: int = 8, tasks_per_node: int | None = None, min_bytes: str = "1G",
                   max_bytes: str = "16G", threshold_busbw_gbs: float | None = None,
                   service_account: str | None = None, efa_per_node: int | None = None,
                   master_port: int = DEFAULT_PORT, taint_prefix: str = DEFAULT_TAINT_PREFIX,
                   ttl_seconds_after_finished: int = 3600, active_deadline_s: int = 1800,
                   python: str = "python", backend: str = "nccl", image_pull_policy: str | None = None
                   ) -> list[dict[str, Any]]:
    """A headless Service and an Indexed Job running the all-reduce across `nodes`, one pod per node.

    The pods may land only on `nodes` (nodeAffinity on kubernetes.io/hostname) and never two on one node
    (podAntiAffinity), so the N pods cover exactly the N nodes; which index lands on which node is the scheduler's,
    and the rank lines in the output name the hosts. Pod `<name>-0` is rank 0, reachable as `<name>-0.<service>`.
    They tolerate nodemedic's health taint and cordoning, so nodes held out for deep checks can run them.
    """
    hosts = parse_hostlist(nodes) if isinstance(nodes, str) else list(dict.fromkeys(nodes))
    tasks = tasks_per_node or gpus_per_node
    service = name
    labels = {"app.kubernetes.io/name": "nodemedic", "app.kubernetes.io/component": "nccl-cluster",
              "nodemedic.io/job": name}
    worker = [python, "-m", WORKER_MODULE, "--backend", backend, "--min-bytes", min_bytes, "--max-bytes",
              max_bytes, "--factor", "2"]
    judge = [python, "-m", __name__, "judge", "--nodes", str(len(hosts)), "--devices", str(len(hosts) * tasks)]
    if threshold_busbw_gbs is not None:
        judge += ["--threshold", f"{threshold_busbw_gbs:g}"]
    script = _POD_SCRIPT.format(tasks=tasks, worker=shlex.join(worker), judge=shlex.join(judge))

    resources: dict[str, Any] = {}
    if gpus_per_node:
        resources["nvidia.com/gpu"] = gpus_per_node
    if efa_per_node:
        resources["vpc.amazonaws.com/efa"] = efa_per_node
    container: dict[str, Any] = {
        "name": "allreduce", "image": image, "command": ["/bin/sh", "-c", script],
        "env": [
            {"name": "NODE_RANK", "valueFrom": {"fieldRef": {
                "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
            {"name": "WORLD_SIZE", "value": str(len(hosts) * tasks)},
            {"name": "MASTER_ADDR", "value": f"{name}-0.{service}"},
            {"name": "MASTER_PORT", "value": str(master_port)},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "ports": [{"name": "rendezvous", "containerPort": master_port}],
        "resources": {"limits": dict(resources), "requests": dict(resources)} if resources else {},
        # NCCL's shared-memory transport between local ranks outgrows a container's default 64 MiB /dev/shm.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if image_pull_policy:
        container["imagePullPolicy"] = image_pull_policy
    pod_spec: dict[str, Any] = {
        "subdomain": service,
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": hosts}]}]}},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"nodemedic.io/job": name}},
                 "topologyKey": "kubernetes.io/hostname"}]},
        },
        "tolerations": [
            {"key": f"{taint_prefix}{HEALTH_TAINT}", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    service_obj = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": service, "namespace": namespace, "labels": labels},
        "spec": {"clusterIP": "None", "selector": {"nodemedic.io/job": name},
                 # Rank 0's name must resolve while the pods start, before anyone is Ready.
                 "publishNotReadyAddresses": True,
                 "ports": [{"name": "rendezvous", "port": master_port, "targetPort": master_port}]},
    }
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed", "completions": len(hosts), "parallelism": len(hosts),
            # One failed rank fails the whole collective: no retries, and the Job's failure ends the other pods.
            "backoffLimit": 0,
            "activeDeadlineSeconds": active_deadline_s,
            "ttlSecondsAfterFinished": ttl_seconds_after_finished,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    return [service_obj, job]


def dump_yaml(objs: Sequence[dict[str, Any]]) -> str:
    """Multi-document YAML for `kubectl apply -f -`."""
    return yaml.safe_dump_all(list(objs), sort_keys=False, default_flow_style=False)


# -- `python -m nodemedic.checks.active.cluster judge`: the verdict inside the Kubernetes Job ----------------------

EXIT = {Status.PASSED: 0, Status.FAILED: 1, Status.ERROR: 2, Status.SKIPPED: 2}


def judge_file(path: str, *, nodes: int, devices: int, threshold_busbw_gbs: float | None,
               returncode: int = 0) -> DeepCheckResult:
    text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
    result = nccl.judge(nccl.parse_allreduce(text), threshold_busbw_gbs, nodes=nodes, devices=devices)
    result.name = CHECK
    if returncode != 0 and result.status is not Status.FAILED:
        result.status = Status.ERROR
        result.summary = f"workers exited {returncode}: {result.summary}"
    result.evidence = {"returncode": returncode, "output_tail": tail(text, 40)}
    return result


def main(argv: list[str] | None = None) -> int:
    import json

    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("judge", help="judge a rank-0 all-reduce output file; exit 0 passed, 1 failed, 2 error")
    j.add_argument("output")
    j.add_argument("--nodes", type=int, required=True)
    j.add_argument("--devices", type=int, required=True)
    j.add_argument("--threshold", type=float, default=None)
    j.add_argument("--returncode", type=int, default=0)
    args = parser.parse_args(argv)
    result = judge_file(args.output, nodes=args.nodes, devices=args.devices, threshold_busbw_gbs=args.threshold,
                        returncode=args.returncode)
    print(json.dumps(result.record()))
    return EXIT[result.status]


if __name__ == "__main__":
    sys.exit(main())
