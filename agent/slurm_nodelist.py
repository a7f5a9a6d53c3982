"""The running job's current nodes, master and this host's rank, from scontrol rather than SLURM_JOB_NODELIST.

After a node is replaced (HyperPod auto-resume, a requeue) the job environment still names the old nodes; the
controller's view of the job is the only current one, so a launcher asks it at every start.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import sys
from argparse import Namespace
from dataclasses import asdict, dataclass

from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import run_tool

EXIT_ERROR = 2

_RECORD_START = re.compile(r"^(?=JobId=)", re.MULTILINE)
# Anchored on whitespace so that ReqNodeList= and ExcNodeList= never match.
_NODELIST = re.compile(r"(?:^|\s)NodeList=(\S*)")
_NODEADDR = re.compile(r"(?:^|\s)NodeAddr=(\S*)")
_NULL = {"", "(null)"}


class NodeListError(Exception):
    """The job's nodes could not be resolved; the message says why."""


@dataclass(frozen=True)
class JobNodes:
    """A job's current allocation, in Slurm's node order."""

    job_id: str
    nodes: list[str]
    master: str
    master_addr: str
    num_nodes: int
    node_rank: int | None


def _field(record: str, name: str) -> str | None:
    m = re.search(rf"(?:^|\s){re.escape(name)}=(\S*)", record)
    return m.group(1) if m else None


def job_record(text: str, job_id: str) -> str:
    """The `scontrol show job` record (multi-line or `-o`) whose JobId is `job_id`, else the first one."""
    records = [r for r in _RECORD_START.split(text) if r.strip()]
    if not records:
        raise NodeListError("scontrol show job printed no record")
    for record in records:
        if _field(record, "JobId") == job_id:
            return record
    return records[0]


def parse_job_nodelist(text: str, job_id: str) -> str:
    """The compressed NodeList (`ip-10-1-[2-3]`) of a started job; a pending job, with none yet, raises."""
    record = job_record(text, job_id)
    m = _NODELIST.search(record)
    nodelist = m.group(1) if m else ""
    state = _field(record, "JobState") or "UNKNOWN"
    # A requeued job waiting to restart can still show its previous nodes: those are exactly the stale ones.
    if nodelist in _NULL or state == "PENDING":
        reason = _field(record, "Reason") or "None"
        raise NodeListError(f"no nodes allocated yet (JobState={state} Reason={reason}): "
                            "run this inside the job once it has started")
    return nodelist


def parse_node_addr(text: str) -> str | None:
    """NodeAddr from `scontrol show node <name>` output, or None when it is missing."""
    m = _NODEADDR.search(text)
    addr = m.group(1) if m else ""
    return None if addr in _NULL else addr


def parse_hostnames(text: str) -> list[str]:
    """`scontrol show hostnames` output: one host per line, order kept."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def this_node() -> list[str]:
    """Names this host may have in the job's node list, best first."""
    names = [os.environ.get("SLURMD_NODENAME", ""), socket.gethostname().split(".")[0], socket.gethostname()]
    return [n for i, n in enumerate(names) if n and n not in names[:i]]


def node_rank(nodes: list[str], candidates: list[str] | None = None) -> int | None:
    """This host's index in `nodes`, or None when it is not one of them (a login node, a stale step)."""
    for name in this_node() if candidates is None else candidates:
        if name in nodes:
            return nodes.index(name)
    return None


def _scontrol(args: list[str], timeout_s: float) -> str:
    try:
        result = run_tool(["scontrol", *args], timeout_s)
    except CheckUnavailable as exc:
        raise NodeListError(str(exc)) from exc
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise NodeListError(f"scontrol {' '.join(args)} exited {result.returncode}: {said}")
    return result.stdout


def resolve(job_id: str, timeout_s: float) -> JobNodes:
    """Ask the controller for the job's current nodes and the master's address; raises NodeListError."""
    nodelist = parse_job_nodelist(_scontrol(["show", "job", job_id], timeout_s), job_id)
    nodes = parse_hostnames(_scontrol(["show", "hostnames", nodelist], timeout_s))
    if not nodes:
        raise NodeListError(f"scontrol show hostnames {nodelist} printed no hosts")
    master = nodes[0]
    try:
        addr = parse_node_addr(_scontrol(["show", "node", master], timeout_s))
    except NodeListError:
        # Slurm itself defaults NodeAddr to the node name, so the name is what a peer would dial anyway.
        addr = None
    return JobNodes(job_id=job_id, nodes=nodes, master=master, master_addr=addr or master,
                    num_nodes=len(nodes), node_rank=node_rank(nodes))


def shell_lines(jn: JobNodes) -> list[str]:
    """`export NAME=value` lines for `eval`; NODEMEDIC_NODES is comma-separated, an unknown rank is empty."""
    values = {
        "NODEMEDIC_NODES": ",".join(jn.nodes),
        "NODEMEDIC_NUM_NODES": str(jn.num_nodes),
        "NODEMEDIC_MASTER_ADDR": jn.master_addr,
        "NODEMEDIC_NODE_RANK": "" if jn.node_rank is None else str(jn.node_rank),
        "MASTER_ADDR": jn.master_addr,
    }
    return [f"export {name}={shlex.quote(value)}" for name, value in values.items()]


def main(args: Namespace) -> int:
    """`nodemedic slurm nodelist`: print the job's nodes as shell exports, JSON or one host per line."""
    job_id = getattr(args, "job", None) or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        print("nodemedic: no job: pass --job ID or run inside a Slurm job (SLURM_JOB_ID is unset)", file=sys.stderr)
        return EXIT_ERROR
    try:
        jn = resolve(str(job_id), float(getattr(args, "timeout", 30.0)))
    except NodeListError as exc:
        print(f"nodemedic: job {job_id}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    fmt = getattr(args, "format", "shell")
    if fmt == "json":
        print(json.dumps(asdict(jn)))
    elif fmt == "hosts":
        print("\n".join(jn.nodes))
    else:
        print("\n".join(shell_lines(jn)))
    return 0
