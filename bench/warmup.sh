#!/usr/bin/env bash
# warmup.sh — is kolo as fast from its first calls as after thousands? Issue #48's target: with
# -w 5, every size of a run within 1.3x of the same size measured after 5,000 warm-up calls. Two
# ways to measure it, in interleaved rounds, each row's out-of-place time:
#   across jobs    a fresh job with -w 5 beside a fresh job with -w 5000; per size, the ratio of
#                  the two medians over the rounds. It includes how much fresh jobs differ from
#                  one another whatever their warm-up (SHORT=4999 shows that alone).
#   within a job   one fresh job that runs the rows with -w 5, then all of them again with -w 5000
#                  (all_reduce_perf -N 2 --later_warmup_iters 5000); per size, the median over the
#                  rounds of each job's ratio of its first row to its second.
# Above 1 where the first calls run slower than the warmed-up ones (a warm-up cliff).
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
  # Three jobs a round, in an order that turns: -w SHORT, -w LONG, and both in one job.
  jobs=(short long same)
  ((round % 3 == 2)) && jobs=(long same short)
  ((round % 3 == 0)) && jobs=(same short long)
  for job in "${jobs[@]}"; do
    case $job in
      short) flags=(-w "$SHORT") ;;
      long) flags=(-w "$LONG") ;;
      same) flags=(-w "$SHORT" -N 2 --later_warmup_iters "$LONG") ;;
    esac
    log=$LOG_DIR/${job}_round${round}.log
    echo "warmup.sh: round $round of $ROUNDS: ${flags[*]}" >&2
    if ! "$kolorun" -np "$RANKS" "$perf" -b "$MIN_BYTES" -e "$MAX_BYTES" -f "$FACTOR" \
        -n "$ITERS" -c 1 "${flags[@]}" >"$log" 2>&1; then
      failed=1
      echo "warmup.sh: ${flags[*]} failed; $log ends:" >&2
      tail -n 5 "$log" | sed 's/^/    /' >&2
    fi
    # Records "job round cycle size time wrong": the out-of-place time of each row, the cycle
    # (1, or 2 for the second pass of the same job) from whether its size came before in the log
    # (kolorun's "[rank] " prefix dropped where it was asked for).
    awk -v job="$job" -v round="$round" '{ sub(/^\[[0-9]+\] /, "") }
      !/^#/ && NF >= 13 && $1 ~ /^[0-9]+$/ {
        print job, round, ($1 in seen) ? 2 : 1, $1, $6, $9; seen[$1] = 1
      }' "$log" >>"$records"
  done
done

echo
echo "allreduce float32 sum at N = $RANKS (KOLO_TRANSPORT=${KOLO_TRANSPORT:-auto}), out of place,"\
     "-n $ITERS, $ROUNDS interleaved rounds; load $load_start at the start,"\
     "$(cut -d' ' -f1 /proc/loadavg) at the end; logs in $LOG_DIR"
awk -v short="$SHORT" -v long="$LONG" -v rounds="$ROUNDS" '
  function median(list,   n, values, i, j, t) {
    n = split(list, values, " ")
    for (i = 2; i <= n; i++) for (j = i; j > 1 && values[j - 1] + 0 > values[j] + 0; j--) {
      t = values[j]; values[j] = values[j - 1]; values[j - 1] = t
    }
    return n % 2 ? values[(n + 1) / 2] : (values[n / 2] + values[n / 2 + 1]) / 2
  }
  # Prints a table row and keeps the worst ratio of the table "name".
  function judge(name, bytes, a, b, ratio) {
    printf "%12d  %12.2f  %12.2f  %5.2f\n", bytes, a, b, ratio
    if (ratio > worst[name]) { worst[name] = ratio; worst_at[name] = bytes }
    if (ratio > 1.3) over[name] = over[name] (over[name] == "" ? "" : ", ") bytes " B"
  }
  function verdict(name, what) {
    if (over[name] == "") {
      printf "verdict %s: within 1.3x of the warmed-up time at every size (worst %.2fx at %d B)\n",
             what, worst[name], worst_at[name]
    } else {
      printf "verdict %s: more than 1.3x slower with -w %d at %s (worst %.2fx at %d B)\n",
             what, short, over[name], worst[name], worst_at[name]
    }
  }
  {
    key = $1 SUBSEP $4
    if ($1 == "same") {
      key = key SUBSEP $3; time[$1, $2, $3, $4] = $5
    }
    times[key] = times[key] " " $5; count[key]++
    if ($6 != 0) wrong = 1
    if (!($4 in seen)) { seen[$4] = 1; sizes[++size_count] = $4 }
  }
  END {
    header = sprintf("%12s  %12s  %12s  %s", "size (B)", "-w " short " (us)", "-w " long " (us)", "ratio")
    print "across jobs: a fresh job with -w " short " beside one with -w " long ", the medians"
    print header
    for (s = 1; s <= size_count; s++) {
      bytes = sizes[s]
      if (count["short", bytes] != rounds || count["long", bytes] != rounds) {
        printf "%12d  a round is missing (see the logs)\n", bytes; incomplete = 1; continue
      }
      a = median(times["short", bytes]); b = median(times["long", bytes])
      judge("across", bytes, a, b, a / b)
    }
    print ""
    print "within a job: -w " short " then the same rows after -w " long ", the median of each job'"'"'s ratio"
    print header
    for (s = 1; s <= size_count; s++) {
      bytes = sizes[s]
      if (count["same", bytes, 1] != rounds || count["same", bytes, 2] != rounds) {
        printf "%12d  a round is missing (see the logs)\n", bytes; incomplete = 1; continue
      }
      ratios = ""
      for (r = 1; r <= rounds; r++) ratios = ratios " " time["same", r, 1, bytes] / time["same", r, 2, bytes]
      judge("within", bytes, median(times["same", bytes, 1]), median(times["same", bytes, 2]),
            median(ratios))
    }
    print ""
    if (wrong) print "WRONG ELEMENTS in some run (see the logs)"
    if (incomplete) print "verdict: incomplete (a run failed)"
    else { verdict("across", "across jobs"); verdict("within", "within a job") }
    exit wrong || incomplete
  }' "$records" || failed=1
exit $failed
