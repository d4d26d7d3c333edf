#!/bin/sh
# startup_perf.sh: kolo_comm_init's time and store requests at several job sizes, on a simulated
# cluster (scripts/cluster.sh).
#
# It makes as many hosts as the largest shape needs (network namespaces joined by a bridge; links
# unshaped unless --rate) and, for each SHAPE (H x L: L ranks on each of the first H hosts) and
# each build, starts bench/startup_perf in every rank as torchrun would (RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=<first host's name>, MASTER_PORT; ranks numbered host
# by host) with KOLO_DEBUG=INFO, K rounds, shapes and builds in alternation, so that a machine
# whose load changes treats them alike. Per run it records the slowest rank's kolo_comm_init time (startup_perf's
# allreduce of every rank's) and the store requests of each rank (from its "start-up took"
# line). It prints per build and shape the median over the rounds of the slowest init, and the
# requests of rank 0, the most of any other rank, and their mean. The cluster is taken down at the end.
#
#   sh bench/startup_perf.sh [options] SHAPE...
#
#   SHAPE                   HxL: L ranks on each of H hosts (H 2..64, L 1..16), e.g. 2x1 4x1 4x2 4x4
#   -k, --rounds K          rounds (default: 5)
#   -t, --transport T       KOLO_TRANSPORT (default: tcp)
#   -r, --rate RATE         shape every link to RATE (tc's notation: 1gbit); default unshaped
#   -o, --tsv FILE          also write one row per run to FILE (tab-separated)
#   -b, --build [LABEL=]DIR a build directory (default: build); repeat to compare builds. LABEL
#                           names its rows (default: the commit checked out, for build)
#
# Needs root (network namespaces). Hosts get addresses in CLUSTER_SUBNET (default here 10.79.0,
# CLUSTER_SUBNET6 fd79), beside the tests' and cluster_perf.sh's clusters. Example
# (docs/performance.md, "Start-up"):
#
#   git archive OLD | tar -x -C /tmp/old && (cd /tmp/old && meson setup build && ninja -C build bench/startup_perf)
#   sh bench/startup_perf.sh -k 11 -b get-per-key=/tmp/old/build -b get-many=build -o bench/results/startup_perf.tsv 2x1 4x1 4x2 4x4
set -eu

usage() {
  sed -n '15,24p' "$0" | sed 's/^#  *//' >&2
  exit 2
}
fail() {
  echo "startup_perf.sh: $*" >&2
  exit 2
}

cd "$(dirname "$0")/.."
rounds=5
transport=tcp
rate=""
tsv=""
builds=""
while [ $# -gt 0 ]; do
  case "$1" in
    -k | --rounds) [ $# -ge 2 ] || usage; rounds=$2; shift 2 ;;
    -t | --transport) [ $# -ge 2 ] || usage; transport=$2; shift 2 ;;
    -r | --rate) [ $# -ge 2 ] || usage; rate=$2; shift 2 ;;
    -o | --tsv) [ $# -ge 2 ] || usage; tsv=$2; shift 2 ;;
    -b | --build) [ $# -ge 2 ] || usage; builds="$builds $2"; shift 2 ;;
    -h | --help) usage ;;
    -*) fail "unknown option '$1' (see --help)" ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage
is_count() { case "$1" in *[!0-9]* | "" | 0*) return 1 ;; esac; }
is_count "$rounds" && [ "$rounds" -le 100 ] || fail "--rounds must be a number from 1 to 100: '$rounds'"
case "$transport" in tcp | ucx | auto) ;; *) fail "--transport: '$transport' is not tcp, ucx or auto" ;; esac
hosts=2
for shape in "$@"; do
  h=${shape%x*}
  l=${shape#*x}
  is_count "$h" && is_count "$l" && [ "$h" -ge 2 ] && [ "$h" -le 64 ] && [ "$l" -le 16 ] ||
    fail "a SHAPE is HxL with H from 2 to 64 and L from 1 to 16: '$shape'"
  [ "$h" -gt "$hosts" ] && hosts=$h
done
[ -n "$builds" ] || builds=build
labels=""
for build in $builds; do
  case "$build" in
    *=*) label=${build%%=*}; dir=${build#*=} ;;
    *) label=$(git -C "$build" rev-parse --short HEAD 2>/dev/null || echo "$build"); dir=$build ;;
  esac
  case "$label" in "" | *[!A-Za-z0-9_.-]*) fail "a build's label must be letters, digits, . _ -: '$label'" ;; esac
  [ -x "$dir/bench/startup_perf" ] || fail "no $dir/bench/startup_perf: build it first"
  labels="$labels $label=$dir"
done
[ "$(id -u)" = 0 ] || fail "needs root (network namespaces)"

name=kolostart
cluster="env CLUSTER_SUBNET=${CLUSTER_SUBNET:-10.79.0}
  CLUSTER_SUBNET6=${CLUSTER_SUBNET6:-fd79} sh scripts/cluster.sh"
logs=$(mktemp -d "${TMPDIR:-/tmp}/kolo-startup-perf.XXXXXX")
finish() {
  status=$?
  $cluster down "$name" || true
  if [ "$status" = 0 ]; then rm -rf "$logs"; else echo "startup_perf.sh: logs kept in $logs" >&2; fi
  exit "$status"
}
trap finish EXIT
trap 'exit 130' INT TERM HUP

$cluster up "$name" "$hosts" $rate
echo "# startup_perf: shapes $*, KOLO_TRANSPORT=$transport, links ${rate:-unshaped}, $rounds rounds, builds$labels"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
secret=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

# One run of shape H x L: every rank in its host, in the background, each bounded by a timeout;
# rank r's output to $1.<r>.
port=29600
run() {  # output h l program
  port=$((port + 1))
  pids=""
  rank=0
  for host in $(seq 1 "$2"); do
    for local_rank in $(seq 0 $(($3 - 1))); do
      env -u CLUSTER_SUBNET -u CLUSTER_SUBNET6 KOLO_DEBUG=INFO KOLO_TRANSPORT="$transport" \
        KOLO_SECRET="$secret" KOLO_TIMEOUT=60 \
        RANK=$rank WORLD_SIZE=$(($2 * $3)) LOCAL_RANK=$local_rank LOCAL_WORLD_SIZE=$3 \
        MASTER_ADDR="${name}1" MASTER_PORT=$port \
        timeout 120 sh scripts/cluster.sh exec "$name" "$host" "$4" </dev/null >"$1.$rank" 2>&1 &
      pids="$pids $!"
      rank=$((rank + 1))
    done
  done
  failed=0
  for pid in $pids; do wait "$pid" || failed=1; done
  return $failed
}

results=$logs/results  # label shape ranks round init_max_s requests_rank0 requests_other_max requests_mean
: >"$results"
failures=0
for round in $(seq 1 "$rounds"); do
  for shape in "$@"; do
   for build in $labels; do
    label=${build%%=*}
    h=${shape%x*}
    l=${shape#*x}
    ranks=$((h * l))
    output=$logs/$round.$shape.$label
    if run "$output" "$h" "$l" "${build#*=}/bench/startup_perf"; then
      init=$(awk '$1 == "init_max_s" { print $2 }' "$output.0")
      requests=$(for rank in $(seq 0 $((ranks - 1))); do
        sed -n 's/.*start-up took [0-9.]* s and \([0-9]*\) store request.*/\1/p' "$output.$rank"
      done | awk 'NR == 1 { first = $1 } NR > 1 { if ($1 > most) most = $1 } { sum += $1 }
                  END { printf "%d %d %.1f", first, most, sum / NR }')
      echo "$label $shape $ranks $round $init $requests" >>"$results"
      echo "$label $shape round $round: init (slowest rank) $init s; store requests rank 0, most other, mean: $requests"
    else
      echo "FAILED: $label $shape round $round; rank 0's last lines:"
      tail -n 5 "$output.0"
      failures=$((failures + 1))
    fi
   done
  done
done

echo
echo "# medians over the rounds; init = the slowest rank's kolo_comm_init, in ms"
printf '# %-10s %6s %6s %6s %10s %14s %14s %14s\n' build shape ranks rounds "init ms" "requests r0" "requests max" "requests mean"
[ -z "$tsv" ] || [ -s "$tsv" ] ||
  printf 'label\tdate\ttransport\tshape\tranks\tround\tinit_max_s\trequests_rank0\trequests_other_max\trequests_mean\n' >"$tsv"
if [ -n "$tsv" ]; then
  date=$(date -u '+%Y-%m-%d')
  awk -v date="$date" -v transport="$transport" \
    '{ printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", $1, date, transport, $2, $3, $4, $5, $6, $7, $8 }' \
    "$results" >>"$tsv"
fi
for build in $labels; do
 for shape in "$@"; do
  awk -v label="${build%%=*}" -v shape="$shape" '
    function median(list, n,   i, j, t, v) {
      split(list, v, " ")
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] + 0 < v[i] + 0) { t = v[i]; v[i] = v[j]; v[j] = t }
      return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
    }
    $1 == label && $2 == shape { n++; ranks = $3; init = init " " $5; r0 = r0 " " $6; most = most " " $7; mean = mean " " $8 }
    END { if (n) printf "  %-10s %6s %6d %6d %10.1f %14d %14d %14.1f\n", label, shape, ranks, n,
                        1e3 * median(init, n), median(r0, n), median(most, n), median(mean, n) }' "$results"
 done
done
[ "$failures" = 0 ] || exit 1
