#!/bin/sh
# fusion_bound.sh: a fused training step against its bound, one in-place allreduce of the same
# bytes, and against the same gradients sent by ordered calls, all three taking turns step by step
# in one run of fusion_perf --bound, so that a machine whose load changes treats them alike.
#
#   sh bench/fusion_bound.sh [-k ROUNDS] [-t TRANSPORTS] [-N RANKS] [-m MODELS] [-b BUILD]
#
#   -k ROUNDS      rounds, each one run of fusion_perf --bound --steps 9 --warmup 2 per transport
#                  and N (default 3)
#   -t TRANSPORTS  KOLO_TRANSPORT values, comma-separated (default tcp,ucx)
#   -N RANKS       rank counts, comma-separated (default 2,4)
#   -m MODELS      fusion_perf's models (default resnet50,bert-base)
#   -b BUILD       the build directory (default build)
#
# Prints per transport, N and model the medians over the rounds of the fused step, the ordered
# calls and the one allreduce (ms), the medians of each round's fused / one allreduce (the
# issue's bound: at most 1.1) and fused / ordered (at most 1), in how many rounds the fused
# step took no longer than the ordered calls, and (fusion_perf --breakdown) the medians of what
# the fused step spent outside its collectives and how much longer its collectives took than the
# ordered calls' (ms): the engine's own cost, and what fusing changed.
set -eu
cd "$(dirname "$0")/.."
rounds=3 transports=tcp,ucx sizes=2,4 models=resnet50,bert-base build=build
while getopts k:t:N:m:b: option; do
  case $option in
    k) rounds=$OPTARG ;; t) transports=$OPTARG ;; N) sizes=$OPTARG ;;
    m) models=$OPTARG ;; b) build=$OPTARG ;; *) sed -n '6,13p' "$0" >&2; exit 2 ;;
  esac
done
log=$(mktemp "${TMPDIR:-/tmp}/kolo-fusion-bound.XXXXXX")
trap 'rm -f "$log"' EXIT
echo "# fusion_bound: $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  for transport in $(echo "$transports" | tr , ' '); do
    for n in $(echo "$sizes" | tr , ' '); do
      # Rank 0's rows: model ... | fused ms ... | unfused ... | speedup | ordered ... | bound ms,
      # then the model's breakdown: "# fused <step> <in collectives> ...", "# ordered ...".
      KOLO_TRANSPORT=$transport "$build/src/kolorun" -np "$n" --tag-output "$build/bench/fusion_perf" \
        --bound --breakdown --steps 9 --warmup 2 --model "$models" 2>&1 |
        awk -v t="$transport" -v n="$n" -F'|' '
          /^\[0\] +[a-z]/ {
            split($1, a, " "); split($2, f, " "); split($5, o, " "); split($6, b, " ")
            row = t " " n " " a[2] " " f[1] " " o[1] " " b[1] }
          /^\[0\] # fused / { split($0, x, " "); fused_step = x[4]; fused_in = x[5] }
          /^\[0\] # ordered / {
            split($0, x, " ")
            print row, fused_step - fused_in, fused_in - x[5] }' >>"$log"
    done
  done
  echo "# round $round of $rounds done" >&2
done
echo "| transport | N | model | fused ms | ordered ms | one allreduce ms | fused / allreduce | fused / ordered | fused <= ordered | fused outside collectives ms | fused - ordered inside collectives ms |"
echo "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|"
awk '
  function median(list,   n, v, i, j, t) {
    n = split(list, v, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
    return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
  }
  {
    key = $1 " " $2 " " $3; keys[key] = 1; count[key]++
    fused[key] = fused[key] " " $4; ordered[key] = ordered[key] " " $5; bound[key] = bound[key] " " $6
    to_bound[key] = to_bound[key] " " $4 / $6; to_ordered[key] = to_ordered[key] " " $4 / $5
    outside[key] = outside[key] " " $7; inside[key] = inside[key] " " $8
    if ($4 <= $5) faster[key]++
  }
  END {
    for (key in keys) {
      split(key, k, " ")
      printf "| %s | %s | %s | %.1f | %.1f | %.1f | %.2f | %.2f | %d of %d | %.2f | %.2f |\n",
        k[1], k[2], k[3], median(fused[key]), median(ordered[key]), median(bound[key]),
        median(to_bound[key]), median(to_ordered[key]), faster[key], count[key],
        median(outside[key]), median(inside[key])
    }
  }' "$log" | sort
