"""Instance profiles: what devices a healthy node of a given instance type has."""

from __future__ import annotations

from importlib import resources
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class InstanceProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_type: str
    gpus: int | None = Field(default=None, ge=0)
    gpu_model: str | None = None
    nvlinks_per_gpu: int | None = Field(default=None, ge=0)
    pcie_width: int | None = Field(default=None, ge=1, description="PCIe lanes each GPU's link should run at")
    efa: int | None = Field(default=None, ge=0)
    neuron_devices: int | None = Field(default=None, ge=0)


class ProfileError(ValueError):
    pass


def normalize_instance_type(name: str) -> str:
    """SageMaker prefixes instance types with `ml.`; the hardware is the same."""
    name = name.strip().lower()
    return name[3:] if name.startswith("ml.") else name


def load_profiles(overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, InstanceProfile]:
    data = yaml.safe_load(resources.files(__package__).joinpath("instances.yaml").read_text()) or {}
    for name, fields in (overrides or {}).items():
        key = normalize_instance_type(name)
        data[key] = {**(data.get(key) or {}), **fields}
    profiles = {}
    for name, fields in data.items():
        key = normalize_instance_type(name)
        try:
            profiles[key] = InstanceProfile(instance_type=key, **fields)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise ProfileError(f"instance profile {name}: {problems}") from None
    return profiles


def profile_for(instance_type: str | None,
                overrides: Mapping[str, Mapping[str, Any]] | None = None) -> InstanceProfile | None:
    """The profile of `instance_type` (with or without `ml.`), or None when it is unknown or not given."""
    if not instance_type:
        return None
    return load_profiles(overrides).get(normalize_instance_type(instance_type))
