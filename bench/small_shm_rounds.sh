#!/usr/bin/env bash
# small_shm_rounds.sh — small allreduce over shared memory on one host: kolo (its default transport,
# the shared-memory rings) and Open MPI (btl self,vader) side by side, in interleaved rounds (round
# 1 of every configuration, then round 2 ...), so that a machine whose load changes during the run
# weighs on every column alike. Each run is all_reduce_perf / mpi_allreduce_perf with
# `-b MIN -e MAX -f FACTOR -n ITERS -w WARMUP -c CHECK`; a cell is the median of the rounds, with
# the lowest and highest, and each kolo column also as a ratio to Open MPI's in the same rounds.
#
#   bench/small_shm_rounds.sh                 8 B and 4 KiB, N = 2 and 4, nine rounds
#
# Several builds of kolo can run side by side: LIBS="before=DIR after=DIR" runs kolo once
# per entry with DIR first on LD_LIBRARY_PATH (a directory holding the libkolo.so.0 of that build;
# kolo's programs find their library through RUNPATH, which LD_LIBRARY_PATH overrides).
#
# Settings come from the environment:
#   BUILD=./build      the meson build directory (kolorun, all_reduce_perf, mpi_allreduce_perf)
#   RANKS="2 4"  ROUNDS=9  MIN=8  MAX=4K  FACTOR=512  ITERS=20000  WARMUP=2000  CHECK=1
#   LIBS=              NAME=DIR pairs (empty: the build's own library, column "kolo")
#   RANK_ENV=          extra VAR=VALUE settings for kolo's runs (KOLO_BIND=core ...)
#   MPIRUN_ARGS="--bind-to none"   (and --oversubscribe: N may exceed the cores)
#   OUT=<new file in /tmp>   every run's figures: round, ranks, config, bytes, out-of-place and
#                            in-place µs; the table is printed at the end
#
# Every round also runs bench/cache_pingpong (a cache line's round trip between CPUs 0 and 1, in
# rows of config "cache_pingpong", µs), the unit of docs/performance.md's small-message model.
set -uo pipefail

BUILD=${BUILD:-./build}
RANKS=${RANKS:-"2 4"}
ROUNDS=${ROUNDS:-9}
MIN=${MIN:-8}
MAX=${MAX:-4K}
FACTOR=${FACTOR:-512}
ITERS=${ITERS:-20000}
WARMUP=${WARMUP:-2000}
CHECK=${CHECK:-1}
LIBS=${LIBS:-}
RANK_ENV=${RANK_ENV:-}
MPIRUN_ARGS=${MPIRUN_ARGS:---bind-to none}
OUT=${OUT:-$(mktemp /tmp/small_shm_rounds.XXXXXX.tsv)}

for program in src/kolorun bench/all_reduce_perf bench/mpi_allreduce_perf; do
  [ -x "$BUILD/$program" ] || { echo "small_shm_rounds.sh: no $BUILD/$program" >&2; exit 2; }
done
command -v mpirun >/dev/null || { echo "small_shm_rounds.sh: no mpirun" >&2; exit 2; }
root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
configs=()
if [ -z "$LIBS" ]; then configs+=("kolo="); else for entry in $LIBS; do configs+=("$entry"); done; fi
configs+=("mpi")
flags=(-b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" -w "$WARMUP" -c "$CHECK")

# The rows of a perf program's table: bytes, out-of-place time, in-place time, and whether any
# element was wrong.
rows() { awk '$1 ~ /^[0-9]+$/ && NF >= 13 { print $1 "\t" $6 "\t" $10 "\t" ($9 + $13) }'; }

echo "# $(date -u '+%F %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), LIBS=$LIBS RANK_ENV=$RANK_ENV" | tee "$OUT"
printf 'round\tranks\tconfig\tbytes\tout_of_place_us\tin_place_us\n' >>"$OUT"
failed=0
for round in $(seq 1 "$ROUNDS"); do
  if [ -x "$BUILD/bench/cache_pingpong" ]; then
    ns=$("$BUILD/bench/cache_pingpong" 2>/dev/null | awk '/per round trip/ { print $(NF - 4) }')
    [ -n "$ns" ] && printf '%s\t2\tcache_pingpong\t64\t%s\t%s\n' "$round" \
      "$(awk -v ns="$ns" 'BEGIN { print ns / 1000 }')" "$(awk -v ns="$ns" 'BEGIN { print ns / 1000 }')" >>"$OUT"
  fi
  for n in $RANKS; do
    for config in "${configs[@]}"; do
      name=${config%%=*}
      if [ "$name" = mpi ]; then
        # shellcheck disable=SC2086
        output=$(timeout 300 mpirun "${root[@]}" --oversubscribe $MPIRUN_ARGS -np "$n" --mca pml ob1 \
                 --mca btl self,vader "$BUILD/bench/mpi_allreduce_perf" "${flags[@]}" 2>&1)
      else
        dir=${config#*=}
        # shellcheck disable=SC2086
        output=$(env ${dir:+LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"} $RANK_ENV \
                 timeout 300 "$BUILD/src/kolorun" -np "$n" "$BUILD/bench/all_reduce_perf" "${flags[@]}" 2>&1)
      fi
      status=$?
      table=$(rows <<<"$output")
      if [ $status -ne 0 ] || [ -z "$table" ]; then
        echo "round $round, N=$n, $name: failed (status $status)" >&2
        tail -n 5 <<<"$output" >&2
        failed=1
        continue
      fi
      while IFS=$'\t' read -r bytes outside inside wrong; do
        if [ "$wrong" != 0 ] && [ "$CHECK" != 0 ]; then
          echo "round $round, N=$n, $name, $bytes B: $wrong wrong elements" >&2
          failed=1
        fi
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$n" "$name" "$bytes" "$outside" "$inside" >>"$OUT"
      done <<<"$table"
    done
  done
done
echo "# finished $(date -u '+%H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"

/usr/bin/python3 - "$OUT" <<'EOF'
import csv, statistics, sys
from collections import defaultdict
times = defaultdict(list)       # (ranks, config, bytes, placement) -> per round
by_round = defaultdict(dict)    # (ranks, bytes, placement, round) -> config -> time
configs = []
pingpong = []
with open(sys.argv[1]) as f:
    for row in csv.DictReader((line for line in f if not line.startswith('#')), delimiter='\t'):
        if row['config'] == 'cache_pingpong':
            pingpong.append(float(row['out_of_place_us']))
            continue
        if row['config'] not in configs:
            configs.append(row['config'])
        for placement, column in (('out of place', 'out_of_place_us'), ('in place', 'in_place_us')):
            key = (int(row['ranks']), row['config'], int(row['bytes']), placement)
            times[key].append(float(row[column]))
            by_round[(int(row['ranks']), int(row['bytes']), placement, row['round'])][row['config']] = float(row[column])
kolos = [c for c in configs if c != 'mpi']
def cell(values):
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"
header = ['N', 'bytes', ''] + configs + [f'{c} / mpi' for c in kolos]
print('| ' + ' | '.join(header) + ' |')
print('|' + '|'.join(['--:'] * len(header)) + '|')
for ranks, size, placement in sorted({(k[0], k[2], k[3]) for k in times}, key=lambda k: (k[0], k[1], k[2] != 'out of place')):
    line = [str(ranks), str(size), placement]
    for config in configs:
        values = times.get((ranks, config, size, placement))
        line.append(cell(values) if values else '-')
    for config in kolos:
        ratios = [r[config] / r['mpi'] for key, r in by_round.items()
                  if key[:3] == (ranks, size, placement) and config in r and 'mpi' in r and r['mpi'] > 0]
        line.append(f"{statistics.median(ratios):.2f}" if ratios else '-')
    print('| ' + ' | '.join(line) + ' |')
print('(µs per call: median of the rounds (lowest–highest); ratios: median of the per-round ratios)')
if pingpong:
    print(f'cache_pingpong, CPU 0 <-> 1: {cell(pingpong)} µs per round trip')
EOF
echo "figures: $OUT"
exit $failed
