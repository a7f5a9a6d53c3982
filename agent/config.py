"""Configuration: one YAML file, NODEMEDIC_* environment overrides, defaults that run with neither."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nodemedic.actions.kubernetes import KubernetesConfig
from nodemedic.actions.slurm import SlurmConfig
from nodemedic.catalog import CatalogError, load_catalog
from nodemedic.checks.platform.profiles import ProfileError, load_profiles
from nodemedic.policy import CheckMode, PolicyConfig
from nodemedic.recovery.protocol import SOCKET_ENV
from nodemedic.recovery_server import RecoveryConfig

DEFAULT_CONFIG_PATH = "/etc/nodemedic/nodemedic.yaml"
ENV_PREFIX = "NODEMEDIC_"
# NODEMEDIC_* variables that are not settings: the config path, and what training processes read.
NOT_CONFIG = {"NODEMEDIC_CONFIG", SOCKET_ENV}


class ConfigError(ValueError):
    """A configuration problem, each line naming the offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CheckConfig(_Section):
    enabled: bool = True
    mode: CheckMode = CheckMode.ENFORCE
    timeout_s: float = Field(default=60, gt=0)


class KernelLogConfig(CheckConfig):
    source: Literal["auto", "kmsg", "file", "journal"] = "auto"
    path: str | None = Field(default=None, description="log file to follow (source=file) or kmsg device")
    lookback_s: float | None = Field(default=None, ge=0, description="on start, also read this far back")


class NvmlConfig(CheckConfig):
    interval_s: float = Field(default=30, gt=0, description="field poller period; events need no period")


class NvidiaSmiConfig(CheckConfig):
    binary: str = "nvidia-smi"
    interval_s: float = Field(default=60, gt=0)
    timeout_s: float = Field(default=30, gt=0)


class DcgmConfig(CheckConfig):
    binary: str = "dcgmi"
    host: str | None = Field(default=None, description="nv-hostengine address; default the local one")
    group: int = Field(default=0, ge=0, description="DCGM group the policy is set on (0: all GPUs)")
    interval_s: float = Field(default=60, gt=0, description="health watch period")
    timeout_s: float = Field(default=30, gt=0)
    unreachable_after_s: float = Field(default=300, gt=0, description="DCGM silent this long is a warning")


class PciConfig(CheckConfig):
    sysfs_root: str = "/sys"
    interval_s: float = Field(default=30, gt=0)


class MaintenanceConfig(CheckConfig):
    interval_s: float = Field(default=300, gt=0)
    timeout_s: float = Field(default=10, gt=0)


class ChecksConfig(_Section):
    kernel_log: KernelLogConfig = KernelLogConfig()
    nvml: NvmlConfig = NvmlConfig()
    nvidia_smi: NvidiaSmiConfig = NvidiaSmiConfig()
    dcgm: DcgmConfig = DcgmConfig()
    pci: PciConfig = PciConfig()
    maintenance: MaintenanceConfig = MaintenanceConfig()


class DeepTestConfig(_Section):
    enabled: bool = True
    timeout_s: float | None = Field(default=None, gt=0, description="per-test limit; default depends on the test "
                                                                    "and level")


class DcgmDiagConfig(DeepTestConfig):
    binary: str = "dcgmi"
    host: str | None = None
    expected_nvlinks: int | None = Field(default=None, ge=0, description="NVLinks up per GPU; default: the "
                                                                         "instance profile")


class NcclDeepConfig(DeepTestConfig):
    binary: str = Field(default="all_reduce_perf", description="nccl-tests binary; absent -> torch fallback")
    min_bytes: str = "1G"
    max_bytes: str = "16G"
    gpus: int | None = Field(default=None, ge=1, description="GPUs (ranks); default: the profile, or NVML")
    threshold_gbs: float | None = Field(default=None, gt=0, description="bus bandwidth threshold; default: the "
                                                                         "per-instance-type table")
    torch_fallback: bool = True
    torch_backend: Literal["auto", "nccl", "gloo"] = "auto"
    torch_min_bytes: str = "1M"
    torch_max_bytes: str = "64M"
    cpu_ranks: int = Field(default=2, ge=2, description="gloo ranks on a node without GPUs")


class EfaDeepConfig(DeepTestConfig):
    provider: str = Field(default="efa", description="libfabric provider (`tcp` exercises the path without EFA)")
    iterations: int = Field(default=100, ge=1)
    max_latency_us: float | None = Field(default=None, gt=0)
    min_bandwidth_mbps: float | None = Field(default=None, gt=0)
    expected_devices: int | None = Field(default=None, ge=0, description="default: the instance profile")
    max_devices: int = Field(default=4, ge=1, description="ping-pong at most this many devices per run")


class StressDeepConfig(DeepTestConfig):
    kinds: list[Literal["cpu", "memory", "disk"]] = ["cpu", "memory", "disk"]
    duration_s: float = Field(default=60, gt=0, description="per kind at level 2")
    full_duration_s: float = Field(default=600, gt=0, description="per kind at level 4")
    memory_fraction: float = Field(default=0.25, gt=0, le=0.9, description="share of available memory")
    scratch_dir: str = Field(default="/var/tmp", description="where the disk test writes")
    binary: str = "stress-ng"


class NeuronDeepConfig(DeepTestConfig):
    neuron_ls: str = "neuron-ls"
    nccom_test: str = "nccom-test"
    hw_check: bool = Field(default=True, description="per-device nccom-test --check over each device's cores")
    nccom_max_bytes: str = "1GB"
    nccom_threshold_gbs: float | None = Field(default=None, gt=0, description="nccom-test bus bandwidth floor")


class DeepChecksConfig(_Section):
    enabled: bool = True
    level: Literal[2, 4] = 2
    log_path: Path = Field(default=Path("/var/log/nodemedic/deep-health-check.log"),
                           description="node-local JSON-lines log; falls back to <state_dir> if not writable")
    log_max_bytes: int = Field(default=10 * 1024 * 1024, ge=4096)
    log_backups: int = Field(default=5, ge=1)
    on_start: bool = Field(default=False, description="run once when the agent starts (a node joining)")
    interval_s: float | None = Field(default=None, gt=0, description="run every interval_s; off by default")
    hold_node: bool = Field(default=True, description="hold the node out of scheduling while tests run")
    hold_timeout_s: float = Field(default=60, gt=0, description="abort if the hold is not applied by then")
    gpu_count: DeepTestConfig = DeepTestConfig()
    dcgm: DcgmDiagConfig = DcgmDiagConfig()
    nccl: NcclDeepConfig = NcclDeepConfig()
    efa: EfaDeepConfig = EfaDeepConfig()
    stress: StressDeepConfig = StressDeepConfig()
    neuron: NeuronDeepConfig = NeuronDeepConfig()


class MetricsConfig(_Section):
    enabled: bool = True
    host: str = "0.0.0.0"
    port: int = Field(default=9870, ge=0, le=65535)


class ActionsConfig(_Section):
    backend: Literal["auto", "local", "kubernetes", "slurm"] = Field(
        default="auto", description="auto: kubernetes inside a pod, slurm on a Slurm node (scontrol and a "
                                    "slurm.conf), else local")
    dry_run: bool = False
    kubernetes: KubernetesConfig = KubernetesConfig()
    slurm: SlurmConfig = SlurmConfig()


class ImdsConfig(_Section):
    enabled: bool = True
    endpoint: str = "http://169.254.169.254"
    timeout_s: float = Field(default=0.5, gt=0)


class Config(_Section):
    node_name: str = Field(default_factory=socket.gethostname)
    profile: Literal["default", "hyperpod"] = "default"
    instance_type: str | None = None
    state_dir: Path = Path("/var/lib/nodemedic")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    policy: PolicyConfig = PolicyConfig()
    catalog: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-code catalog overrides")
    instance_profiles: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                                         description="per-instance-type profile overrides")
    checks: ChecksConfig = ChecksConfig()
    metrics: MetricsConfig = MetricsConfig()
    actions: ActionsConfig = ActionsConfig()
    imds: ImdsConfig = ImdsConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    deep_checks: DeepChecksConfig = DeepChecksConfig()

    def policy_config(self) -> PolicyConfig:
        """The policy's settings with each check's enforce/observe mode folded in."""
        modes = {name: getattr(self.checks, name).mode for name in type(self.checks).model_fields}
        return self.policy.model_copy(update={"check_modes": {**modes, **self.policy.check_modes}})


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """File (explicit path, $NODEMEDIC_CONFIG, or the default path if present), then environment, then overrides."""
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    origin = "defaults"
    explicit = path is not None or bool(env.get(f"{ENV_PREFIX}CONFIG"))
    path = path or env.get(f"{ENV_PREFIX}CONFIG") or DEFAULT_CONFIG_PATH
    p = Path(path)
    if p.exists():
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read: {exc.strerror}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of settings")
        data = loaded
        origin = str(p)
    elif explicit:
        raise ConfigError(f"{p}: no such config file")

    env_keys: dict[tuple[str, ...], str] = {}
    if env.get("NODE_NAME") and "node_name" not in data:  # Kubernetes downward API
        data["node_name"] = env["NODE_NAME"]
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in NOT_CONFIG:
            continue
        keys = tuple(k.lower() for k in name[len(ENV_PREFIX):].split("__"))
        _set(data, keys, _scalar(value))
        env_keys[keys] = name
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set(data, tuple(dotted.split(".")), value)

    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, origin, env_keys)) from None
    try:
        load_catalog(config.catalog)  # fail at load time, naming the entry, rather than when the agent starts
    except CatalogError as exc:
        raise ConfigError(f"invalid configuration:\n  catalog: {exc} [{origin}]") from None
    try:
        load_profiles(config.instance_profiles)
    except ProfileError as exc:
        raise ConfigError(f"invalid configuration:\n  instance_profiles: {exc} [{origin}]") from None
    return config


def _set(data: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for k in keys[:-1]:
        nxt = data.get(k)
        if not isinstance(nxt, dict):
            nxt = data[k] = {}
        data = nxt
    data[keys[-1]] = value


def _scalar(text: str) -> Any:
    """Environment values are typed like YAML scalars, so NODEMEDIC_METRICS__ENABLED=false is a boolean."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (str, int, float, bool, list, dict)) or value is None else text


def _explain(exc: ValidationError, origin: str, env_keys: dict[tuple[str, ...], str]) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(str(part) for part in err["loc"])
        key = ".".join(loc) or "(top level)"
        where = env_keys.get(loc)
        source = f"environment {where}" if where else origin
        got = err.get("input")
        shown = "" if err["type"] == "missing" or isinstance(got, dict) else f" (got {got!r})"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        lines.append(f"{key}: {msg}{shown} [{source}]")
    return "invalid configuration:\n  " + "\n  ".join(lines)
