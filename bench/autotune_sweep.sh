#!/bin/sh
# autotune_sweep.sh — the fusion engine's autotuner (KOLO_AUTOTUNE=1) against a sweep of fixed
# settings, on fusion_perf's models. For each transport and model:
#   1. the sweep: every setting of a grid of fusion threshold x cycle time x segment, one job each,
#      fused steps only (fusion_perf --fused-only): the median step of STEPS after WARMUP;
#   2. the autotuner: fusion_perf --autotune, steps until every rank has the tuner's final
#      settings, then the median of STEPS steps under them;
#   2. ROUNDS rounds, each the sweep's best setting again, then the autotuner (fusion_perf
#      --autotune: steps until every rank has the tuner's final settings, then the median of STEPS
#      steps under them), so that the two are measured in alternation under the same load (a
#      shared machine's load moves between the sweep's first and last job, and the lowest of many
#      noisy medians is itself lucky).
# One line per model: the sweep's best (setting and ms) and worst; the median over the rounds of
# the best setting's and of the tuner's step; the tuner's settled settings in each round, its
# tuning cost (median steps and seconds); ratio = best fixed / tuned over the rounds (>= 1: the
# tuner is as fast; the issue asks for >= 0.95) and sweep = the sweep's own best / tuned.
#
#   bench/autotune_sweep.sh
#
# Settings from the environment:
#   BUILD=./build  NP=2  TRANSPORTS="tcp ucx"  MODELS="resnet50 bert-base"
#   THRESHOLDS="0 1M 64M"  CYCLES="0.5 5 20"  SEGMENTS="256K 1M 4M 16M"   (the sweep's grid)
#   STEPS=7  WARMUP=1  WINDOW_MS=1000 (KOLO_AUTOTUNE_WINDOW_MS)  ROUNDS=3
#   LOG_DIR=a new temporary directory: every job's output and the tuner's CSV logs
set -eu
BUILD=${BUILD:-./build}
NP=${NP:-2}
TRANSPORTS=${TRANSPORTS:-"tcp ucx"}
MODELS=${MODELS:-"resnet50 bert-base"}
THRESHOLDS=${THRESHOLDS:-"0 1M 64M"}
CYCLES=${CYCLES:-"0.5 5 20"}
SEGMENTS=${SEGMENTS:-"256K 1M 4M 16M"}
STEPS=${STEPS:-7}
WARMUP=${WARMUP:-1}
WINDOW_MS=${WINDOW_MS:-1000}
ROUNDS=${ROUNDS:-3}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/kolo_autotune_sweep.XXXXXX)}
mkdir -p "$LOG_DIR"

# The median ms of one fixed setting (threshold $3, cycle $4, segment $5) for transport $1,
# model $2; $6 names the job's output apart.
fixed() {
  out="$LOG_DIR/$1.$2.$3.$4.$5$6.txt"
  KOLO_TRANSPORT=$1 KOLO_FUSION_THRESHOLD=$3 KOLO_CYCLE_TIME_MS=$4 KOLO_SEGMENT_BYTES=$5 \
    "$BUILD/src/kolorun" -np "$NP" --tag-output "$BUILD/bench/fusion_perf" --fused-only --model "$2" \
    --steps "$STEPS" --warmup "$WARMUP" >"$out" 2>&1
  awk -v m="$2" '$1 == "[0]" && $2 == m { print $6 }' "$out"
}

# The median of the numbers on standard input.
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

echo "# autotune_sweep: N = $NP, sweep of thresholds {$THRESHOLDS} x cycles {$CYCLES} ms x" \
  "segments {$SEGMENTS}; $STEPS steps after $WARMUP; window $WINDOW_MS ms; $ROUNDS rounds;" \
  "logs in $LOG_DIR"
echo "# ms: the slowest rank's step, median; fixed and tuned: medians over the rounds"
printf '# %-9s %-10s | %-14s %7s %7s | %7s %7s | %-44s %5s %6s | %6s %6s\n' \
  transport model "sweep best" ms worst fixed tuned "tuned settings per round" steps \
  "tune s" ratio sweep
for transport in $TRANSPORTS; do
  for model in $MODELS; do
    best="" best_ms="" worst_ms=""
    for threshold in $THRESHOLDS; do
      for cycle in $CYCLES; do
        for segment in $SEGMENTS; do
          ms=$(fixed "$transport" "$model" "$threshold" "$cycle" "$segment" "")
          [ -n "$ms" ] || { echo "failed: $LOG_DIR/$transport.$model.$threshold.$cycle.$segment.txt" >&2; exit 1; }
          if [ -z "$best_ms" ] || awk -v a="$ms" -v b="$best_ms" 'BEGIN { exit !(a < b) }'; then
            best="$threshold/$cycle/$segment" best_ms=$ms
          fi
          if [ -z "$worst_ms" ] || awk -v a="$ms" -v b="$worst_ms" 'BEGIN { exit !(a > b) }'; then
            worst_ms=$ms
          fi
        done
      done
    done
    fixed_ms="" tuned_ms="" tuned_steps="" tuned_s="" settings=""
    round=1
    while [ "$round" -le "$ROUNDS" ]; do
      again=$(IFS=/; set -- $best; fixed "$transport" "$model" "$1" "$2" "$3" ".again$round")
      out="$LOG_DIR/$transport.$model.autotune$round.txt"
      KOLO_TRANSPORT=$transport KOLO_AUTOTUNE=1 KOLO_AUTOTUNE_WINDOW_MS=$WINDOW_MS \
        KOLO_AUTOTUNE_LOG="$LOG_DIR/$transport.$model.autotune$round.csv" \
        "$BUILD/src/kolorun" -np "$NP" --tag-output "$BUILD/bench/fusion_perf" --autotune --model "$model" \
        --steps "$STEPS" >"$out" 2>&1 || { echo "failed: $out" >&2; exit 1; }
      tuned=$(awk -v m="$model" '
        function size(b) {
          if (b == 0) return "0"
          if (b % 1048576 == 0) return b / 1048576 "M"
          if (b % 1024 == 0) return b / 1024 "K"
          return b
        }
        $1 == "[0]" && $2 == m { printf "%s %s %s %s/%s/%s", $6, $10, $11, size($13), $14, size($15) }
      ' "$out")
      set -- $tuned
      fixed_ms="$fixed_ms $again" tuned_ms="$tuned_ms $1" tuned_steps="$tuned_steps $2"
      tuned_s="$tuned_s $3" settings="$settings${settings:+ }$4"
      round=$((round + 1))
    done
    f=$(echo $fixed_ms | tr ' ' '\n' | median)
    t=$(echo $tuned_ms | tr ' ' '\n' | median)
    printf '  %-9s %-10s | %-14s %7s %7s | %7s %7s | %-44s %5s %6s | %6.3f %6.3f\n' \
      "$transport" "$model" "$best" "$best_ms" "$worst_ms" "$f" "$t" "$settings" \
      "$(echo $tuned_steps | tr ' ' '\n' | median)" "$(echo $tuned_s | tr ' ' '\n' | median)" \
      "$(awk -v a="$f" -v b="$t" 'BEGIN { print a / b }')" \
      "$(awk -v a="$best_ms" -v b="$t" 'BEGIN { print a / b }')"
    echo "    fixed per round:$fixed_ms; tuned per round:$tuned_ms"
  done
done
