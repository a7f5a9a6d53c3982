"""The agent with the Slurm backend against a real slurmctld + slurmd: fault line appended -> node drained in sinfo."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corpus import syslog, xid_79
from harness import Result, Sizes, append_fd, check, info, ms, nodemedic_command, percentile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from slurm_cluster import SlurmCluster, available  # noqa: E402

NAME = "slurm"
TARGET_P99_S = 1.0


def run(sizes: Sizes) -> list[Result]:
    why = available()
    if why:
        return [info(NAME, "skipped", why)]
    faults = 20 if sizes.injections < 100 else 30
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cluster = SlurmCluster(root / "slurm").start()
        log = root / "kern.log"
        log.write_text("")
        env = {k: v for k, v in os.environ.items() if not k.startswith("NODEMEDIC_")}
        env.update(SLURM_CONF=str(cluster.conf), NODEMEDIC_IMDS__ENABLED="false", NODEMEDIC_ACTIONS__BACKEND="slurm",
                   NODEMEDIC_ACTIONS__SLURM__NODE_NAME=cluster.node, PYTHONUNBUFFERED="1",
                   NODEMEDIC_RECOVERY__SOCKET=str(root / "recovery.sock"))
        state = root / "state"
        agent = subprocess.Popen([*nodemedic_command(), "run", "--config", "/dev/null", "--kernel-log", str(log),
                                  "--state-dir", str(state), "--metrics-port", "0"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        try:
            assert agent.stdout is not None
            for line in agent.stdout:
                if '"msg":"nodemedic ready' in line:
                    break
            fd = append_fd(log)
            samples = []
            for i in range(faults):
                os.write(fd, (syslog(xid_79(1, i)) + "\n").encode())
                sent = time.perf_counter()
                cluster.wait_state(("drained",), 10)
                samples.append(time.perf_counter() - sent)
                subprocess.run([*nodemedic_command(), "clear", "--all", "--state-dir", str(state)], env=env,
                               capture_output=True, timeout=30)
                cluster.wait_state(("idle",), 10)
            os.close(fd)
        finally:
            agent.terminate()
            agent.wait(15)
            cluster.stop()
    p99 = percentile(samples, 99)
    return [
        info(NAME, f"fault line -> drained in sinfo p50 ({faults} faults)", ms(percentile(samples, 50))),
        check(NAME, "fault line -> drained in sinfo p99", ms(p99), f"<= {ms(TARGET_P99_S)}", p99 <= TARGET_P99_S),
    ]
