#!/bin/sh
# cluster_perf.sh: all_reduce_perf across a simulated cluster (scripts/cluster.sh), to see how much
# of the link rate kolo's allreduce reaches between hosts.
#
# It makes HOSTS hosts (network namespaces joined by a bridge, every link shaped by tc tbf to RATE
# in both directions), starts RANKS_PER_HOST ranks of build/bench/all_reduce_perf inside each host
# as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=<first host's
# name>, MASTER_PORT; ranks numbered host by host), and does so for every transport and every
# variant, in alternation, for K rounds, so that a machine whose load changes treats them alike. It
# prints every run's table (rank 0's nccl-tests table), then per transport and variant the median
# over the rounds of the out-of-place and in-place busbw at each size and their ratio to the link
# rate (RATE in bytes per second). The cluster is taken down at the end, whatever happens.
#
#   sh bench/cluster_perf.sh [options] HOSTS RANKS_PER_HOST RATE [-- all_reduce_perf flags]
#
#   HOSTS            2..200 hosts
#   RANKS_PER_HOST   1..64 ranks on each host
#   RATE             link rate as tc writes it: 1gbit, 500mbit, 10gbit, 2500kbit (bit = bit/s)
#   -t, --transports LIST   KOLO_TRANSPORT values, comma-separated (default: tcp,ucx)
#   -k, --rounds K          rounds of alternation (default: 3)
#   -v, --variant 'LABEL [VAR=VALUE ...]'
#                           a variant: a label and the environment its ranks get; repeat for more.
#                           Default: one variant, 'flat' (no settings). Schedules, for example:
#                           -v 'ring KOLO_ALLREDUCE=ring' -v 'hierarchical KOLO_ALLREDUCE=hierarchical'
#                           PERF=PATH runs that all_reduce_perf instead (another build, such as one
#                           with other switch points)
#   -o, --tsv FILE          also write the medians as tab-separated rows to FILE
#   -n, --name NAME         the cluster's name (default: kolobench; the tests use kolotest)
#   -b, --build DIR         the build directory (default: build)
#   all_reduce_perf flags    default: -b 256K -e 64M -f 4 -n 5 -w 1
#
# Needs root (it makes network namespaces). Its hosts get addresses in CLUSTER_SUBNET
# (default here 10.78.0, and CLUSTER_SUBNET6 fd78), so that it can run beside the tests'
# cluster (10.77.0). Example, one of docs/performance.md's measurements ("Across hosts"):
#
#   sh scripts/build.sh && sh bench/cluster_perf.sh -k 3 -o bench/results/cluster_perf_4x2.tsv 4 2 1gbit
set -eu

usage() {
  sed -n '14,30p' "$0" | sed 's/^#  *//' >&2
  exit 2
}
fail() {
  echo "cluster_perf.sh: $*" >&2
  exit 2
}

cd "$(dirname "$0")/.."
transports=tcp,ucx
rounds=3
variants=""
tsv=""
name=kolobench
build=build
while [ $# -gt 0 ]; do
  case "$1" in
    -t | --transports) [ $# -ge 2 ] || usage; transports=$2; shift 2 ;;
    -k | --rounds) [ $# -ge 2 ] || usage; rounds=$2; shift 2 ;;
    -v | --variant) [ $# -ge 2 ] || usage; variants="$variants$2
"; shift 2 ;;
    -o | --tsv) [ $# -ge 2 ] || usage; tsv=$2; shift 2 ;;
    -n | --name) [ $# -ge 2 ] || usage; name=$2; shift 2 ;;
    -b | --build) [ $# -ge 2 ] || usage; build=$2; shift 2 ;;
    -h | --help) usage ;;
    -*) fail "unknown option '$1' (see --help)" ;;
    *) break ;;
  esac
done
[ $# -ge 3 ] || usage
hosts=$1
per_host=$2
rate=$3
shift 3
if [ $# -gt 0 ]; then
  [ "$1" = -- ] || fail "unexpected argument '$1' (all_reduce_perf's flags follow --)"
  shift
fi
[ $# -gt 0 ] || set -- -b 256K -e 64M -f 4 -n 5 -w 1

is_count() { case "$1" in *[!0-9]* | "" | 0*) return 1 ;; esac; }
is_count "$hosts" && [ "$hosts" -ge 2 ] && [ "$hosts" -le 200 ] ||
  fail "HOSTS must be a number from 2 to 200: '$hosts'"
is_count "$per_host" && [ "$per_host" -le 64 ] ||
  fail "RANKS_PER_HOST must be a number from 1 to 64: '$per_host'"
is_count "$rounds" && [ "$rounds" -le 100 ] || fail "--rounds must be a number from 1 to 100: '$rounds'"
# The link rate in bytes per second, from tc's notation.
rate_bytes=$(echo "$rate" | awk '
  match($0, /^[0-9]+(\.[0-9]+)?/) {
    value = substr($0, 1, RLENGTH); unit = substr($0, RLENGTH + 1)
    scale["bit"] = 1; scale["kbit"] = 1e3; scale["mbit"] = 1e6; scale["gbit"] = 1e9
    if ((unit in scale) && value > 0) { printf "%.0f\n", value * scale[unit] / 8; exit }
  }')
[ -n "$rate_bytes" ] || fail "RATE must be a number followed by bit, kbit, mbit or gbit: '$rate'"
case "$name" in *[!a-z0-9]* | "") fail "--name must be lower-case letters and digits: '$name'" ;; esac
[ -n "$variants" ] || variants="flat
"
printf '%s' "$variants" | while read -r label settings; do
  case "$label" in "" | *[!A-Za-z0-9_.-]*) fail "a variant's label must be letters, digits, . _ -: '$label'" ;; esac
  for setting in $settings; do
    case "$setting" in [A-Z_]*=*) ;; *) fail "variant '$label': '$setting' is not VAR=VALUE" ;; esac
  done
done
for transport in $(echo "$transports" | tr , ' '); do
  case "$transport" in tcp | ucx | auto) ;; *) fail "--transports: '$transport' is not tcp, ucx or auto" ;; esac
done
perf=$build/bench/all_reduce_perf
[ -x "$perf" ] || fail "no $perf: build first (sh scripts/build.sh)"
[ "$(id -u)" = 0 ] || fail "needs root (network namespaces)"

# The subnet matters to `up` only; the ranks must not see it (kolo warns of unknown KOLO_*).
cluster="env CLUSTER_SUBNET=${CLUSTER_SUBNET:-10.78.0}
  CLUSTER_SUBNET6=${CLUSTER_SUBNET6:-fd78} sh scripts/cluster.sh"
logs=$(mktemp -d "${TMPDIR:-/tmp}/kolo-cluster-perf.XXXXXX")
finish() {
  status=$?
  $cluster down "$name" || true
  if [ "$status" = 0 ]; then rm -rf "$logs"; else echo "cluster_perf.sh: logs kept in $logs" >&2; fi
  exit "$status"
}
trap finish EXIT
trap 'exit 130' INT TERM HUP

$cluster up "$name" "$hosts" "$rate"
ranks=$((hosts * per_host))
secret=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
echo "# cluster_perf: $hosts hosts x $per_host ranks ($ranks ranks), links shaped to $rate" \
  "($rate_bytes bytes/s) each way, $rounds rounds; all_reduce_perf $*"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)"

# Bytes host H has sent over its link so far (the veth's counter in the host's namespace).
link_bytes() {
  ip -n "$name$1" -s link show dev eth0 | awk '/TX:/ { getline; print $1; exit }'
}
# What went over the links during a run, in MB per host (the mean over hosts): a transport that
# moves its bytes some other way (shared memory between the namespaces) shows here.
link_traffic() {  # before-counts after-counts
  echo "$1 $2" | awk -v hosts="$hosts" '{ for (h = 1; h <= hosts; h++) sum += $(hosts + h) - $h
                                          printf "%.1f", sum / hosts / 1e6 }'
}

# One run: every rank in its host, in the background; rank 0's table to $1, the others' output to
# $1.rank<r>. Each rank is bounded by a timeout, so a transport that hangs costs minutes, not the day.
port=29500
run() {  # output transport settings...
  output=$1
  transport=$2
  shift 2
  port=$((port + 1))
  program=$perf
  for setting in "$@"; do
    case "$setting" in PERF=*) program=${setting#PERF=} ;; esac
  done
  [ -x "$program" ] || { echo "cluster_perf.sh: no program $program" >"$output"; return 1; }
  pids=""
  rank=0
  for host in $(seq 1 "$hosts"); do
    for local_rank in $(seq 0 $((per_host - 1))); do
      out="$output.rank$rank"
      [ "$rank" = 0 ] && out=$output
      env -u CLUSTER_SUBNET -u CLUSTER_SUBNET6 "$@" KOLO_TRANSPORT="$transport" KOLO_SECRET="$secret" KOLO_TIMEOUT=60 \
        RANK=$rank WORLD_SIZE=$ranks LOCAL_RANK=$local_rank LOCAL_WORLD_SIZE=$per_host \
        MASTER_ADDR="${name}1" MASTER_PORT=$port \
        timeout 900 sh scripts/cluster.sh exec "$name" "$host" "$program" $perf_flags </dev/null >"$out" 2>&1 &
      pids="$pids $!"
      rank=$((rank + 1))
    done
  done
  failed=0
  for pid in $pids; do wait "$pid" || failed=1; done
  return $failed
}

perf_flags="$*"
# busbw from the time columns (the table rounds busbw to 0.01 GB/s, 8% of a 1 Gbit/s link).
results=$logs/results   # round transport variant size busbw_out busbw_in wrong time_out time_in
: >"$results"
failures=0
for round in $(seq 1 "$rounds"); do
  for transport in $(echo "$transports" | tr , ' '); do
    # A here-document, not a pipe: the loop must run in this shell (run() counts ports up).
    while read -r label settings; do
      [ -n "$label" ] || continue
      output=$logs/$round.$transport.$label
      before=$(for host in $(seq 1 "$hosts"); do link_bytes "$host"; done | tr '\n' ' ')
      echo
      echo "## round $round, KOLO_TRANSPORT=$transport, variant $label${settings:+ ($settings)}"
      if run "$output" "$transport" $settings; then
        grep -v '^#' "$output" | awk -v round="$round" -v transport="$transport" -v label="$label" \
          -v factor="$(echo "$ranks" | awk '{ print 2 * ($1 - 1) / $1 }')" '
          NF >= 13 && $1 ~ /^[0-9]+$/ {
            print round, transport, label, $1, $1 * factor / $6 / 1e3, $1 * factor / $10 / 1e3, $9 + $13, $6, $10
          }' \
          >>"$results"
        cat "$output"
        after=$(for host in $(seq 1 "$hosts"); do link_bytes "$host"; done | tr '\n' ' ')
        traffic=$(link_traffic "$before" "$after")
        echo "# sent over the links: $traffic MB per host"
        echo "$round $transport $label $traffic" >>"$logs/traffic"
      else
        echo "FAILED (KOLO_TRANSPORT=$transport, $label); rank 0's last lines:"
        tail -n 5 "$output"
        for other in "$output".rank*; do
          [ -s "$other" ] && { echo "--- ${other##*.}:"; tail -n 3 "$other"; }
        done
        echo "$round $transport $label failed" >>"$logs/failures"
      fi
    done <<VARIANTS
$variants
VARIANTS
  done
done

echo
echo "# medians over $rounds rounds; busbw in GB/s; link = busbw / ($rate_bytes bytes/s); time in µs"
[ -z "$tsv" ] || printf 'hosts\tranks_per_host\trate\ttransport\tvariant\tbytes\trounds\tbusbw_out\tbusbw_in\tlink_out\tlink_in\twrong\ttime_out_us\ttime_in_us\n' >"$tsv"
sort -k2,2 -k3,3 -k4,4n "$results" | awk -v rate="$rate_bytes" -v hosts="$hosts" \
  -v per_host="$per_host" -v rate_text="$rate" -v tsv="$tsv" '
  function median(list, n,   i, j, t, v) {
    split(list, v, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] + 0 < v[i] + 0) { t = v[i]; v[i] = v[j]; v[j] = t }
    return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
  }
  function flush() {
    if (n == 0) return
    if (group != printed) {
      printf "\n# KOLO_TRANSPORT=%s, variant %s\n", t, l
      printf "# %12s %6s %10s %10s %10s %10s %6s %10s %10s\n", "size", "rounds", "busbw out", "busbw in", "out/link", "in/link", "#wrong", "time out", "time in"
      printed = group
    }
    mo = median(outs, n); mi = median(ins, n); to = median(touts, n); ti = median(tins, n)
    printf "  %12d %6d %10.3f %10.3f %10.2f %10.2f %6d %10.1f %10.1f\n", s, n, mo, mi, mo * 1e9 / rate, mi * 1e9 / rate, wrong, to, ti
    if (tsv != "")
      printf "%d\t%d\t%s\t%s\t%s\t%d\t%d\t%.4f\t%.4f\t%.3f\t%.3f\t%d\t%.1f\t%.1f\n", hosts, per_host, rate_text, t, l, s, n, mo, mi, mo * 1e9 / rate, mi * 1e9 / rate, wrong, to, ti >> tsv
  }
  {
    if ($2 != t || $3 != l || $4 != s) { flush(); n = 0; outs = ""; ins = ""; touts = ""; tins = ""; wrong = 0 }
    t = $2; l = $3; s = $4; group = t " " l
    n++; outs = outs " " $5; ins = ins " " $6; wrong += $7; touts = touts " " $8; tins = tins " " $9
  }
  END { flush() }'
echo
echo "# sent over the links per run, MB per host (the median over the rounds):"
sort -k2,2 -k3,3 -k4,4n "$logs/traffic" 2>/dev/null | awk '
  { key = "KOLO_TRANSPORT=" $2 ", variant " $3; values[key] = values[key] " " $4; count[key]++ }
  END { for (key in values) { n = split(values[key], v, " ")
          for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] + 0 < v[i] + 0) { t = v[i]; v[i] = v[j]; v[j] = t }
          printf "#   %s: %s\n", key, v[int((n + 1) / 2)] } }'
if [ -s "$logs/failures" ]; then
  echo
  echo "# failed runs (round transport variant):"
  sed 's/^/#   /' "$logs/failures"
  exit 1
fi
