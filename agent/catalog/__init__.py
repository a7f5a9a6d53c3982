"""The fault catalog: shipped YAML data, overridable entry by entry from the operator's config."""

from __future__ import annotations

import enum
from importlib import resources
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from nodemedic.model import Action, Severity


class Kind(str, enum.Enum):
    HARDWARE = "hardware"
    APPLICATION = "application"
    SOFTWARE = "software"
    CHECK = "check"
    PLATFORM = "platform"


class CatalogEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str
    title: str = ""
    type: str = "Unknown"
    kind: Kind = Kind.HARDWARE
    severity: Severity = Severity.WARNING
    action: Action = Action.WATCH
    vendor_action: str = ""
    threshold_count: int = Field(default=1, ge=1)
    threshold_window_s: float = Field(default=0, ge=0)
    dedup_window_s: float | None = Field(default=None, ge=0)
    escalate: bool = True
    named_action: bool = False
    corroborate: bool = False

    @field_validator("severity", mode="before")
    @classmethod
    def _severity(cls, v: Any) -> Severity:
        return Severity.parse(v)

    @field_validator("action", mode="before")
    @classmethod
    def _action(cls, v: Any) -> Action:
        return Action.parse(v)

    @property
    def max_action(self) -> Action:
        """Application errors and check failures never take a node out of service."""
        if self.kind in (Kind.APPLICATION, Kind.CHECK):
            return Action.WATCH
        return Action.REPLACE


class CatalogError(ValueError):
    pass


class Catalog:
    """Code → entry, with family fallbacks (longest prefix) and a default for anything unknown."""

    def __init__(self, data: Mapping[str, Any], overrides: Mapping[str, Mapping[str, Any]] | None = None):
        defaults = dict(data.get("defaults") or {})
        self._entries: dict[str, CatalogEntry] = {}
        self._families: list[tuple[str, CatalogEntry]] = []
        overrides = dict(overrides or {})
        for code, fields in (data.get("entries") or {}).items():
            self._entries[code] = self._build(code, defaults, fields, overrides.pop(code, None))
        for prefix, fields in (data.get("families") or {}).items():
            fam = self._build(prefix, defaults, fields, overrides.pop(prefix, None))
            self._families.append((prefix, fam))
        # An override for a code the catalog does not know adds an entry, inheriting from its family if any.
        for code, fields in overrides.items():
            base = self._family_fields(code)
            self._entries[code] = self._build(code, {**defaults, **base}, {}, fields)
        self._families.sort(key=lambda kv: -len(kv[0]))
        self._default = self._build("DEFAULT", defaults, {"title": "Unknown fault"}, None)
        self._cache: dict[str, CatalogEntry] = {}

    def _family_fields(self, code: str) -> dict[str, Any]:
        for prefix, fam in sorted(self._families, key=lambda kv: -len(kv[0])):
            if code.startswith(prefix):
                return fam.model_dump(exclude={"code"})
        return {}

    @staticmethod
    def _build(code: str, defaults: Mapping[str, Any], fields: Mapping[str, Any] | None,
               override: Mapping[str, Any] | None) -> CatalogEntry:
        merged = {**defaults, **(fields or {}), **(override or {}), "code": code}
        try:
            return CatalogEntry.model_validate(merged)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise CatalogError(f"catalog entry {code}: {problems}") from None

    def get(self, code: str) -> CatalogEntry:
        entry = self._cache.get(code)
        if entry is not None:
            return entry
        entry = self._entries.get(code)
        if entry is None:
            for prefix, fam in self._families:
                if code.startswith(prefix):
                    entry = fam.model_copy(update={"code": code})
                    break
            else:
                entry = self._default.model_copy(update={"code": code})
        self._cache[code] = entry
        return entry

    def __contains__(self, code: str) -> bool:
        return code in self._entries

    def codes(self) -> list[str]:
        return sorted(self._entries)


CATALOG_FILES = ("kernel.yaml", "nvidia.yaml", "platform.yaml", "deep.yaml")


def load_builtin() -> dict[str, Any]:
    """The shipped catalog: one YAML file per domain, merged; a code defined twice is a packaging bug."""
    merged: dict[str, Any] = {"defaults": {}, "families": {}, "entries": {}}
    for name in CATALOG_FILES:
        data = yaml.safe_load(resources.files(__package__).joinpath(name).read_text(encoding="utf-8")) or {}
        merged["defaults"].update(data.get("defaults") or {})
        for section in ("families", "entries"):
            for code, fields in (data.get(section) or {}).items():
                if code in merged[section]:
                    raise CatalogError(f"{name}: {code} is already defined by another catalog file")
                merged[section][code] = fields
    return merged


def load_catalog(overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Catalog:
    return Catalog(load_builtin(), overrides)
