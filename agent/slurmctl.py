"""Talking to Slurm through `scontrol`: read a node's state and reason, change them. Argument lists only."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import ToolResult, run_tool

# What scontrol/sinfo print when slurmctld does not answer: the decision must wait, not be dropped.
_UNREACHABLE = ("unable to contact slurm controller", "connection refused", "connect failure",
                "socket timed out", "slurm_load_node error", "slurm_load_partitions")


class SlurmError(RuntimeError):
    pass


class SlurmUnreachable(SlurmError):
    pass


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str          # scontrol's State: a base state and flags, e.g. IDLE+DRAIN, MIXED+DRAIN, IDLE+FAIL, DOWN*
    reason: str         # "" when there is none
    addr: str
    hostname: str

    @property
    def has_reason(self) -> bool:
        return bool(self.reason) and self.reason != "none"

    @property
    def flags(self) -> set[str]:
        return {part.rstrip("*~#!%$@^-") for part in self.state.upper().split("+")}

    @property
    def out_of_service(self) -> bool:
        return bool(self.flags & {"DRAIN", "FAIL", "DOWN"})

    def is_(self, state: str) -> bool:
        """Whether the node is in `state` as scontrol sets it: drain, fail or down."""
        return state.upper() in self.flags


_REASON_STAMP = re.compile(r"\s*\[[^\]]*@[^\]]*\]\s*$")


def parse_show_node(text: str) -> NodeInfo | None:
    """`scontrol show node -o NAME`: key=value fields; Reason comes last and may contain spaces."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    if not line.startswith("NodeName="):
        return None
    head, sep, reason = line.partition(" Reason=")
    fields = dict(tok.split("=", 1) for tok in head.split() if "=" in tok)
    return NodeInfo(fields.get("NodeName", ""), fields.get("State", ""),
                    _REASON_STAMP.sub("", reason) if sep else "", fields.get("NodeAddr", ""),
                    fields.get("NodeHostName", ""))


class Slurm:
    def __init__(self, scontrol: str = "scontrol", timeout_s: float = 10.0):
        self.scontrol_bin = scontrol
        self.timeout_s = timeout_s

    def execute(self, args: list[str]) -> ToolResult:
        """Run a Slurm client command; SlurmUnreachable when slurmctld does not answer, SlurmError otherwise."""
        return self._run(args)

    def _run(self, args: list[str]) -> ToolResult:
        try:
            result = run_tool(args, self.timeout_s)
        except CheckUnavailable as exc:
            raise SlurmUnreachable(str(exc)) from exc
        if result.returncode != 0:
            text = result.output.strip()
            if any(marker in text.lower() for marker in _UNREACHABLE):
                raise SlurmUnreachable(f"slurmctld not reachable: {text[:300]}")
            raise SlurmError(f"{' '.join(args)} exited {result.returncode}: {text[:300]}")
        return result

    def nodes(self) -> list[NodeInfo]:
        out = self._run([self.scontrol_bin, "show", "node", "-o"]).stdout
        return [n for line in out.splitlines() if (n := parse_show_node(line)) is not None]

    def node(self, name: str) -> NodeInfo:
        # scontrol, not `sinfo -n`: Slurm 22.05's single-node sinfo can show a stale allocation state.
        info = parse_show_node(self._run([self.scontrol_bin, "show", "node", "-o", name]).stdout)
        if info is None or info.name != name:
            raise SlurmError(f"Slurm does not know node {name}")
        return info

    def this_node(self) -> str:
        """The Slurm node name of this host: by NodeHostName, then NodeAddr, then the name itself."""
        host = socket.gethostname()
        names = {host, host.split(".")[0]}
        try:
            names |= {socket.gethostbyname(host)}
        except OSError:
            pass
        nodes = self.nodes()
        for attr in ("hostname", "addr", "name"):
            for n in nodes:
                if getattr(n, attr) in names:
                    return n.name
        raise SlurmError(f"no Slurm node matches this host ({', '.join(sorted(names))}); set "
                         "actions.slurm.node_name")

    def command(self, node: str, state: str, reason: str | None = None) -> list[str]:
        args = [self.scontrol_bin, "update", f"nodename={node}", f"state={state}"]
        return args + ([f"reason={reason}"] if reason else [])

    def update(self, node: str, state: str, reason: str | None = None) -> None:
        self._run(self.command(node, state, reason))

    def reboot_command(self, node: str, reason: str) -> list[str]:
        return [self.scontrol_bin, "reboot", "ASAP", "nextstate=resume", f"reason={reason}", node]

    def reboot_asap(self, node: str, reason: str) -> None:
        self._run(self.reboot_command(node, reason))
