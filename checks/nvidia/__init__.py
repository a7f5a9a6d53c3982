"""NVIDIA passive checks: NVML, nvidia-smi, DCGM."""
