#!/bin/bash
# slurm.conf: Prolog=/usr/local/lib/nodemedic/prolog.sh
# A non-zero exit (the timeout's 124 included) makes Slurm drain the node and requeue the job, so the timeout
# bounds how long a job can wait on this hook.
# slurmd runs hooks with a bare environment: fix PATH so /usr/local/bin/nodemedic and coreutils' timeout are found.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
exec timeout --kill-after=5 50 nodemedic slurm prolog "$@"
