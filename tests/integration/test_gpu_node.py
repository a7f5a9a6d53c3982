"""A GPU node made of fakes (nvidia-smi and dcgmi executables replaying real outputs, a fake /sys PCI tree):
`nodemedic check` and `nodemedic run` as subprocesses, with corroboration across sources."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import pytest

from conftest import BIN, REPO
from fakes.sysfs import hgx_node

FAKE_BIN = REPO / "tests" / "fakes" / "bin"
pytestmark = pytest.mark.integration


@pytest.fixture
def gpu_node(tmp_path, agent_env):
    """A p5.48xlarge whose nvidia-smi shows 1 GPU (a real A100 capture) and whose PCI bus has `gpus` GPUs."""
    sysfs = tmp_path / "sys"
    log = tmp_path / "kern.log"
    log.write_text("")
    env = dict(agent_env)
    env.update({
        "PATH": f"{FAKE_BIN}:{env.get('PATH', '')}",
        "NODEMEDIC_INSTANCE_TYPE": "p5.48xlarge",
        "NODEMEDIC_CHECKS__NVML__ENABLED": "false",     # no libnvidia-ml here; NVML is covered by its fake
        "NODEMEDIC_CHECKS__PCI__SYSFS_ROOT": str(sysfs),
        "NODEMEDIC_CHECKS__PCI__INTERVAL_S": "0.5",
        "NODEMEDIC_CHECKS__NVIDIA_SMI__INTERVAL_S": "0.5",
        "NODEMEDIC_CHECKS__DCGM__INTERVAL_S": "0.5",
        "NODEMEDIC_CHECKS__KERNEL_LOG__PATH": str(log),
        "NODEMEDIC_CHECKS__KERNEL_LOG__SOURCE": "file",
        "NODEMEDIC_STATE_DIR": str(tmp_path / "state"),
        "FAKE_NVIDIA_SMI_FIXTURE": "nvsmi_xml_01_a100_sxm4_535.xml",
        "DCGMI_FAKE_POLICY_DELAY": "3600",
    })
    return env, sysfs


def check(env) -> tuple[int, dict]:
    out = subprocess.run([str(BIN / "nodemedic"), "check", "--json"], capture_output=True, text=True, env=env,
                         timeout=60)
    return out.returncode, json.loads(out.stdout)


def test_check_needs_two_sources_to_call_for_a_reboot(gpu_node):
    env, sysfs = gpu_node
    hgx_node(sysfs, gpus=8)  # the bus still has all 8: only nvidia-smi is short
    code, doc = check(env)
    assert code == 0, doc
    names = {r["check"] for r in doc["checks"]}
    assert {"nvidia_smi", "pci", "dcgm.health", "kernel_log"} <= names and "dcgm.policy" not in names
    held = {f["code"]: f for f in doc["faults"]}["GPU_COUNT_MISMATCH"]
    assert held["action"] == 1 and held["held_action"] == 3  # watch, wanting a reboot
    assert doc["verdict"]["health"] == "Schedulable"


def test_check_with_agreeing_sources_is_unhealthy(gpu_node, tmp_path):
    env, sysfs = gpu_node
    hgx_node(sysfs, gpus=1)
    code, doc = check(env)
    assert code == 1
    fault = {f["code"]: f for f in doc["faults"]}["GPU_COUNT_MISMATCH"]
    assert sorted(fault["sources"]) == ["nvidia_smi", "pci"]
    assert doc["verdict"]["health"] == "UnschedulablePendingReboot"


def test_check_with_dcgm_down_is_not_a_gpu_fault(gpu_node):
    env, sysfs = gpu_node
    hgx_node(sysfs, gpus=1)
    env = dict(env, DCGMI_FAKE_DOWN="1", NODEMEDIC_INSTANCE_TYPE="g5.xlarge",
               FAKE_NVIDIA_SMI_FIXTURE="nvsmi_xml_04_a10g_aws_515.xml")
    code, doc = check(env)
    rows = {r["check"]: r for r in doc["checks"]}
    assert rows["dcgm.health"]["status"] == "failed" and "DCGM not available" in rows["dcgm.health"]["error"]
    assert rows["nvidia_smi"]["status"] == "ok" and rows["pci"]["status"] == "ok"
    assert code == 2 and doc["verdict"]["health"] == "Schedulable"  # could not check everything; no fault
    assert doc["faults"] == []  # and the real g5 capture's x8 PCIe link is not a fault either


def test_running_agent_corroborates_across_sources(gpu_node):
    env, sysfs = gpu_node
    addresses = hgx_node(sysfs, gpus=8)
    proc = subprocess.Popen([str(BIN / "nodemedic"), "run", "--metrics-port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, text=True)
    seen: list[dict] = []

    def wait(pred, timeout=20.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            try:
                event = json.loads(line)
            except ValueError:
                continue
            seen.append(event)
            if pred(event):
                return event
        raise AssertionError(f"not seen; last events: {seen[-10:]}")

    try:
        held = wait(lambda e: e.get("code") == "GPU_COUNT_MISMATCH")
        assert held["HealthMonitoringAgentDetectionEvent"] == "activated" and held["health"] == "Schedulable"
        for a in addresses[1:]:  # seven GPUs drop off the bus as well
            shutil.rmtree(sysfs / "bus" / "pci" / "devices" / a)
        confirmed = wait(lambda e: e.get("HealthMonitoringAgentDetectionEvent") == "corroborated")
        assert confirmed["health"] == "UnschedulablePendingReboot"
        assert confirmed["reason"].endswith("confirmed by nvidia_smi and pci")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
