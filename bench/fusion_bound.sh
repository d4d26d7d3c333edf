#!/bin/sh
# fusion_bound.sh: a fused training step against its bound, one in-place allreduce of the same
# bytes, and against the same gradients sent by ordered calls, each measured in the same run.
#
#   sh bench/fusion_bound.sh [-k ROUNDS] [-t TRANSPORTS] [-N RANKS] [-m MODELS] [-b BUILD]
#
#   -k ROUNDS      rounds; each runs fusion_perf, then allreduce_perf at each model's bytes
#                  (default 3)
#   -t TRANSPORTS  KOLO_TRANSPORT values, comma-separated (default tcp,ucx)
#   -N RANKS       rank counts, comma-separated (default 2,4)
#   -m MODELS      fusion_perf's models (default resnet50,bert-base)
#   -b BUILD       the build directory (default build)
#
# Prints per transport, N and model the medians over the rounds: the fused step (ms), the ordered
# calls (ms), one in-place allreduce of the model's gradient bytes (ms), fused / one allreduce
# (the issue's bound: at most 1.1) and fused / ordered (at most 1).
set -eu
cd "$(dirname "$0")/.."
rounds=3 transports=tcp,ucx sizes=2,4 models=resnet50,bert-base build=build
while getopts k:t:N:m:b: option; do
  case $option in
    k) rounds=$OPTARG ;; t) transports=$OPTARG ;; N) sizes=$OPTARG ;;
    m) models=$OPTARG ;; b) build=$OPTARG ;; *) sed -n '5,13p' "$0" >&2; exit 2 ;;
  esac
done
log=$(mktemp "${TMPDIR:-/tmp}/kolo-fusion-bound.XXXXXX")
trap 'rm -f "$log"' EXIT
echo "# fusion_bound: $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  for transport in $(echo "$transports" | tr , ' '); do
    for n in $(echo "$sizes" | tr , ' '); do
      KOLO_TRANSPORT=$transport "$build/src/kolorun" -np "$n" "$build/bench/fusion_perf" \
        --steps 9 --warmup 2 --model "$models" 2>&1 |
        awk -v t="$transport" -v n="$n" -F'|' '/^\[0\] +[a-z]/ {
          split($1, a, " "); split($2, f, " "); split($5, o, " ")
          print t, n, a[2], "fused", f[1]; print t, n, a[2], "ordered", o[1] }' >>"$log"
      for model in $(echo "$models" | tr , ' '); do
        bytes=$("$build/bench/fusion_perf" --list-gradients --model "$model" |
          awk '{ sum += $3 } END { print sum * 4 }')
        KOLO_TRANSPORT=$transport "$build/src/kolorun" -np "$n" "$build/bench/allreduce_perf" \
          -b "$bytes" -e "$bytes" -n 9 -w 2 -o avg 2>&1 |
          awk -v t="$transport" -v n="$n" -v m="$model" '/^\[0\] +[0-9]+ / {
            print t, n, m, "allreduce", $11 / 1000 }' >>"$log"
      done
    done
  done
  echo "# round $round of $rounds done" >&2
done
echo "| transport | N | model | fused ms | ordered ms | one allreduce ms | fused / allreduce | fused / ordered |"
echo "|---|--:|---|--:|--:|--:|--:|--:|"
sort "$log" | awk '
  function median(list,   n, v, i, j, t) {
    n = split(list, v, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
    return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
  }
  { key = $1 " " $2 " " $3; values[key, $4] = values[key, $4] " " $5; keys[key] = 1 }
  END {
    for (key in keys) {
      split(key, k, " ")
      f = median(values[key, "fused"]); o = median(values[key, "ordered"])
      r = median(values[key, "allreduce"])
      printf "| %s | %s | %s | %.1f | %.1f | %.1f | %.2f | %.2f |\n", k[1], k[2], k[3], f, o, r, f / r, f / o
    }
  }' | sort
