#!/usr/bin/env bash
# warmup.sh — is kolo as fast from its first calls as after thousands? A fresh job with -w 5 (each
# row five untimed calls, then -n timed ones) beside a fresh job with -w 5000, in interleaved
# rounds, and per size the ratio of the two medians: above 1 where the first calls of a job run
# slower than its steady state (a warm-up cliff). Issue #48's target is at most 1.3 at every size.
#
#   bench/warmup.sh                    N = 2, 8 B .. 2 MiB every 8x, kolo's default transport
#   RANKS=4 KOLO_TRANSPORT=tcp bench/warmup.sh
#
# To see where in the first calls the time goes, run all_reduce_perf --first K (docs/benchmarks.md):
# it times each row's first K calls one by one (before its -w calls, so not here).
#
# Settings from the environment: BUILD=./build, RANKS=2, ROUNDS=3, MIN_BYTES=8, MAX_BYTES=2M,
# FACTOR=8, ITERS=100 (-n), SHORT=5 and LONG=5000 (the two -w), LOG_DIR=<new temporary>.
set -uo pipefail

BUILD=${BUILD:-./build}
RANKS=${RANKS:-2} ROUNDS=${ROUNDS:-3}
MIN_BYTES=${MIN_BYTES:-8} MAX_BYTES=${MAX_BYTES:-2M} FACTOR=${FACTOR:-8} ITERS=${ITERS:-100}
SHORT=${SHORT:-5} LONG=${LONG:-5000}
LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/warmup.XXXXXX")}
mkdir -p "$LOG_DIR"
kolorun=$BUILD/src/kolorun perf=$BUILD/bench/all_reduce_perf
for program in "$kolorun" "$perf"; do
  [[ -x $program ]] || { echo "warmup.sh: $program is not built (BUILD=$BUILD)" >&2; exit 1; }
done

load_start=$(cut -d' ' -f1 /proc/loadavg)
failed=0
records=$LOG_DIR/records.txt
: >"$records"
for ((round = 1; round <= ROUNDS; round++)); do
  order="$SHORT $LONG"
  ((round % 2 == 0)) && order="$LONG $SHORT"
  for warmup in $order; do
    log=$LOG_DIR/w${warmup}_round${round}.log
    echo "warmup.sh: round $round of $ROUNDS: -w $warmup" >&2
    if ! "$kolorun" -np "$RANKS" "$perf" -b "$MIN_BYTES" -e "$MAX_BYTES" -f "$FACTOR" \
        -n "$ITERS" -w "$warmup" -c 1 >"$log" 2>&1; then
      failed=1
      echo "warmup.sh: -w $warmup failed; $log ends:" >&2
      tail -n 5 "$log" | sed 's/^/    /' >&2
    fi
    # Rows: size and the out-of-place time (kolorun's "[rank] " prefix dropped).
    awk -v warmup="$warmup" '{ sub(/^\[[0-9]+\] /, "") }
      !/^#/ && NF >= 13 && $1 ~ /^[0-9]+$/ { print warmup, $1, $6, $9 }' "$log" >>"$records"
  done
done

echo
echo "allreduce float32 sum at N = $RANKS (KOLO_TRANSPORT=${KOLO_TRANSPORT:-auto}), out of place:"\
     "a job with -w $SHORT beside one with -w $LONG, -n $ITERS; median of $ROUNDS interleaved"\
     "rounds; load $load_start at the start, $(cut -d' ' -f1 /proc/loadavg) at the end;"\
     "logs in $LOG_DIR"
awk -v short="$SHORT" -v long="$LONG" -v rounds="$ROUNDS" '
  function median(list,   n, values, i, j, t) {
    n = split(list, values, " ")
    for (i = 2; i <= n; i++) for (j = i; j > 1 && values[j - 1] + 0 > values[j] + 0; j--) {
      t = values[j]; values[j] = values[j - 1]; values[j - 1] = t
    }
    return n % 2 ? values[(n + 1) / 2] : (values[n / 2] + values[n / 2 + 1]) / 2
  }
  {
    times[$1, $2] = times[$1, $2] " " $3; count[$1, $2]++
    if ($4 != 0) wrong = 1
    if (!($2 in seen)) { seen[$2] = 1; sizes[++size_count] = $2 }
  }
  END {
    printf "%12s  %12s  %12s  %s\n", "size (B)", "-w " short " (us)", "-w " long " (us)", "ratio"
    worst = 0; over = ""
    for (s = 1; s <= size_count; s++) {
      bytes = sizes[s]
      if (count[short, bytes] != rounds || count[long, bytes] != rounds) {
        printf "%12d  a round is missing (see the logs)\n", bytes; incomplete = 1; continue
      }
      a = median(times[short, bytes]); b = median(times[long, bytes]); ratio = a / b
      printf "%12d  %12.2f  %12.2f  %5.2f\n", bytes, a, b, ratio
      if (ratio > worst) { worst = ratio; worst_at = bytes }
      if (ratio > 1.3) over = over (over == "" ? "" : ", ") bytes " B"
    }
    if (wrong) print "WRONG ELEMENTS in some run (see the logs)"
    if (incomplete) print "verdict: incomplete (a run failed)"
    else if (over == "") printf "verdict: within 1.3x of the warmed-up time at every size (worst %.2fx at %d B)\n", worst, worst_at
    else printf "verdict: more than 1.3x slower with -w %d at %s (worst %.2fx at %d B)\n", short, over, worst, worst_at
    exit wrong || incomplete
  }' "$records" || failed=1
exit $failed
