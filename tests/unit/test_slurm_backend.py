"""Pure parts of the Slurm backend: parsing scontrol's node record and the reasons written."""

from __future__ import annotations

from nodemedic.actions.slurm import SlurmBackend, SlurmConfig, summary_reason
from nodemedic.model import FaultDetail, Health, NodeVerdict
from nodemedic.slurmctl import parse_show_node

# `scontrol show node -o vm` from Slurm 22.05.8 (Debian bookworm), as the real test cluster prints it.
DRAINED = ("NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.22 "
           "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm "
           "Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1 AllocMem=0 "
           "FreeMem=22325 Sockets=2 Boards=1 State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A "
           "MCS_label=N/A Partitions=debug  BootTime=2026-11-22T05:07:02 SlurmdStartTime=2026-11-22T06:33:11 "
           "LastBusyTime=2026-11-22T06:33:11 CfgTRES=cpu=2,mem=1M,billing=2 AllocTRES= CapWatts=n/a "
           "CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s "
           "Reason=nodemedic: Xid 79 gpu 0000:3b:00.0 (reboot) [root@2026-11-22T06:33:11]")


def test_parse_show_node():
    info = parse_show_node(DRAINED)
    assert (info.name, info.addr, info.hostname) == ("vm", "127.0.0.1", "vm")
    assert info.reason == "nodemedic: Xid 79 gpu 0000:3b:00.0 (reboot)"
    assert info.is_("drain") and info.out_of_service and not info.is_("fail")
    failed = parse_show_node(DRAINED.replace("IDLE+DRAIN", "MIXED+FAIL").split(" Reason=")[0]
                             + " Reason=Action:Reboot [slurm@2026-11-22T06:33:11]")
    assert failed.reason == "Action:Reboot" and failed.is_("fail")
    idle = parse_show_node(DRAINED.replace("IDLE+DRAIN", "IDLE").split(" Reason=")[0])
    assert idle.reason == "" and not idle.out_of_service
    assert parse_show_node("Node vm not found") is None


def verdict(health=Health.PENDING_REBOOT, faults=(("XID_79", "gpu:0000:3b:00.0"),)) -> NodeVerdict:
    details = [FaultDetail(time=1.0, component=c, code=code, type="t", message="m", action="reboot")
               for code, c in faults]
    return NodeVerdict(health=health, action="reboot", fault_reasons=[code for code, _ in faults], faults=details)


def test_reasons():
    assert summary_reason(verdict(), "nodemedic:", 120) == "nodemedic: Xid 79 gpu 0000:3b:00.0 (reboot)"
    two = verdict(faults=(("XID_79", "gpu:0000:3b:00.0"), ("GPU_LOST", "gpu:0000:5d:00.0")))
    assert summary_reason(two, "nodemedic:", 120) == "nodemedic: Xid 79 gpu 0000:3b:00.0 +1 more (reboot)"
    odd = verdict(faults=(("X;Y\"Z", "gpu:a'b"),))
    r = summary_reason(odd, "nodemedic:", 30)
    assert len(r) <= 30 and not set(r) & set(";\"'")


def test_hyperpod_and_default_desired_states(tmp_path):
    hp = SlurmBackend(SlurmConfig(node_name="n"), tmp_path, profile="hyperpod", slurm=object())
    assert hp.desired(verdict()) == ("fail", "Action:Reboot")
    assert hp.desired(verdict(Health.PENDING_REPLACEMENT)) == ("fail", "Action:Replace")
    assert hp.desired(verdict(Health.UNSCHEDULABLE))[0] == "drain"
    assert hp.desired(verdict(Health.SCHEDULABLE, faults=())) is None
    default = SlurmBackend(SlurmConfig(node_name="n"), tmp_path, slurm=object())
    assert default.desired(verdict(Health.PENDING_REPLACEMENT))[0] == "drain"
