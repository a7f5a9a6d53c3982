"""Label and field selectors with the syntax and matching rules of k8s.io/apimachinery."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

from .errors import bad_request

_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_TOKEN_RE = re.compile(r"\s*(!=|==|=|!|>|<|\(|\)|,|[^\s!=,()<>]+)")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        try:
            number, bound = int(value or ""), int(self.values[0])
        except ValueError:
            return False
        return number > bound if self.op == "gt" else number < bound


class LabelSelector:
    """A parsed `labelSelector` query value (AND of requirements)."""

    def __init__(self, requirements: list[Requirement]):
        self.requirements = requirements

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        tokens = [t for t in _TOKEN_RE.findall(text or "")]
        requirements: list[Requirement] = []
        pos = 0

        def fail(detail: str) -> None:
            raise bad_request(f"unable to parse requirement: {detail}")

        while pos < len(tokens):
            negate = tokens[pos] == "!"
            if negate:
                pos += 1
            if pos >= len(tokens) or tokens[pos] in ("=", "==", "!=", ",", "(", ")", "in", "notin"):
                fail(f"found '{tokens[pos] if pos < len(tokens) else ''}', expected: identifier")
            key = tokens[pos]
            pos += 1
            following = tokens[pos] if pos < len(tokens) else ","
            if negate or following == ",":
                requirements.append(Requirement(key, "!" if negate else "exists"))
            elif following in ("=", "==", "!="):
                value = tokens[pos + 1] if pos + 1 < len(tokens) and tokens[pos + 1] != "," else ""
                pos += 2 if value else 1
                requirements.append(Requirement(key, "!=" if following == "!=" else "=", (_check_value(value),)))
            elif following in (">", "<"):
                if pos + 1 >= len(tokens) or not tokens[pos + 1].lstrip("-").isdigit():
                    fail(f"for 'gt', 'lt' operators, the value must be an integer")
                requirements.append(Requirement(key, "gt" if following == ">" else "lt", (tokens[pos + 1],)))
                pos += 2
            elif following in ("in", "notin"):
                pos += 1
                if pos >= len(tokens) or tokens[pos] != "(":
                    fail("found '', expected: '('")
                values, pos = _parse_set(tokens, pos + 1, fail)
                requirements.append(Requirement(key, following, tuple(values)))
            else:
                fail(f"found '{following}', expected: in, notin, =, ==, !=, gt, lt")
            if pos < len(tokens):
                if tokens[pos] != ",":
                    fail(f"found '{tokens[pos]}', expected: ',' or 'end of string'")
                pos += 1
        return cls(requirements)

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        return all(r.matches(labels or {}) for r in self.requirements)

    @property
    def empty(self) -> bool:
        return not self.requirements


def _parse_set(tokens: list[str], pos: int, fail: Callable[[str], None]) -> tuple[list[str], int]:
    values: list[str] = []
    while pos < len(tokens) and tokens[pos] != ")":
        if tokens[pos] != ",":
            values.append(_check_value(tokens[pos]))
        pos += 1
    if pos >= len(tokens):
        fail("found '', expected: ')'")
    return values, pos + 1


def _check_value(value: str) -> str:
    if len(value) > 63 or not _VALUE_RE.match(value):
        raise bad_request(f"unable to parse requirement: values[0]: Invalid value: \"{value}\": "
                          "a valid label must be an empty string or consist of alphanumeric characters, "
                          "'-', '_' or '.', and must start and end with an alphanumeric character")
    return value


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    value: str
    negate: bool

    def matches(self, fields: Mapping[str, str]) -> bool:
        return (fields.get(self.field, "") == self.value) != self.negate


class FieldSelector:
    """A parsed `fieldSelector`: comma-separated `f=v`, `f==v`, `f!=v` terms, all of which must hold."""

    def __init__(self, requirements: list[FieldRequirement]):
        self.requirements = requirements

    @classmethod
    def parse(cls, text: str | None, supported: frozenset[str]) -> FieldSelector:
        requirements: list[FieldRequirement] = []
        for term in _split_unescaped(text or ""):
            if not term:
                continue
            match = re.match(r"^([^=!]+)(!=|==|=)(.*)$", term)
            if not match:
                raise bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
            field, op, value = match.group(1), match.group(2), _unescape(match.group(3))
            if field not in supported:
                raise bad_request(f"field label not supported: {field}")
            requirements.append(FieldRequirement(field, value, op == "!="))
        return cls(requirements)

    def matches(self, fields: Mapping[str, str]) -> bool:
        return all(r.matches(fields) for r in self.requirements)

    @property
    def empty(self) -> bool:
        return not self.requirements

    def exact_name(self) -> str | None:
        for r in self.requirements:
            if r.field == "metadata.name" and not r.negate:
                return r.value
        return None


def _split_unescaped(text: str) -> list[str]:
    parts, current, escaped = [], "", False
    for char in text:
        if escaped:
            current += "\\" + char
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ",":
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)
