"""In-process recovery runtime imported by training code: `nodemedic.recovery`.

Depends on the standard library and (lazily) torch only, never on the agent's modules, so `import nodemedic.recovery`
works in an image without torch and a training script pays for nothing it does not use.

    from nodemedic.recovery import Wrapper

    store = torch.distributed.TCPStore(host, port, world_size, is_master=False)   # the job's store
    @Wrapper(store=store, max_restarts=5, hard_timeout_s=60)
    def train(ctx, model, opt):
        ctx.init_process_group("gloo")            # per generation: rank/world may change after a shrink
        for step in range(start_step(ctx), steps):
            loss = compute(model, batch(step))    # a fault is injected here, or breaks the collective below
            all_reduce_grads(model)
            with ctx.atomic():                    # never interrupted: the step is applied whole or not at all
                opt.step(); save_step(step)
    train(model, opt)                             # exits with RESTART_EXIT_CODE (75) when in-process recovery fails

Faults come from the block itself (any Exception), the node agent (Unix socket named by NODEMEDIC_RECOVERY_SOCKET,
default /run/nodemedic/recovery.sock; a missing agent is fine), another rank (the store key nodemedic/fault/<gen>), or
the soft timeout. See wrapper.py for the fault path, store.py for the store keys, nvrx.py for the
nvidia-resiliency-ext health-check adapter.
"""

from .client import AgentClient
from .nvrx import NodeAgentHealthCheck, NodeUnhealthy, read_verdict
from .store import BarrierTimeout, Excluded
from .torch_support import abort_torch_distributed, cuda_health_check
from .wrapper import RESTART_EXIT_CODE, Context, Fault, FaultInterrupt, RestartLimitExceeded, Wrapper, recoverable

__all__ = [
    "AgentClient", "BarrierTimeout", "Context", "Excluded", "Fault", "FaultInterrupt", "NodeAgentHealthCheck",
    "NodeUnhealthy", "RESTART_EXIT_CODE", "RestartLimitExceeded", "Wrapper", "abort_torch_distributed",
    "cuda_health_check", "read_verdict", "recoverable",
]
