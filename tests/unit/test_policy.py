"""Every policy rule, with a fake clock."""

from __future__ import annotations

import pytest

from nodemedic.catalog import load_catalog
from nodemedic.model import Action, Health
from nodemedic.policy import CheckMode, Outcome, Policy, PolicyConfig, PolicyState

from conftest import finding

GPU0, GPU1 = "gpu:0000:3b:00.0", "gpu:0000:5d:00.0"


def test_fatal_xid_makes_node_pending_reboot(policy, state, clock):
    d = policy.observe(state, finding("XID_79", GPU0), clock())
    assert d.outcome is Outcome.ACTIVATED and d.action is Action.REBOOT
    assert d.health_before is Health.SCHEDULABLE and d.health_after is Health.PENDING_REBOOT
    v = state.verdict
    assert v.health is Health.PENDING_REBOOT and v.action == "reboot"
    assert v.fault_reasons == ["XID_79"] and v.fault_types == ["GpuFallenOffBus"]
    assert v.faults[0].component == GPU0 and v.generation == 1


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 69, 94])
def test_application_errors_never_make_node_unschedulable(policy, state, clock, xid):
    for i in range(5):
        policy.observe(state, finding(f"XID_{xid}", f"gpu:0000:{i:02x}:00.0"), clock.advance(1000))
    assert state.verdict.health is Health.SCHEDULABLE
    assert state.verdict.fault_reasons == []


def test_application_error_override_cannot_take_node_out_of_service(clock):
    """Even an operator override of an application Xid's action is capped; changing its kind lifts the cap."""
    state = PolicyState()
    capped = Policy(load_catalog({"XID_13": {"action": "reboot"}}))
    d = capped.observe(state, finding("XID_13"), clock())
    assert d.action is Action.WATCH and state.verdict.health is Health.SCHEDULABLE
    assert "never takes the node out of service" in d.reason
    state = PolicyState()
    lifted = Policy(load_catalog({"XID_13": {"action": "reboot", "kind": "hardware"}}))
    lifted.observe(state, finding("XID_13"), clock())
    assert state.verdict.health is Health.PENDING_REBOOT


def test_application_error_logged_once_per_dedup_window(policy, state, clock):
    first = policy.observe(state, finding("XID_13"), clock())
    assert first.outcome is Outcome.NO_ACTION and first.action is Action.NONE
    assert policy.observe(state, finding("XID_13"), clock.advance(10)) is None
    again = policy.observe(state, finding("XID_13"), clock.advance(policy.config.dedup_window_s))
    assert again.outcome is Outcome.NO_ACTION
    assert state.active == {}


def test_repeats_of_active_fault_are_one_decision(policy, state, clock):
    decisions = [policy.observe(state, finding("XID_79", GPU0), clock.advance(0.001)) for _ in range(10_000)]
    assert sum(d is not None for d in decisions) == 1
    assert state.suppressed == 9_999
    assert next(iter(state.active.values())).count == 10_000


def test_still_occurring_fault_is_reported_again_after_dedup_window_without_escalating(policy, state, clock):
    policy.observe(state, finding("XID_79", GPU0), clock())
    d = policy.observe(state, finding("XID_79", GPU0), clock.advance(policy.config.dedup_window_s + 1))
    assert d.outcome is Outcome.REPEATED and d.action is Action.REBOOT
    assert state.verdict.health is Health.PENDING_REBOOT  # a fault that never cleared is not a second incident


def test_dedup_is_per_component(policy, state, clock):
    assert policy.observe(state, finding("XID_79", GPU0), clock()) is not None
    assert policy.observe(state, finding("XID_79", GPU1), clock()) is not None
    assert len(state.active) == 2


def test_threshold_n_in_window(policy, state, clock):
    comp = "pci:0000:00:1d.0"
    first = policy.observe(state, finding("PCIE_AER_NONFATAL", comp), clock())
    assert first.outcome is Outcome.BELOW_THRESHOLD and state.active == {}
    assert policy.observe(state, finding("PCIE_AER_NONFATAL", comp), clock.advance(60)) is None
    d = policy.observe(state, finding("PCIE_AER_NONFATAL", comp), clock.advance(60))
    assert d.outcome is Outcome.ACTIVATED and d.action is Action.WATCH
    assert state.verdict.health is Health.SCHEDULABLE  # watch never takes the node out of service


def test_threshold_window_slides(policy, state, clock):
    comp = "pci:0000:00:1d.0"
    policy.observe(state, finding("PCIE_AER_NONFATAL", comp), clock())
    policy.observe(state, finding("PCIE_AER_NONFATAL", comp), clock.advance(3000))
    # the first sighting falls out of the 3600 s window: 2 in window, not 3
    policy.observe(state, finding("PCIE_AER_NONFATAL", comp), clock.advance(1000))
    assert state.active == {}
    policy.observe(state, finding("PCIE_AER_NONFATAL", comp), clock.advance(10))
    assert len(state.active) == 1


def test_fault_clears_only_by_healthy_finding(policy, state, clock):
    policy.observe(state, finding("XID_154", GPU0, recommended_action=Action.RESET_GPU), clock())
    assert state.verdict.health is Health.UNSCHEDULABLE
    clock.advance(30 * 86400)  # time alone never clears a fault
    policy.observe(state, finding("XID_13", GPU1), clock())
    assert state.verdict.health is Health.UNSCHEDULABLE
    d = policy.observe(state, finding("XID_154", GPU0, healthy=True), clock.advance(1))
    assert d.outcome is Outcome.CLEARED and state.verdict.health is Health.SCHEDULABLE
    assert state.verdict.generation == 2


def test_healthy_finding_for_other_component_clears_nothing(policy, state, clock):
    policy.observe(state, finding("XID_154", GPU0, recommended_action=Action.REBOOT), clock())
    assert policy.observe(state, finding("XID_154", GPU1, healthy=True), clock()) is None
    assert state.verdict.health is Health.PENDING_REBOOT


def test_operator_clear(policy, state, clock):
    policy.observe(state, finding("XID_79", GPU0), clock())
    policy.observe(state, finding("XID_48", GPU1), clock())
    assert policy.operator_clear(state, clock(), code="NOPE") == []
    ds = policy.operator_clear(state, clock(), component=GPU0)
    assert [d.code for d in ds] == ["XID_79"] and ds[0].outcome is Outcome.CLEARED
    assert state.verdict.health is Health.UNSCHEDULABLE
    policy.operator_clear(state, clock())
    assert state.verdict.health is Health.SCHEDULABLE and state.active == {}


def test_named_action_raises_active_fault(policy, state, clock):
    d1 = policy.observe(state, finding("XID_154", GPU0, recommended_action=Action.RESET_GPU), clock())
    assert d1.action is Action.RESET_GPU and state.verdict.health is Health.UNSCHEDULABLE
    d2 = policy.observe(state, finding("XID_154", GPU0, recommended_action=Action.REBOOT), clock.advance(1))
    assert d2.outcome is Outcome.RAISED and state.verdict.health is Health.PENDING_REBOOT
    # a milder named action later does not lower it: only a healthy finding does
    assert policy.observe(state, finding("XID_154", GPU0, recommended_action=Action.RESET_GPU),
                          clock.advance(1)) is None
    assert state.verdict.health is Health.PENDING_REBOOT


def test_named_action_ignored_unless_catalog_trusts_it(policy, state, clock):
    d = policy.observe(state, finding("XID_79", GPU0, recommended_action=Action.REPLACE), clock())
    assert d.action is Action.REBOOT


def test_fault_back_after_reboot_escalates_to_replace(policy, state, clock):
    policy.on_boot(state, "boot-1", clock())
    policy.observe(state, finding("XID_79", GPU0), clock.advance(10))
    ds = policy.on_boot(state, "boot-2", clock.advance(600))
    assert [d.outcome for d in ds] == [Outcome.REMEDIED]
    assert state.verdict.health is Health.SCHEDULABLE
    d = policy.observe(state, finding("XID_79", GPU0), clock.advance(3600))
    assert d.outcome is Outcome.ESCALATED and d.action is Action.REPLACE
    assert "after a reboot" in d.reason
    assert state.verdict.health is Health.PENDING_REPLACEMENT


def test_fault_back_after_post_reboot_window_does_not_escalate(policy, state, clock):
    policy.on_boot(state, "boot-1", clock())
    policy.observe(state, finding("XID_79", GPU0), clock())
    policy.on_boot(state, "boot-2", clock.advance(60))
    d = policy.observe(state, finding("XID_79", GPU0), clock.advance(policy.config.post_reboot_window_s + 1))
    assert d.outcome is Outcome.ACTIVATED and d.action is Action.REBOOT


def test_same_fault_twice_within_window_escalates(policy, state, clock):
    policy.observe(state, finding("XID_48", GPU0), clock())
    assert state.verdict.health is Health.UNSCHEDULABLE
    policy.operator_clear(state, clock.advance(600))  # e.g. an operator reset the GPU
    d = policy.observe(state, finding("XID_48", GPU0), clock.advance(3600))
    assert d.outcome is Outcome.ESCALATED and d.action is Action.REBOOT


def test_repeat_outside_window_does_not_escalate(policy, state, clock):
    policy.observe(state, finding("XID_48", GPU0), clock())
    policy.operator_clear(state, clock.advance(60))
    d = policy.observe(state, finding("XID_48", GPU0), clock.advance(policy.config.repeat_window_s + 61))
    assert d.outcome is Outcome.ACTIVATED and d.action is Action.RESET_GPU


def test_escalation_can_be_disabled_per_entry(clock):
    policy = Policy(load_catalog({"XID_79": {"escalate": False}}))
    state = PolicyState()
    policy.on_boot(state, "a", clock())
    policy.observe(state, finding("XID_79", GPU0), clock())
    policy.on_boot(state, "b", clock.advance(60))
    d = policy.observe(state, finding("XID_79", GPU0), clock.advance(60))
    assert d.outcome is Outcome.ACTIVATED and d.action is Action.REBOOT


def test_replace_level_faults_survive_a_reboot(policy, state, clock):
    policy.on_boot(state, "a", clock())
    policy.observe(state, finding("NEURON_SRAM_UNCORRECTABLE_ERROR", "neuron:0",
                                  recommended_action=Action.REPLACE), clock())
    assert policy.on_boot(state, "b", clock.advance(60)) == []
    assert state.verdict.health is Health.PENDING_REPLACEMENT


def test_same_boot_is_not_a_reboot(policy, state, clock):
    policy.on_boot(state, "a", clock())
    policy.observe(state, finding("XID_79", GPU0), clock())
    assert policy.on_boot(state, "a", clock.advance(60)) == []
    assert state.verdict.health is Health.PENDING_REBOOT


def test_clear_on_reboot_can_be_turned_off(catalog, clock):
    policy = Policy(catalog, PolicyConfig(clear_on_reboot=False))
    state = PolicyState()
    policy.on_boot(state, "a", clock())
    policy.observe(state, finding("XID_79", GPU0), clock())
    policy.on_boot(state, "b", clock.advance(60))
    assert state.verdict.health is Health.PENDING_REBOOT


def test_observe_only_check_is_logged_but_never_changes_verdict(catalog, clock):
    policy = Policy(catalog, PolicyConfig(check_modes={"kernel_log": CheckMode.OBSERVE}))
    state = PolicyState()
    d = policy.observe(state, finding("XID_79", GPU0), clock())
    assert d.outcome is Outcome.ACTIVATED and d.enforced is False and d.action is Action.REBOOT
    assert state.verdict.health is Health.SCHEDULABLE
    # another check in enforce mode still counts
    policy.observe(state, finding("XID_79", GPU1, check="nvml"), clock())
    assert state.verdict.health is Health.PENDING_REBOOT


def test_check_failure_is_never_a_hardware_fault(policy, state, clock):
    from nodemedic.model import check_failed, check_recovered
    d = policy.observe(state, check_failed("dcgm", "dcgmi not found"), clock())
    assert d.action is Action.WATCH and state.verdict.health is Health.SCHEDULABLE
    assert policy.observe(state, check_recovered("dcgm"), clock()).outcome is Outcome.CLEARED
    assert state.active == {}


def test_strongest_action_wins_and_verdict_lists_newest_20(policy, state, clock):
    for i in range(25):
        policy.observe(state, finding("XID_92", f"gpu:0000:{i:02x}:00.0"), clock.advance(1))
    policy.observe(state, finding("XID_48", GPU0), clock.advance(1))
    policy.observe(state, finding("XID_64", GPU1), clock.advance(1))
    v = state.verdict
    assert v.health is Health.PENDING_REBOOT
    assert len(v.faults) == 20 and v.faults[0].code == "XID_64" and v.faults[1].code == "XID_48"
    assert v.fault_reasons == ["XID_48", "XID_64"]  # watch-level faults are details, not reasons


def test_unknown_codes_fall_back_to_family_then_default(policy, state, clock):
    d = policy.observe(state, finding("XID_999", GPU0), clock())
    assert d.action is Action.WATCH and d.type == "GpuXid"
    d = policy.observe(state, finding("SOMETHING_NEW", "node"), clock())
    assert d.action is Action.WATCH


def test_history_is_bounded(policy, state, clock):
    for i in range(500):
        policy.observe(state, finding("XID_92", f"gpu:{i:04x}:00:00.0"), clock.advance(1))
    assert len(state.history) == 200
    assert len(state.noted) <= 257


def test_state_survives_serialisation_mid_incident(policy, state, clock):
    policy.on_boot(state, "a", clock())
    policy.observe(state, finding("XID_79", GPU0), clock())
    restored = PolicyState.model_validate_json(state.model_dump_json())
    assert policy.observe(restored, finding("XID_79", GPU0), clock.advance(1)) is None
    policy.on_boot(restored, "b", clock.advance(60))
    d = policy.observe(restored, finding("XID_79", GPU0), clock.advance(60))
    assert d.outcome is Outcome.ESCALATED


def test_folded_repeats_count_like_separate_sightings(policy, state, clock):
    storm = finding("XID_79", GPU0)
    storm.repeats = 5000
    d = policy.observe(state, storm, clock())
    assert d.outcome is Outcome.ACTIVATED and d.count == 5000
    assert state.suppressed == 4999
    more = finding("XID_79", GPU0)
    more.repeats = 1000
    assert policy.observe(state, more, clock.advance(1)) is None
    assert state.active[f"XID_79|{GPU0}"].count == 6000 and state.suppressed == 5999


def test_folded_repeats_reach_a_threshold_at_once(policy, state, clock):
    burst = finding("PCIE_AER_NONFATAL", "pci:0000:00:1d.0")
    burst.repeats = 3
    d = policy.observe(state, burst, clock())
    assert d.outcome is Outcome.ACTIVATED and len(state.active) == 1
    two = finding("PCIE_AER_NONFATAL", "pci:0000:00:1c.0")
    two.repeats = 2
    assert policy.observe(state, two, clock()).outcome is Outcome.BELOW_THRESHOLD
    assert policy.observe(state, finding("PCIE_AER_NONFATAL", "pci:0000:00:1c.0"), clock()).outcome \
        is Outcome.ACTIVATED


def test_destructive_action_waits_for_a_second_source(policy, state, clock):
    d = policy.observe(state, finding("GPU_COUNT_MISMATCH", "node", check="nvml.fields"), clock())
    assert d.outcome is Outcome.ACTIVATED and d.action is Action.WATCH and "held at watch" in d.reason
    assert state.verdict.health is Health.SCHEDULABLE
    # the same source again (another NVML check) is not independent
    assert policy.observe(state, finding("GPU_COUNT_MISMATCH", "node", check="nvml.events"), clock()) is None
    assert state.verdict.health is Health.SCHEDULABLE
    d = policy.observe(state, finding("GPU_COUNT_MISMATCH", "node", check="nvidia_smi"), clock.advance(5))
    assert d.outcome is Outcome.CORROBORATED and d.action is Action.REBOOT
    assert "nvml and nvidia_smi" in d.reason
    assert state.verdict.health is Health.PENDING_REBOOT
    assert state.active["GPU_COUNT_MISMATCH|node"].sources == ["nvml", "nvidia_smi"]


def test_one_sources_all_clear_does_not_outvote_another(policy, state, clock):
    policy.observe(state, finding("GPU_LOST", GPU0, check="nvml.fields"), clock())
    policy.observe(state, finding("GPU_LOST", GPU0, check="pci"), clock())
    assert state.verdict.health is Health.PENDING_REBOOT
    assert policy.observe(state, finding("GPU_LOST", GPU0, check="nvml.fields", healthy=True), clock()) is None
    assert state.verdict.health is Health.PENDING_REBOOT
    d = policy.observe(state, finding("GPU_LOST", GPU0, check="pci", healthy=True), clock())
    assert d.outcome is Outcome.CLEARED and state.verdict.health is Health.SCHEDULABLE


def test_held_fault_clears_when_its_only_source_recovers(policy, state, clock):
    policy.observe(state, finding("GPU_LOST", GPU0, check="nvml.fields"), clock())
    d = policy.observe(state, finding("GPU_LOST", GPU0, check="nvml.fields", healthy=True), clock())
    assert d.outcome is Outcome.CLEARED and state.active == {}


def test_deep_check_hold_and_status(policy, state, clock):
    from nodemedic.policy import DeepCheckRun

    run = DeepCheckRun(run_id="r1", started=clock.now, expires=clock.now + 600)
    gen = state.verdict.generation
    policy.deep_check_begin(state, run, clock.now)
    v = state.verdict
    assert (v.health, v.deep_check, v.action, v.fault_reasons) == (Health.UNSCHEDULABLE, "InProgress", "none", [])
    assert v.generation == gen + 1
    assert not policy.deep_check_end(state, "other-run", "Passed", clock.now)  # not the run holding the node
    assert policy.deep_check_end(state, "r1", "Passed", clock.advance(60))
    assert (state.verdict.health, state.verdict.deep_check) == (Health.SCHEDULABLE, "Passed")
    assert state.verdict.generation == gen + 2 and state.deep_run is None


def test_deep_check_without_hold_and_faults_found_during_the_run(policy, state, clock):
    from nodemedic.policy import DeepCheckRun

    policy.deep_check_begin(state, DeepCheckRun(run_id="r", started=0, expires=1e12, hold=False), clock.now)
    assert state.verdict.health is Health.SCHEDULABLE and state.verdict.deep_check == "InProgress"
    policy.observe(state, finding("NCCL_BUSBW_LOW", "node", check="nccl.all_reduce"), clock.now)
    policy.deep_check_end(state, "r", "Failed", clock.now)
    assert state.verdict.health is Health.PENDING_REBOOT and state.verdict.deep_check == "Failed"


def test_deep_check_lease_expires(policy, state, clock):
    from nodemedic.policy import DeepCheckRun

    policy.deep_check_begin(state, DeepCheckRun(run_id="r", started=clock.now, expires=clock.now + 10), clock.now)
    assert not policy.deep_check_expire(state, clock.advance(9))
    assert policy.deep_check_expire(state, clock.advance(2))
    assert (state.verdict.health, state.verdict.deep_check) == (Health.SCHEDULABLE, "Error")
