#!/bin/bash
# slurm.conf: HealthCheckProgram=/usr/local/lib/nodemedic/healthcheck.sh
# slurmd kills a HealthCheckProgram after 60 s; the command only reads the agent's cached verdict, and the timeout
# keeps a hung one from running into slurmd's kill.
# slurmd runs hooks with a bare environment: fix PATH so /usr/local/bin/nodemedic and coreutils' timeout are found.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
exec timeout --kill-after=5 50 nodemedic slurm healthcheck "$@"
