#!/usr/bin/env bash
# Start a real single-node Slurm cluster on this Debian machine (root, no systemd needed), so that
# `sbatch run.slurm` and `srun run.slurm` can be tested for real. CI runs it before the tests.
# Idempotent: a cluster that already answers `sinfo` is left alone.
set -euo pipefail
if sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then echo "slurm: already up"; exit 0; fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi
mkdir -p /run/munge /etc/munge /etc/slurm /var/log/slurm /var/spool/slurmctld /var/spool/slurmd
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; }
chown -R munge:munge /run/munge /etc/munge && chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
node=$(slurmd -C | head -n 1)   # NodeName=<host> CPUs=... RealMemory=... as this machine reports it
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=$(hostname)
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
# a requeued job waits cred_expire seconds before it starts again (default 120): 10 keeps the tests short
AuthInfo=cred_expire=10
# and then waits for a scheduling pass: every 60 s (main loop) or 30 s (backfill) by default; 1-2 s here
SchedulerParameters=sched_interval=2,bf_interval=1
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
pgrep -x slurmctld >/dev/null || slurmctld -c   # -c: forget jobs of a previous life (stale "running" ones)
pgrep -x slurmd >/dev/null || slurmd -c
for _ in $(seq 60); do
  sinfo -h -o %T 2>/dev/null | grep -q idle && { sinfo; exit 0; }
  sleep 1
done
echo "slurm did not come up; see /var/log/slurm/" >&2; exit 1
