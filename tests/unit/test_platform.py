"""Instance profiles, PCI bus enumeration, and EC2 maintenance events."""

from __future__ import annotations

import json

import pytest

from nodemedic.checks.base import CheckUnavailable, NodeContext
from nodemedic.checks.platform.imds import Imds
from nodemedic.checks.platform.maintenance import MaintenancePoller
from nodemedic.checks.platform.pci import PciGpuPoller, nvidia_gpu_addresses, responds
from nodemedic.checks.platform.profiles import ProfileError, load_profiles, profile_for
from nodemedic.model import Action

from fakes.imds import FakeImds
from fakes.sysfs import add_pci_device, hgx_node


@pytest.mark.parametrize("name,gpus,links,efa,neuron", [
    ("p4d.24xlarge", 8, 12, 4, None), ("p5.48xlarge", 8, 18, 32, None), ("ml.p5e.48xlarge", 8, 18, 32, None),
    ("p5en.48xlarge", 8, 18, 16, None), ("p6-b200.48xlarge", 8, 18, 8, None), ("trn1.32xlarge", 0, None, 8, 16),
    ("ML.TRN1N.32XLARGE", 0, None, 16, 16), ("trn2.48xlarge", 0, None, None, 16)])
def test_reference_profiles(name, gpus, links, efa, neuron):
    p = profile_for(name)
    assert (p.gpus, p.nvlinks_per_gpu, p.efa, p.neuron_devices) == (gpus, links, efa, neuron)


def test_profile_overrides_and_unknown_types():
    assert profile_for("m5.large") is None and profile_for(None) is None
    p = profile_for("p5.48xlarge", {"p5.48xlarge": {"efa": 16}, "ml.custom.xlarge": {"gpus": 2}})
    assert p.efa == 16 and p.gpus == 8
    assert load_profiles({"ml.custom.xlarge": {"gpus": 2}})["custom.xlarge"].gpus == 2
    with pytest.raises(ProfileError, match="gpus"):
        load_profiles({"p5.48xlarge": {"gpus": -1}})


def test_pci_enumeration_finds_gpus_in_bus_order(tmp_path):
    addresses = hgx_node(tmp_path)
    assert nvidia_gpu_addresses(tmp_path) == addresses
    add_pci_device(tmp_path, "0000:1a:00.0", pci_class=0x030000)  # a VGA-class NVIDIA GPU counts too
    assert "0000:1a:00.0" in nvidia_gpu_addresses(tmp_path)
    assert responds(tmp_path, addresses[0]) is True
    assert nvidia_gpu_addresses(tmp_path / "nothing") == []


def test_pci_poller_corroborating_findings(tmp_path):
    hgx_node(tmp_path, gpus=7, lost=("0000:64:00.0",))
    poller = PciGpuPoller(sysfs_root=tmp_path)
    assert poller.applies(NodeContext("n", "p5.48xlarge", profile_for("p5.48xlarge")))
    findings = poller.run()
    bad = {(f.code, f.component) for f in findings if not f.healthy}
    assert bad == {("GPU_COUNT_MISMATCH", "node"), ("GPU_LOST", "gpu:0000:64:00.0")}
    assert all(f.check == "pci" for f in findings)


def test_pci_poller_without_sysfs(tmp_path):
    poller = PciGpuPoller(expected_gpus=8, sysfs_root=tmp_path / "none")
    with pytest.raises(CheckUnavailable):
        poller.run()
    assert not PciGpuPoller(sysfs_root=tmp_path).applies(NodeContext("n"))


EVENT = {"NotBefore": "21 Jan 2019 09:00:43 GMT", "Code": "system-reboot", "Description": "scheduled reboot",
         "EventId": "instance-event-0d59937288b749b32", "NotAfter": "21 Jan 2019 09:17:23 GMT", "State": "active"}


def test_maintenance_events_become_findings_and_clear():
    meta = {"meta-data/instance-id": "i-0123", "meta-data/events/maintenance/scheduled": json.dumps([EVENT])}
    with FakeImds(meta) as fake:
        poller = MaintenancePoller(Imds(fake.endpoint, timeout_s=2))
        assert poller.applies(NodeContext("n"))
        [f] = poller.run()
        assert f.code == "MAINTENANCE_SCHEDULED" and f.recommended_action is Action.REBOOT
        assert f.component == "maintenance:instance-event-0d59937288b749b32"
        assert "21 Jan 2019 09:00:43 GMT" in f.message and f.evidence["not_after"] == EVENT["NotAfter"]
        fake.metadata["meta-data/events/maintenance/scheduled"] = json.dumps(
            [{**EVENT, "State": "completed"}, {**EVENT, "EventId": "e2", "Code": "instance-retirement"}])
        findings = poller.run()
        assert {(f.component, f.healthy) for f in findings} == {
            ("maintenance:e2", False), ("maintenance:instance-event-0d59937288b749b32", True)}
        assert [f.recommended_action for f in findings if not f.healthy] == [Action.REPLACE]
        fake.metadata["meta-data/events/maintenance/scheduled"] = "not json"
        with pytest.raises(ValueError, match="not a JSON list"):
            poller.run()


def test_maintenance_not_on_ec2():
    poller = MaintenancePoller(Imds("http://127.0.0.1:9", timeout_s=0.2))
    assert not poller.applies(NodeContext("n"))
    with pytest.raises(CheckUnavailable):
        poller.run()
