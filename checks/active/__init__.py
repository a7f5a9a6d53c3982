"""Active deep checks: tests that load the node (stress-ng, fi_pingpong, NCCL all-reduce, DCGM diagnostics)."""
