from __future__ import annotations

import pytest

from nodemedic.catalog import CatalogError, Kind, load_catalog
from nodemedic.model import Action, Severity

# REFERENCE.md's Xid table: xid -> (fatal to the node, the node action the catalog must take first)
REFERENCE_XIDS = {
    13: Action.NONE, 31: Action.NONE, 43: Action.NONE, 45: Action.NONE, 48: Action.RESET_GPU, 61: Action.REBOOT,
    62: Action.REBOOT, 63: Action.WATCH, 64: Action.REBOOT, 68: Action.NONE, 69: Action.NONE, 73: Action.REBOOT,
    74: Action.REBOOT, 79: Action.REBOOT, 92: Action.WATCH, 94: Action.WATCH, 95: Action.REBOOT,
    109: Action.REBOOT, 119: Action.REBOOT, 120: Action.REBOOT, 140: Action.REBOOT, 143: Action.REBOOT,
    **{x: Action.REBOOT for x in range(144, 151)}, 151: Action.REBOOT, 154: Action.WATCH, 155: Action.REBOOT,
    156: Action.REBOOT, 158: Action.REBOOT,
}


@pytest.mark.parametrize("xid,action", sorted(REFERENCE_XIDS.items()))
def test_every_reference_xid_is_in_the_catalog(catalog, xid, action):
    assert f"XID_{xid}" in catalog
    entry = catalog.get(f"XID_{xid}")
    assert entry.action is action
    assert entry.title and entry.vendor_action


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 69])
def test_application_errors_are_marked_as_such(catalog, xid):
    entry = catalog.get(f"XID_{xid}")
    assert entry.kind is Kind.APPLICATION and entry.max_action is Action.WATCH


def test_escalating_entries(catalog):
    assert catalog.get("XID_79").escalate and catalog.get("XID_64").escalate
    assert not catalog.get("XID_154").escalate and catalog.get("XID_154").named_action


def test_override_field_by_field(catalog):
    c = load_catalog({"XID_109": {"action": "watch"}, "XID_74": {"threshold_count": 3, "threshold_window_s": 60}})
    assert c.get("XID_109").action is Action.WATCH
    assert c.get("XID_109").title == catalog.get("XID_109").title  # untouched fields stay
    assert c.get("XID_74").threshold_count == 3 and c.get("XID_74").action is Action.REBOOT


def test_override_adds_unknown_code_inheriting_its_family():
    c = load_catalog({"XID_200": {"action": "reboot", "title": "new"}})
    assert c.get("XID_200").action is Action.REBOOT and c.get("XID_200").type == "GpuXid"


def test_family_and_default_fallbacks(catalog):
    assert catalog.get("SXID_20009").named_action and catalog.get("SXID_20009").type == "NvSwitchSxid"
    assert catalog.get("NEURON_SOMETHING").type == "NeuronHwError"
    d = catalog.get("TOTALLY_UNKNOWN")
    assert d.action is Action.WATCH and d.code == "TOTALLY_UNKNOWN"


@pytest.mark.parametrize("override,words", [
    ({"XID_79": {"action": "explode"}}, ["XID_79", "action"]),
    ({"XID_79": {"severity": "loud"}}, ["XID_79", "severity"]),
    ({"XID_79": {"threshold_count": 0}}, ["XID_79", "threshold_count"]),
    ({"XID_79": {"nonsense": 1}}, ["XID_79", "nonsense"]),
])
def test_bad_override_names_code_and_field(override, words):
    with pytest.raises(CatalogError) as exc:
        load_catalog(override)
    for w in words:
        assert w in str(exc.value)


def test_severity_and_action_parse_names():
    assert Severity.parse("critical") is Severity.CRITICAL
    assert Action.parse("reset-gpu") is Action.RESET_GPU
    assert Action.REBOOT.escalated() is Action.REPLACE and Action.REPLACE.escalated() is Action.REPLACE
