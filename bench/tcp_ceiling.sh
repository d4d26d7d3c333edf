#!/usr/bin/env bash
# tcp_ceiling.sh — kolo's TCP allreduce beside the loopback's ceiling (bench/tcp_loopback), in
# interleaved rounds, with the CPU each spends per byte: on a machine whose cores the ranks share
# (N = 4 on 2 cores) the loopback's rate is set by the CPU time its copies take, so the CPU that
# kolo spends per byte sent, against the loopback's, says where kolo's rate goes.
#
# Every round runs the loopback and then each variant of kolo (bench/tcp_ceiling_worker.py under
# kolorun, KOLO_TRANSPORT=tcp, out of place, float32 sum, every element checked) at every size.
# For each cell: the median over rounds of the slowest rank's median rate (GB/s; for kolo its
# busbw, for the loopback the rate one process sends at, which bounds busbw), the CPU seconds per
# 10^9 bytes sent (user + system, summed over the ranks, from getrusage around the timed calls),
# and the rate's ratio to the loopback's of the same round (median over rounds).
#
#   bench/tcp_ceiling.sh
#   VARIANTS="before:KOLO_LIBRARY=/tmp/old/libkolo.so.0 after:" bench/tcp_ceiling.sh
#
# Settings come from the environment:
#   BUILD=./build        the meson build directory (kolorun, tcp_loopback, capi/libkolo.so.0)
#   N=4                  ranks
#   SIZES="16M 64M 256M" buffer sizes (K/M suffixes: powers of 1024)
#   ROUNDS=5 ITERS=5 WARMUP=2
#   VARIANTS="kolo:"     label:VAR=value,VAR=value... per kolo column (each its own environment;
#                        KOLO_LIBRARY=path picks another build of libkolo)
#   PYTHON=/usr/bin/python3
#   LOG_DIR=<new temporary directory>   every run's output
set -uo pipefail
[[ ${1:-} == -h || ${1:-} == --help ]] && { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; }

BUILD=${BUILD:-./build}
N=${N:-4}
SIZES=${SIZES:-"16M 64M 256M"}
ROUNDS=${ROUNDS:-5}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-2}
VARIANTS=${VARIANTS:-"kolo:"}
PYTHON=${PYTHON:-/usr/bin/python3}
LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/tcp_ceiling.XXXXXX")}
mkdir -p "$LOG_DIR"
here=$(cd "$(dirname "$0")/.." && pwd)
for program in "$BUILD/src/kolorun" "$BUILD/bench/tcp_loopback" "$BUILD/capi/libkolo.so.0"; do
  [[ -e $program ]] || { echo "tcp_ceiling.sh: $program is not built (BUILD=$BUILD)" >&2; exit 1; }
done
library=$(cd "$(dirname "$BUILD/capi/libkolo.so.0")" && pwd)/libkolo.so.0

to_bytes() {
  local number=${1%%[KkMmGg]*} unit=${1##*[0-9]}
  case "$unit" in
    K|k) echo $((number << 10)) ;; M|m) echo $((number << 20)) ;; G|g) echo $((number << 30)) ;;
    *) echo "$number" ;;
  esac
}

# "RATE CPU_PER_GB" of a run's output: the slowest rank's median rate; CPU seconds per GB sent.
summarize() {
  awk '/median/ { r = $(NF - 4) + 0; if (rate == "" || r < rate) rate = r }
       /busbw/ { r = $4 + 0; if (rate == "" || r < rate) rate = r }
       / cpu / { for (i = 1; i <= NF; i++) if ($i == "cpu") { cpu += $(i + 1) + $(i + 2); sent += $(i + 5) } }
       END { if (rate == "" || sent == 0) print "fail fail"; else printf "%.3f %.3f\n", rate, cpu / sent }' "$1"
}

labels=(loopback)
for variant in $VARIANTS; do labels+=("${variant%%:*}"); done
declare -A rate cpu ratio
load_at_start=$(cut -d' ' -f1 /proc/loadavg)
started=$SECONDS
for ((round = 1; round <= ROUNDS; round++)); do
  for size in $SIZES; do
    bytes=$(to_bytes "$size")
    log=$LOG_DIR/loopback_${size}_round$round.log
    timeout 300 "$BUILD/bench/tcp_loopback" "$N" "$bytes" "$ITERS" >"$log" 2>&1
    read -r loop_rate loop_cpu < <(summarize "$log")
    rate[loopback,$size]+="$loop_rate " cpu[loopback,$size]+="$loop_cpu "
    for variant in $VARIANTS; do
      label=${variant%%:*} settings=${variant#*:} settings=${settings//,/ }
      log=$LOG_DIR/${label}_${size}_round$round.log
      # shellcheck disable=SC2086  # settings is a list of VAR=value
      env KOLO_TRANSPORT=tcp KOLO_LIBRARY="$library" PYTHONPATH="$here/python" $settings \
        timeout 300 "$BUILD/src/kolorun" -np "$N" "$PYTHON" "$here/bench/tcp_ceiling_worker.py" \
        "$bytes" "$ITERS" "$WARMUP" >"$log" 2>&1 || echo "tcp_ceiling.sh: $label $size failed, see $log" >&2
      read -r kolo_rate kolo_cpu < <(summarize "$log")
      rate[$label,$size]+="$kolo_rate " cpu[$label,$size]+="$kolo_cpu "
      ratio[$label,$size]+="$(awk -v a="$kolo_rate" -v b="$loop_rate" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.3f", a / b; else print "fail" }') "
    done
    echo "tcp_ceiling.sh: round $round of $ROUNDS, $size done" >&2
  done
done

median() {
  # shellcheck disable=SC2086  # $1 is a list of numbers
  printf '%s\n' $1 | grep -v fail | sort -g | awk '{ v[NR] = $1 }
    END { if (NR == 0) print "fail"; else printf "%.2f\n", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
echo
echo "N = $N, $ITERS timed calls after $WARMUP, medians of $ROUNDS interleaved rounds; $(nproc) cores;" \
     "load $load_at_start at the start and $(cut -d' ' -f1 /proc/loadavg) at the end; $((SECONDS - started)) s; logs in $LOG_DIR"
echo
header="| size |" rule="|-----:|"
for label in "${labels[@]}"; do
  header+=" $label GB/s | $label CPU s/GB |" rule+="----:|----:|"
  [[ $label == loopback ]] || { header+=" $label / loopback |"; rule+="----:|"; }
done
echo "$header"
echo "$rule"
for size in $SIZES; do
  line="| $size |"
  for label in "${labels[@]}"; do
    line+=" $(median "${rate[$label,$size]}") | $(median "${cpu[$label,$size]}") |"
    [[ $label == loopback ]] || line+=" $(median "${ratio[$label,$size]}") |"
  done
  echo "$line"
done
