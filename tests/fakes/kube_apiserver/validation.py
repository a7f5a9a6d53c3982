"""The subset of apiserver validation that agent code is likely to trip over (labels, taints, events)."""

from __future__ import annotations

import re
from typing import Any

Cause = tuple[str, str, str]  # (field path, reason, message)

_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS1123_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
EVENT_TYPES = ("Normal", "Warning")


def qualified_name_errors(field: str, key: Any) -> list[Cause]:
    if not isinstance(key, str):
        return [(field, "FieldValueInvalid", f"Invalid value: {key!r}: must be a string")]
    prefix, _, name = key.rpartition("/")
    bad = (not name or len(name) > 63 or not _NAME_RE.match(name)
           or ("/" in key and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN_RE.match(prefix))))
    if bad:
        return [(field, "FieldValueInvalid",
                 f'Invalid value: "{key}": name part must consist of alphanumeric characters, \'-\', \'_\' or \'.\', '
                 "and must start and end with an alphanumeric character")]
    return []


def label_value_errors(field: str, value: Any) -> list[Cause]:
    if not isinstance(value, str) or len(value) > 63 or not _VALUE_RE.match(value):
        return [(field, "FieldValueInvalid",
                 f'Invalid value: "{value}": a valid label must be an empty string or consist of alphanumeric '
                 "characters, '-', '_' or '.', and must start and end with an alphanumeric character")]
    return []


def metadata_errors(obj: dict[str, Any]) -> list[Cause]:
    meta = obj.get("metadata") or {}
    causes: list[Cause] = []
    for key, value in (meta.get("labels") or {}).items():
        causes += qualified_name_errors("metadata.labels", key)
        causes += label_value_errors("metadata.labels", value)
    for key, value in (meta.get("annotations") or {}).items():
        causes += qualified_name_errors("metadata.annotations", key)
        if not isinstance(value, str):
            causes.append(("metadata.annotations", "FieldValueInvalid", f"Invalid value: {value!r}: must be a string"))
    return causes


def node_errors(node: dict[str, Any]) -> list[Cause]:
    causes = metadata_errors(node)
    seen: set[tuple[str, str]] = set()
    for i, taint in enumerate((node.get("spec") or {}).get("taints") or []):
        where = f"spec.taints[{i}]"
        if not isinstance(taint, dict):
            causes.append((where, "FieldValueInvalid", "Invalid value: must be an object"))
            continue
        if not taint.get("key"):
            causes.append((f"{where}.key", "FieldValueRequired", "Required value"))
        else:
            causes += qualified_name_errors(f"{where}.key", taint["key"])
        if "value" in taint:
            causes += label_value_errors(f"{where}.value", taint["value"])
        effect = taint.get("effect")
        if not effect:
            causes.append((f"{where}.effect", "FieldValueRequired", "Required value"))
        elif effect not in TAINT_EFFECTS:
            causes.append((f"{where}.effect", "FieldValueNotSupported",
                           f'Unsupported value: "{effect}": supported values: "NoSchedule", "PreferNoSchedule", "NoExecute"'))
        identity = (str(taint.get("key")), str(effect))
        if identity in seen:
            causes.append(("spec.taints", "FieldValueDuplicate",
                           f"Duplicate value: \"{taint.get('key')}\": taints must be unique by key and effect pair"))
        seen.add(identity)
    for i, condition in enumerate((node.get("status") or {}).get("conditions") or []):
        if not isinstance(condition, dict) or not condition.get("type"):
            causes.append((f"status.conditions[{i}].type", "FieldValueRequired", "Required value"))
    return causes


def pod_errors(pod: dict[str, Any]) -> list[Cause]:
    return metadata_errors(pod)


def core_event_errors(event: dict[str, Any]) -> list[Cause]:
    causes = metadata_errors(event)
    involved = event.get("involvedObject") or {}
    if event.get("eventTime") and not event.get("reportingComponent"):
        causes.append(("reportingComponent", "FieldValueRequired", "Required value"))
    causes += _namespace_match(event, involved.get("namespace", ""), "involvedObject.namespace")
    return causes


def events_v1_errors(event: dict[str, Any]) -> list[Cause]:
    causes = metadata_errors(event)
    if not event.get("eventTime"):
        causes.append(("eventTime", "FieldValueRequired", "Required value"))
    for field in ("reportingController", "reportingInstance", "action", "reason"):
        if not event.get(field):
            causes.append((field, "FieldValueRequired", "Required value"))
        elif len(str(event[field])) > 128:
            causes.append((field, "FieldValueTooLong", "Too long: may not be longer than 128"))
    if event.get("type") not in EVENT_TYPES:
        causes.append(("type", "FieldValueInvalid", f"Invalid value: \"{event.get('type', '')}\": has invalid value"))
    if len(str(event.get("note", ""))) > 1024:
        causes.append(("note", "FieldValueTooLong", "Too long: may not be longer than 1024"))
    regarding = event.get("regarding") or {}
    causes += _namespace_match(event, regarding.get("namespace", ""), "regarding.namespace")
    return causes


def _namespace_match(event: dict[str, Any], involved_namespace: str, field: str) -> list[Cause]:
    # Events about cluster-scoped objects (Nodes) must live in "default"; namespaced ones in the object's namespace.
    namespace = (event.get("metadata") or {}).get("namespace", "")
    if not involved_namespace:
        if namespace not in ("", "default"):
            return [(field, "FieldValueInvalid", f'Invalid value: "{involved_namespace}": does not match event.namespace')]
    elif namespace != involved_namespace:
        return [(field, "FieldValueInvalid", f'Invalid value: "{involved_namespace}": does not match event.namespace')]
    return []
