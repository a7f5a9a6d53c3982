"""The Slurm backend: drain or fail this node with a reason recovery tooling keys on, and resume only its own drains.

`hyperpod` profile: `state=fail reason=Action:Reboot` / `Action:Replace`, exactly (HyperPod's recovery keys on the
reason; fail lets running jobs finish). Default profile: `state=drain` with a reason carrying the agent's prefix and a
summary. A reason the agent did not write is never overwritten, and only a node the agent drained is resumed; what
it wrote is kept in a record under the state dir, because `Action:Reboot` alone cannot say who wrote it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from nodemedic.actions import ActionBackend
from nodemedic.model import DEEP_IN_PROGRESS, Health, NodeVerdict
from nodemedic.slurmctl import NodeInfo, Slurm

log = logging.getLogger(__name__)

HYPERPOD_REASONS = {Health.PENDING_REBOOT: "Action:Reboot", Health.PENDING_REPLACEMENT: "Action:Replace"}
_REASON_BAD = re.compile(r"[^A-Za-z0-9 :._+()/@-]")


class SlurmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_name: str | None = Field(default=None, description="Slurm node name; default: matched to this host")
    scontrol: str = "scontrol"
    timeout_s: float = Field(default=10, gt=0)
    reason_prefix: str = "nodemedic:"
    reason_max: int = Field(default=120, ge=20, le=1024)
    reboot: bool = Field(default=False, description="reboot through `scontrol reboot ASAP nextstate=resume` when "
                                                    "the policy asks for a reboot (default profile)")


def summary_reason(verdict: NodeVerdict, prefix: str, limit: int) -> str:
    """`nodemedic: Xid 79 gpu 0000:3b:00.0 (reboot)`, stripped of anything that could break scontrol's parsing."""
    serious = [f for f in verdict.faults if f.code in verdict.fault_reasons] or verdict.faults
    if not verdict.fault_reasons and verdict.deep_check == DEEP_IN_PROGRESS:
        # Held for the deep checks alone: say so, so nobody mistakes the drain for a fault.
        return _REASON_BAD.sub("-", f"{prefix} deep health check {DEEP_IN_PROGRESS}")[:limit].rstrip()
    if serious:
        f = serious[0]
        code = f.code.replace("XID_", "Xid ").replace("SXID_", "SXid ")
        text = f"{code} {f.component.replace(':', ' ', 1)}"
        if len(serious) > 1:
            text += f" +{len(serious) - 1} more"
    else:
        text = ", ".join(verdict.fault_reasons) or verdict.health.value
    reason = f"{prefix} {text} ({verdict.action})"
    return _REASON_BAD.sub("-", reason)[:limit].rstrip()


class SlurmBackend(ActionBackend):
    name = "slurm"

    def __init__(self, config: SlurmConfig, state_dir: str | os.PathLike[str], profile: str = "default",
                 dry_run: bool = False, slurm: Slurm | None = None):
        self.config = config
        self.profile = profile
        self.dry_run = dry_run
        self.slurm = slurm or Slurm(config.scontrol, config.timeout_s)
        self.record_path = Path(state_dir) / "slurm-owned.json"
        self._node: str | None = config.node_name

    @property
    def node(self) -> str:
        if self._node is None:
            self._node = self.slurm.this_node()
        return self._node

    # -- ownership record --------------------------------------------------------------------------------------------
    def _record(self) -> dict | None:
        try:
            data = json.loads(self.record_path.read_text())
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None

    def _write_record(self, data: dict | None) -> None:
        if self.dry_run:
            return
        if data is None:
            self.record_path.unlink(missing_ok=True)
            return
        self.record_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.record_path.parent, prefix=".slurm-owned-")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, self.record_path)

    def owns(self, info: NodeInfo) -> bool:
        """Whether the node's current reason is one this agent wrote."""
        if not info.has_reason:
            return False
        record = self._record()
        if record and record.get("node") == info.name and record.get("reason") == info.reason:
            return True
        # Our prefix is ours alone, even if the record was lost; HyperPod's fixed strings are not.
        return self.profile != "hyperpod" and info.reason.startswith(self.config.reason_prefix)

    # -- applying ----------------------------------------------------------------------------------------------------
    def desired(self, verdict: NodeVerdict) -> tuple[str, str] | None:
        """(state, reason) for the verdict, or None for a healthy node."""
        health = verdict.health
        if health is Health.SCHEDULABLE:
            return None
        if self.profile == "hyperpod" and health in HYPERPOD_REASONS:
            return "fail", HYPERPOD_REASONS[health]
        return "drain", summary_reason(verdict, self.config.reason_prefix, self.config.reason_max)

    def apply(self, verdict: NodeVerdict) -> None:
        info = self.slurm.node(self.node)
        want = self.desired(verdict)
        ours = self.owns(info)
        if want is None:
            if ours and info.out_of_service:
                self._run(self.slurm.command(info.name, "resume"))
            elif info.has_reason and not ours and info.out_of_service:
                log.info("node %s is %s by someone else (%r): left alone", info.name, info.state, info.reason)
            self._write_record(None)
            return
        state, reason = want
        if info.has_reason and not ours and info.out_of_service:
            # Another admin's drain stays exactly as it is: never overwrite a reason we did not write.
            log.warning("node %s already %s by someone else (%r): not overwriting it with %r", info.name,
                        info.state, info.reason, reason)
            self._write_record({"node": info.name, "foreign_state": info.state, "foreign_reason": info.reason,
                                "wanted": reason})
            return
        if ours and info.reason == reason and info.is_(state):
            return  # already applied: nothing to send
        if state == "drain" and self.config.reboot and verdict.health is Health.PENDING_REBOOT:
            self._run(self.slurm.reboot_command(info.name, reason))
        else:
            self._run(self.slurm.command(info.name, state, reason))
        self._write_record({"node": info.name, "state": state, "reason": reason})

    def _run(self, args: list[str]) -> None:
        line = " ".join(_quote(a) for a in args)
        if self.dry_run:
            log.warning("dry run: would run %s", line)
            return
        self.slurm.execute(args)
        log.warning("slurm: %s", line)


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w.=:/@+-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"
