#!/bin/sh
# startup_mpirun.sh: how long kolo_comm_init takes under mpirun over ssh on a simulated cluster
# (scripts/cluster.sh), starting through mpirun's PMIx server (one fence, no store) against the
# same job given KOLO_ADDR (rank 0's store), at one or more job shapes. Each run starts
# bench/comm_init_time.py on every rank with KOLO_DEBUG=INFO; each rank times its own
# kolo_comm_init, and under PMIx its INFO line "PMIx: N start-up records exchanged in T ms
# (PMIx_Init I ms, the fence F ms)" says what PMIx took. A run's figures are the slowest rank's
# (each figure's own maximum over the ranks). Shapes and the ways alternate for ROUNDS rounds,
# so that a machine whose load changes treats them alike. Prints every run, then per shape and way
# the medians over the rounds; -o FILE also writes the runs as tab-separated rows.
#
#   sh bench/startup_mpirun.sh [-o FILE] [-k ROUNDS] [-b LIBRARY] [SHAPE...]   (default: -k 7 4x2)
#
#   -b LIBRARY  a third way, "pmix_base": the PMIx start-up of another build's libkolo.so (an
#               earlier commit's, to compare against), interleaved with the other two; it may print
#               its PMIx line as earlier kolo did ("rank 0's store address exchanged in ...")
#
#   SHAPE   HxL: L ranks on each of H hosts (H 1..16, L 1..16), ranks host by host (mpirun's
#           --map-by slot), as bench/startup_perf.sh places them; e.g. 2x1 4x1 4x2 4x4
#
# Needs root (network namespaces), mpirun, sshd and a build in build/ made with PMIx. Its hosts get
# addresses in 10.82.0.0/24 and fd82::/64, beside the tests' clusters.
set -eu
cd "$(dirname "$0")/.."
fail() {
  echo "startup_mpirun.sh: $*" >&2
  exit 2
}
tsv=""
rounds=7
base=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) [ $# -ge 2 ] || fail "-o needs a file"; tsv=$2; shift 2 ;;
    -k) [ $# -ge 2 ] || fail "-k needs a number of rounds"; rounds=$2; shift 2 ;;
    -b) [ $# -ge 2 ] || fail "-b needs a library"; base=$(realpath "$2"); shift 2
        [ -f "$base" ] || fail "-b: no library at '$2'" ;;
    -*) fail "unknown option '$1'" ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || set -- 4x2
is_count() { case "$1" in *[!0-9]* | "" | 0*) return 1 ;; esac; }
is_count "$rounds" && [ "$rounds" -le 100 ] || fail "-k must be a number from 1 to 100: '$rounds'"
hosts=1
for shape in "$@"; do
  h=${shape%x*}
  l=${shape#*x}
  is_count "$h" && is_count "$l" && [ "$h" -le 16 ] && [ "$l" -le 16 ] ||
    fail "a SHAPE is HxL with H and L from 1 to 16: '$shape'"
  [ "$h" -gt "$hosts" ] && hosts=$h
done
[ "$(id -u)" = 0 ] || fail "needs root (network namespaces)"
name=kolompirun
export CLUSTER_SUBNET=10.82.0 CLUSTER_SUBNET6=fd82
# Only because the simulated cluster needs root; users are not.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
trap 'sh scripts/cluster.sh down "$name"' EXIT
trap 'exit 130' INT TERM HUP
sh scripts/cluster.sh up "$name" "$hosts"
sh scripts/cluster.sh sshd "$name"
secret=/run/kolo-cluster/$name/job.secret
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$secret"
chmod 600 "$secret"
echo "# startup_mpirun: shapes $*, $rounds rounds, commit $(git rev-parse --short HEAD)" >&2
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2

# The largest (smallest) number in the lines on stdin, or "-" if there is none.
largest() { sort -n | tail -1 | grep . || echo -; }
smallest() { sort -n | head -1 | grep . || echo -; }

run() {  # way shape round library [mpirun arguments]
  way=$1
  shape=$2
  round=$3
  library=$4
  shift 4
  h=${shape%x*}
  l=${shape#*x}
  list=$(seq 1 "$h" | sed "s/.*/$name&:$l/" | paste -sd, -)
  output=$(timeout 120 sh scripts/cluster.sh exec "$name" 1 mpirun --host "$list" --bind-to none \
    --map-by slot -x KOLO_DEBUG=INFO -x KOLO_SECRET_FILE="$secret" \
    -x KOLO_LIBRARY="$library" "$@" /usr/bin/python3 bench/comm_init_time.py 2>&1)
  # Every rank's figures, wherever mpirun's forwarding put them in the lines.
  figures=$(echo "$output" | grep -o 'kolo_comm_init [0-9.]* s' | awk '{ print $2 }')
  ranks=$(echo "$figures" | grep -c .)
  [ "$ranks" -eq $((h * l)) ] || {
    echo "$output" >&2
    echo "startup_mpirun.sh: $way $shape round $round: $ranks of $((h * l)) ranks reported" >&2
    exit 1
  }
  # "start-up records exchanged in T ms (PMIx_Init I ms, the fence F ms)", or earlier kolo's
  # "store address exchanged in ...": T, I, F are fields 5, 8, 12.
  line='[a-z-]* [a-z]* exchanged in [0-9.]* ms (PMIx_Init [0-9.]* ms, the fence [0-9.]* ms)'
  pmix=$(echo "$output" | grep -o "$line" | tr -d '(),' || true)
  if [ "$way" != kolo_addr ] && [ "$(echo "$pmix" | grep -c .)" -ne $((h * l)) ]; then
    echo "$output" >&2
    echo "startup_mpirun.sh: pmix $shape round $round: not every rank printed its PMIx line" >&2
    exit 1
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$way" "$shape" $((h * l)) "$round" \
    "$(echo "$figures" | largest)" "$(echo "$pmix" | awk 'NF { print $5 }' | largest)" \
    "$(echo "$pmix" | awk 'NF { print $8 }' | largest)" \
    "$(echo "$pmix" | awk 'NF { print $12 }' | largest)" "$(echo "$pmix" | awk 'NF { print $12 }' | smallest)"
}

port=29500
runs=$(
  for round in $(seq 1 "$rounds"); do
    for shape in "$@"; do
      run pmix "$shape" "$round" "$PWD/build/capi/libkolo.so"
      [ -z "$base" ] || run pmix_base "$shape" "$round" "$base"
      port=$((port + 1))
      run kolo_addr "$shape" "$round" "$PWD/build/capi/libkolo.so" -x KOLO_ADDR="${name}1:$port"
    done
  done
)
header='way\tshape\tranks\tround\tinit_max_s\tpmix_max_ms\tpmix_init_max_ms\tfence_max_ms\tfence_min_ms'
printf "$header\n%s\n" "$runs"
[ -z "$tsv" ] || printf "$header\n%s\n" "$runs" >"$tsv"
echo "# medians over the rounds: the slowest rank's kolo_comm_init; under PMIx the slowest rank's"
echo "# whole PMIx exchange, PMIx_Init and fence (each its own maximum over the ranks), and the"
echo "# shortest fence of any rank: the last rank to reach it waits for the collective alone"
printf '# %-10s %6s %6s %10s %10s %10s %10s %10s\n' way shape ranks "init ms" "PMIx ms" "Init ms" "fence ms" "fence min"
for shape in "$@"; do
  for way in pmix pmix_base kolo_addr; do
    echo "$runs" | awk -v way="$way" -v shape="$shape" '
      function median(list, n,   i, j, t, v) {
        split(list, v, " ")
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] + 0 < v[i] + 0) { t = v[i]; v[i] = v[j]; v[j] = t }
        return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
      }
      $1 == way && $2 == shape { n++; ranks = $3; init = init " " $5; all = all " " $6; pi = pi " " $7; fe = fe " " $8; fm = fm " " $9 }
      END { if (!n) exit
            if (way != "kolo_addr") printf "  %-10s %6s %6d %10.1f %10.1f %10.1f %10.1f %10.1f\n", way, shape, ranks,
              1e3 * median(init, n), median(all, n), median(pi, n), median(fe, n), median(fm, n)
            else printf "  %-10s %6s %6d %10.1f %10s %10s %10s %10s\n", way, shape, ranks, 1e3 * median(init, n), "-", "-", "-", "-" }'
  done
done
