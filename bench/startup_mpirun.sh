#!/bin/sh
# startup_mpirun.sh: how long kolo_comm_init takes under mpirun over ssh on a simulated cluster
# (scripts/cluster.sh), with rank 0's store address handed out through mpirun's PMIx server
# against the same job given KOLO_ADDR. Each run starts bench/comm_init_time.py on every rank,
# which times its own kolo_comm_init; a run's figure is the slowest rank's. The two ways alternate
# for ROUNDS rounds, so that a machine whose load changes treats them alike. Prints every run as
# "way round seconds", then the median per way; -o FILE also writes the runs as tab-separated rows.
#
#   sh bench/startup_mpirun.sh [-o FILE] [HOSTS [RANKS_PER_HOST [ROUNDS]]]   (default 4 2 7)
#
# Needs root (network namespaces), mpirun, sshd and a build in build/ made with PMIx. Its hosts get
# addresses in 10.82.0.0/24 and fd82::/64, beside the tests' clusters.
set -eu
cd "$(dirname "$0")/.."
tsv=""
if [ "${1:-}" = "-o" ]; then
  tsv=$2
  shift 2
fi
hosts=${1:-4}
per_host=${2:-2}
rounds=${3:-7}
name=kolostart
export CLUSTER_SUBNET=10.82.0 CLUSTER_SUBNET6=fd82
# Only because the simulated cluster needs root; users are not.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
trap 'sh scripts/cluster.sh down "$name"' EXIT
sh scripts/cluster.sh up "$name" "$hosts"
sh scripts/cluster.sh sshd "$name"
secret=/run/kolo-cluster/$name/job.secret
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$secret"
chmod 600 "$secret"
list=$(seq 1 "$hosts" | sed "s/.*/$name&:$per_host/" | paste -sd, -)

run() {  # way round [mpirun arguments]
  way=$1
  round=$2
  shift 2
  output=$(sh scripts/cluster.sh exec "$name" 1 mpirun --host "$list" --bind-to none \
    --map-by slot -x KOLO_SECRET_FILE="$secret" -x KOLO_LIBRARY="$PWD/build/capi/libkolo.so" \
    "$@" /usr/bin/python3 bench/comm_init_time.py)
  # Every rank's figure, wherever mpirun's forwarding put it in the lines.
  figures=$(echo "$output" | grep -o 'kolo_comm_init [0-9.]* s' | awk '{ print $2 }')
  ranks=$(echo "$figures" | grep -c .)
  [ "$ranks" -eq $((hosts * per_host)) ] || {
    echo "$output" >&2
    echo "startup_mpirun.sh: $ranks of $((hosts * per_host)) ranks reported" >&2
    exit 1
  }
  seconds=$(echo "$figures" | sort -n | tail -1)
  printf '%s\t%s\t%s\n' "$way" "$round" "$seconds"
}

runs=$(
  for round in $(seq 1 "$rounds"); do
    run pmix "$round"
    run kolo_addr "$round" -x KOLO_ADDR="${name}1:$((29500 + round))"
  done
)
echo "$runs"
[ -z "$tsv" ] || printf 'way\tround\tseconds\n%s\n' "$runs" >"$tsv"
for way in pmix kolo_addr; do
  echo "$runs" | awk -v way="$way" '$1 == way { print $3 }' | sort -n |
    awk -v way="$way" '{ v[NR] = $1 } END { m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "median %s: %.4f s over %d runs\n", way, m, NR }'
done
