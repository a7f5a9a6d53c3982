"""torch-specific defaults, importing torch lazily: a training script that never imported torch pays nothing."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

log = logging.getLogger("nodemedic.recovery")


def run_with_limit(fn, timeout_s: float, name: str) -> bool:
    """Run `fn()` on a daemon thread; True if it finished within `timeout_s` (a stuck one is left behind)."""
    done = threading.Event()

    def target() -> None:
        try:
            fn()
        except Exception:
            log.exception("recovery: %s failed", name)
        finally:
            done.set()

    threading.Thread(target=target, name=f"nodemedic-{name}", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("recovery: %s did not finish in %.1f s; continuing without it", name, timeout_s)
        return False
    return True


def abort_torch_distributed(ctx: Any = None, timeout_s: float = 5.0) -> None:
    """Default abort: abort every torch.distributed process group and forget them, within `timeout_s`.

    `_abort_process_group()` aborts each group's backend (closing gloo's sockets, which releases a peer blocked in a
    collective once that peer aborts too) and clears torch's registry without the blocking shutdown that
    `destroy_process_group()` does. On a torch without it, `destroy_process_group()` runs instead, off this thread and
    with the time limit: with gloo it can block until the peers tear their groups down.
    Does nothing if torch.distributed was never imported or no group exists.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    def abort() -> None:
        if hasattr(c10d, "_abort_process_group"):
            c10d._abort_process_group()
        else:  # pragma: no cover - older torch
            dist.destroy_process_group()

    run_with_limit(abort, timeout_s, "abort-process-groups")


def cuda_health_check(ctx: Any = None, timeout_s: float = 10.0) -> bool:
    """Default health check: the current CUDA device still runs a kernel and synchronizes. Skipped (healthy) when
    torch is not imported or CUDA is absent; a device that hangs past `timeout_s` is unhealthy."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return True
    result: list[bool] = []

    def probe() -> None:
        x = torch.ones(1024, device="cuda")
        torch.cuda.synchronize()
        result.append(bool((x * 2).sum().item() == 2048))

    return run_with_limit(probe, timeout_s, "cuda-health-check") and result == [True]
