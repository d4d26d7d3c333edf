#!/usr/bin/env bash
# small_latency_rounds.sh — one small allreduce's time, kolo against Open MPI's shared memory (btl
# self,vader), to 0.1 ns (bench/small_latency.c): rounds of every configuration in turn, then a
# table of medians and of each kolo column's ratio to Open MPI (the median of the rounds' own
# ratios), split by where the host had put the two CPUs: each round also runs bench/cache_pingpong
# (a cache line's round trip between CPUs 0 and 1), and rounds under NEAR_NS count as near.
#
#   bench/small_latency_rounds.sh                8 bytes, N = 2, 21 rounds
#   LIBS="before=DIR after=DIR" bench/small_latency_rounds.sh
#
# LIBS runs kolo once per NAME=DIR entry with DIR first on LD_LIBRARY_PATH (a directory holding the
# libkolo.so.0 of that build); empty: the build's own library, column "kolo".
# Settings: BUILD=./build RANKS=2 ROUNDS=21 BYTES=8 CALLS=200000 WARMUP=20000 NEAR_NS=150
#   OUT=<new file in /tmp>: every run's figures (round, config, bytes, out-of-place and in-place
#   ns, the round's cache_pingpong ns).
set -uo pipefail

BUILD=${BUILD:-./build}
RANKS=${RANKS:-2}
ROUNDS=${ROUNDS:-21}
BYTES=${BYTES:-8}
CALLS=${CALLS:-200000}
WARMUP=${WARMUP:-20000}
NEAR_NS=${NEAR_NS:-150}
LIBS=${LIBS:-}
OUT=${OUT:-$(mktemp /tmp/small_latency_rounds.XXXXXX.tsv)}

for program in src/kolorun bench/small_latency bench/mpi_small_latency bench/cache_pingpong; do
  [ -x "$BUILD/$program" ] || { echo "small_latency_rounds.sh: no $BUILD/$program" >&2; exit 2; }
done
command -v mpirun >/dev/null || { echo "small_latency_rounds.sh: no mpirun" >&2; exit 2; }
root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
configs=()
if [ -z "$LIBS" ]; then configs+=("kolo="); else for entry in $LIBS; do configs+=("$entry"); done; fi

echo "# $(date -u '+%F %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), N=$RANKS, $BYTES bytes, $CALLS calls, LIBS=$LIBS" | tee "$OUT"
printf 'round\tconfig\tbytes\tout_of_place_ns\tin_place_ns\tcache_pingpong_ns\n' >>"$OUT"
failed=0
for round in $(seq 1 "$ROUNDS"); do
  lines=()
  for entry in "${configs[@]}"; do
    name=${entry%%=*}
    dir=${entry#*=}
    line=$(LD_LIBRARY_PATH=${dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
      "$BUILD/src/kolorun" -np "$RANKS" "$BUILD/bench/small_latency" "$BYTES" "$CALLS" "$WARMUP") ||
      { echo "small_latency_rounds.sh: round $round, $name failed" >&2; failed=1; continue; }
    lines+=("$name $line")
  done
  line=$(mpirun "${root[@]}" --bind-to none --oversubscribe -np "$RANKS" --mca pml ob1 \
    --mca btl self,vader "$BUILD/bench/mpi_small_latency" "$BYTES" "$CALLS" "$WARMUP") ||
    { echo "small_latency_rounds.sh: round $round, Open MPI failed" >&2; failed=1; continue; }
  lines+=("mpi $line")
  pingpong=$("$BUILD/bench/cache_pingpong" | awk '{ print $(NF - 4) }')
  for entry in "${lines[@]}"; do
    read -r name bytes out in wrong <<<"$entry"
    [ "$wrong" = 0 ] || { echo "small_latency_rounds.sh: $name: $wrong wrong elements" >&2; failed=1; }
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$name" "$bytes" "$out" "$in" "$pingpong" >>"$OUT"
  done
done

/usr/bin/python3 - "$OUT" "$NEAR_NS" <<'PY'
import collections, statistics, sys
path, near_ns = sys.argv[1], float(sys.argv[2])
rounds = collections.defaultdict(dict)
for line in open(path):
    if line.startswith('#') or line.startswith('round'):
        continue
    r, config, _, out, inp, pp = line.split('\t')
    rounds[int(r)][config] = (float(out), float(inp), float(pp))
configs = [c for c in next(iter(rounds.values())) if c != 'mpi'] if rounds else []
print('| CPUs | rounds | | ' + ' | '.join(configs + ['mpi']) + ' | ' +
      ' | '.join(c + ' / mpi' for c in configs) + ' |')
print('|---|--:|---|' + '--:|' * (2 * len(configs) + 1))
for label, keep in (('near', lambda p: p < near_ns), ('far', lambda p: p >= near_ns)):
    chosen = [v for v in rounds.values() if 'mpi' in v and keep(v['mpi'][2])]
    if not chosen:
        continue
    pp = statistics.median(v['mpi'][2] for v in chosen)
    for column, placement in ((0, 'out of place'), (1, 'in place')):
        cells = []
        for c in configs + ['mpi']:
            values = [v[c][column] for v in chosen if c in v]
            cells.append('%.1f (%.1f–%.1f)' % (statistics.median(values), min(values), max(values)))
        ratios = ['%.3f' % statistics.median(v[c][column] / v['mpi'][column] for v in chosen if c in v)
                  for c in configs]
        print('| %s, %.0f ns | %d | %s | %s | %s |' % (label, pp, len(chosen), placement,
              ' | '.join(cells), ' | '.join(ratios)))
print('(ns per call: median of the rounds (lowest–highest); ratios: median of the rounds\' own '
      'ratios; CPUs: near where cache_pingpong took under %.0f ns, with its median)' % near_ns)
PY
echo "figures: $OUT"
exit "$failed"
