#!/usr/bin/env bash
# A one-node development SLURM on this machine (Debian slurm-wlm + munge), for the `slurm` tests and
# for trying `cachescore run JOB --cluster slurm` without an HPC site. Run as root:
#
#   bash deploy/slurm/dev-cluster.sh          # install (if needed), configure, start, wait for sinfo
#   bash deploy/slurm/dev-cluster.sh stop     # stop slurmd, slurmctld, munged
#
# Writes /etc/slurm/slurm.conf for one node named after this host with its CPUs and memory
# (proctrack/linuxproc, task/none, select/cons_tres: no cgroups needed), one partition "debug".
set -euo pipefail

if [[ "${1:-start}" == "stop" ]]; then
    pkill -x slurmd || true; pkill -x slurmctld || true; pkill -x munged || true
    exit 0
fi
[[ $(id -u) -eq 0 ]] || { echo "dev-cluster.sh: run as root" >&2; exit 2; }

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm munge >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }
fi

HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))  # leave 1 GiB to the OS

# munge: a key, and /run/munge owned by the munge user
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
[[ -s /etc/munge/munge.key ]] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge; chmod 0755 /run/munge; chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
chown slurm:slurm /var/spool/slurmctld /var/log/slurm
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=cachescore-dev
SlurmctldHost=${HOST}
SlurmUser=slurm
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
InactiveLimit=0
KillWait=5
MinJobAge=5
NodeName=${HOST} CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 1 60); do
    if sinfo -h -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'; then
        sinfo
        exit 0
    fi
    scontrol update nodename="${HOST}" state=resume >/dev/null 2>&1 || true
    sleep 1
done
echo "dev-cluster.sh: SLURM did not come up; logs in /var/log/slurm" >&2
sinfo >&2 || true
exit 1
