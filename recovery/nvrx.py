"""The node agent's verdict as a health check, for this package's Wrapper and for nvidia-resiliency-ext's.

nvidia-resiliency-ext (`nvidia_resiliency_ext.inprocess`) calls its `health_check` with its frozen state and expects
the state back, or an exception when the rank must not re-execute. `NodeAgentHealthCheck` follows that contract and
this package's (called with a Context; an exception or False fails), so either wrapper can use it:

    from nvidia_resiliency_ext import inprocess
    from nodemedic.recovery import NodeAgentHealthCheck

    wrapper = inprocess.Wrapper(
        health_check=inprocess.Compose(
            NodeAgentHealthCheck(),            # raises NodeUnhealthy when the agent says this node is unhealthy
            inprocess.health_check.CudaHealthCheck(),
        ),
        ...)

(Checked against nvidia-resiliency-ext 0.4.1, which imports on a CPU-only machine; its own Wrapper was not run here.)

The verdict comes from the agent's state file (`<state dir>/state.json`, written atomically by the agent; the state
dir is NODEMEDIC_STATE_DIR or /var/lib/nodemedic): the node is healthy while `verdict.health` is "Schedulable".
A missing or unreadable file counts as healthy unless `missing_ok=False` (no agent on the node says nothing bad).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

HEALTHY = "Schedulable"
DEFAULT_STATE_DIR = "/var/lib/nodemedic"


class NodeUnhealthy(RuntimeError):
    """The node agent's verdict says this node should not run training."""


def default_state_file() -> Path:
    return Path(os.environ.get("NODEMEDIC_STATE_DIR") or DEFAULT_STATE_DIR) / "state.json"


def read_verdict(state_file: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The agent's current verdict object, or None when there is no readable state file."""
    try:
        data = json.loads(Path(state_file or default_state_file()).read_text())
    except (OSError, ValueError):
        return None
    verdict = data.get("verdict") if isinstance(data, dict) else None
    return verdict if isinstance(verdict, dict) else None


class NodeAgentHealthCheck:
    def __init__(self, state_file: str | os.PathLike[str] | None = None, *, missing_ok: bool = True):
        self.state_file = state_file
        self.missing_ok = missing_ok

    def check(self) -> None:
        verdict = read_verdict(self.state_file)
        if verdict is None:
            if not self.missing_ok:
                raise NodeUnhealthy(f"no node-agent verdict at {self.state_file or default_state_file()}")
            return
        health = verdict.get("health", HEALTHY)
        if health != HEALTHY:
            reasons = "; ".join(map(str, verdict.get("fault_reasons") or [])) or verdict.get("action", "")
            raise NodeUnhealthy(f"node agent verdict {health}: {reasons}")

    def __call__(self, state: Any = None) -> Any:
        self.check()
        return state
