"""A real one-node Slurm cluster (Debian's slurm-wlm) on localhost for the tests: slurmctld + slurmd, auth/none."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("slurmctld", "slurmd", "scontrol", "sinfo", "srun", "sbatch")


def available() -> str | None:
    """None when a cluster can be started here, else why not."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm binaries missing ({', '.join(missing)}): make test installs slurm-wlm"
    if os.geteuid() != 0:
        return "slurmd needs root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """slurm.conf in a temp dir, both daemons in the foreground, `env` for every client command."""

    def __init__(self, root: Path):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []

    def write_conf(self) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=nodemedic-test
SlurmctldHost={self.node}(127.0.0.1)
AuthType=auth/none
CredType=cred/none
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def start(self) -> SlurmCluster:
        self.write_conf()
        self.start_ctld()
        self._spawn(["slurmd", "-D", "-f", str(self.conf)], "slurmd.out")
        self.wait_state(("idle",), 30)
        return self

    def start_ctld(self) -> None:
        self._spawn(["slurmctld", "-D", "-c", "-f", str(self.conf)], "slurmctld.out")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.scontrol("ping", check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"slurmctld did not answer: {self.log_tail()}")

    def stop_ctld(self) -> None:
        for p in self._procs:
            if p.args[0] == "slurmctld" and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=20)
        self._procs = [p for p in self._procs if p.args[0] != "slurmctld"]

    def _spawn(self, args: list[str], out: str) -> None:
        log = open(self.root / "log" / out, "ab")
        self._procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True))

    def stop(self) -> None:
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self._procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self._procs.clear()

    # -- client side -----------------------------------------------------------------------------------------------
    def run(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
        return out

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("scontrol", *args, check=check)

    def node_state(self) -> tuple[str, str]:
        """(state, reason) as `sinfo -N -o "%N %T %E"` shows them, less the flag suffixes (`idle*`: not responding)."""
        # The whole listing, filtered here: Slurm 22.05's `sinfo -n NODE` can keep a stale `mixed` after a job.
        for line in self.run("sinfo", "-h", "-N", "-o", "%N|%T|%E").stdout.splitlines():
            name, state, reason = (line.split("|", 2) + ["", ""])[:3]
            if name == self.node:
                return state.rstrip("*~#!%$@^-"), reason
        raise AssertionError(f"sinfo does not list {self.node}")

    def wait_state(self, states: tuple[str, ...], timeout: float = 10) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        last = ("?", "")
        while time.monotonic() < deadline:
            last = self.node_state()
            if last[0] in states:
                return last
            time.sleep(0.1)
        raise AssertionError(f"node {self.node} stayed {last}, wanted {states}")

    def reset_node(self) -> None:
        """Back to idle with no reason, whatever a test left behind."""
        self.run("scancel", "--full", "-w", self.node, check=False)
        self.scontrol("update", f"nodename={self.node}", "state=resume", check=False)
        try:
            self.wait_state(("idle",), 30)
        except AssertionError as exc:
            jobs = self.run("squeue", "-h", "-o", "%i %T %N %j", check=False).stdout
            jobs += self.run("scontrol", "show", "node", self.node, check=False).stdout
            raise AssertionError(f"{exc}; jobs: {jobs!r}; {self.log_tail()[-800:]}") from None

    def log_tail(self) -> str:
        parts = []
        for name in ("slurmctld.out", "slurmd.out", "slurmctld.log"):
            p = self.root / "log" / name
            if p.exists():
                parts.append(f"--- {name}\n" + p.read_text(errors="replace")[-1500:])
        return "\n".join(parts)
