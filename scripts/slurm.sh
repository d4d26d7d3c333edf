#!/bin/sh
# A real Slurm on a simulated cluster (scripts/cluster.sh): Debian's slurmctld on host 1, a slurmd
# on every host under the host's own name, and munge for their credentials, each daemon started
# inside its host's namespaces through `cluster.sh exec`.
#
#   slurm.sh up NAME      after `cluster.sh up NAME HOSTS`: writes the configuration, starts the
#                         daemons and waits until every node is idle; prints the SLURM_CONF to use
#   slurm.sh conf NAME    prints the SLURM_CONF that srun, sbatch and squeue must be given
#   slurm.sh down NAME    stops the daemons (`cluster.sh down NAME` also kills them)
#
# One munged serves every host: the hosts share the machine's file system, so its socket is one
# path that every namespace reaches (a path-bound Unix socket ignores network namespaces), and a
# second munged on the same key would add nothing but processes. Its state lives beside Slurm's.
#
# Every file lives under /run/kolo-cluster/NAME/slurm (removed by `cluster.sh down`): slurm.conf
# and cgroup.conf in etc/, each node's spool, log and pid file under nodes/HOST/. What the shared
# file system would make collide is made per host: each slurmd runs in a mount namespace of its own
# (the one cluster.sh exec gives it) where etc/mpi.conf is its node's own file, naming its own
# PMIxCliTmpDirBase, since `srun --mpi=pmix` fails with "Cannot create client cli tmpdir ... File
# exists" when every node's PMIx server shares one directory.
#
# The daemons run as root with proctrack/linuxproc and task/none (no cgroups to set up); slurmd
# still loads a cgroup plugin, so cgroup.conf forces cgroup/v1, the tree this machine mounts.
# The nodes declare 2 CPUs each, whatever the machine has (SlurmdParameters=config_overrides).
set -eu

usage() {
  sed -n '6,9p' "$0" >&2
  exit 2
}

[ $# -eq 2 ] || usage
command=$1
name=$2
case "$name" in
  *[!a-z0-9]* | "") echo "slurm.sh: NAME must be lower-case letters and digits: '$name'" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
cluster="$here/cluster.sh"
state=/run/kolo-cluster/$name
slurm=$state/slurm
conf=$slurm/etc/slurm.conf
# Slurm's own wait for a daemon or a node is bounded here: seconds.
start_timeout=${SLURM_SH_TIMEOUT:-30}

hosts_count() {
  [ -f "$state/hosts-count" ] || { echo "slurm.sh: no cluster '$name' (run: cluster.sh up $name HOSTS)" >&2; exit 2; }
  cat "$state/hosts-count"
}

# Stops the daemons whose pid files are given: SIGTERM to all, then SIGKILL to those still there
# after 5 s.
stop_pidfiles() {
  pids=""
  for file in "$@"; do
    [ -f "$file" ] && pids="$pids $(cat "$file")"
  done
  [ -n "$pids" ] || return 0
  # shellcheck disable=SC2086 # one word per pid
  kill $pids 2>/dev/null || true
  for _ in $(seq 1 50); do
    alive=""
    for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive="$alive $pid"; done
    [ -n "$alive" ] || return 0
    sleep 0.1
  done
  # shellcheck disable=SC2086
  kill -9 $alive 2>/dev/null || true
}

down() {
  [ -d "$slurm" ] || return 0
  stop_pidfiles "$slurm"/nodes/[0-9]*/slurmd.pid "$slurm/slurmctld.pid"
  stop_pidfiles "$slurm/munge/munged.pid"
  rm -rf "$slurm"
}

write_config() {
  hosts=$1
  mkdir -p "$slurm/etc" "$slurm/munge" "$slurm/ctld"
  chmod 700 "$slurm/munge"
  head -c 1024 /dev/urandom >"$slurm/munge/munge.key"
  chmod 400 "$slurm/munge/munge.key"
  for host in $(seq 1 "$hosts"); do
    mkdir -p "$slurm/nodes/$host/spool" "$slurm/nodes/$host/pmix"
    printf 'PMIxCliTmpDirBase=%s\n' "$slurm/nodes/$host/pmix" >"$slurm/nodes/$host/mpi.conf"
  done
  # The file every slurmd's mount namespace covers with its own.
  : >"$slurm/etc/mpi.conf"
  printf 'CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' >"$slurm/etc/cgroup.conf"
  cat >"$conf" <<EOF
ClusterName=$name
SlurmctldHost=${name}1
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$slurm/munge/munge.socket
StateSaveLocation=$slurm/ctld
SlurmctldPidFile=$slurm/slurmctld.pid
SlurmctldLogFile=$slurm/slurmctld.log
SlurmdSpoolDir=$slurm/nodes/%n/spool
SlurmdPidFile=$slurm/nodes/%n/slurmd.pid
SlurmdLogFile=$slurm/nodes/%n/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
SchedulerType=sched/backfill
NodeName=${name}[1-$hosts] CPUs=2 State=UNKNOWN
PartitionName=hosts Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

up() {
  hosts=$(hosts_count)
  down
  write_config "$hosts"
  # The %n in the paths above is the node's name; the directories are made per host number.
  for host in $(seq 1 "$hosts"); do
    ln -s "$slurm/nodes/$host" "$slurm/nodes/$name$host"
  done
  sh "$cluster" exec "$name" 1 munged --force --key-file="$slurm/munge/munge.key" \
    --socket="$slurm/munge/munge.socket" --pid-file="$slurm/munge/munged.pid" \
    --log-file="$slurm/munge/munged.log" --seed-file="$slurm/munge/munged.seed"
  SLURM_CONF=$conf sh "$cluster" exec "$name" 1 slurmctld -f "$conf"
  for host in $(seq 1 "$hosts"); do
    SLURM_CONF=$conf sh "$cluster" exec "$name" "$host" sh -c \
      'mount --bind "$1" "$2" && exec slurmd -f "$3" -N "$4"' \
      sh "$slurm/nodes/$host/mpi.conf" "$slurm/etc/mpi.conf" "$conf" "$name$host"
  done
  # Ready when every node is idle.
  waited=0
  while :; do
    idle=$(SLURM_CONF=$conf sh "$cluster" exec "$name" 1 sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)
    [ "$idle" -ge "$hosts" ] && break
    if [ "$waited" -ge $((start_timeout * 10)) ]; then
      echo "slurm.sh: after ${start_timeout}s only $idle of $hosts nodes are idle; see $slurm/slurmctld.log and $slurm/nodes/*/slurmd.log" >&2
      SLURM_CONF=$conf sh "$cluster" exec "$name" 1 sinfo -N -l >&2 || true
      exit 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
  echo "$conf"
}

case "$command" in
  up) up ;;
  conf) hosts_count >/dev/null; echo "$conf" ;;
  down) down ;;
  *) usage ;;
esac
