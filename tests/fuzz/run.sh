#!/bin/sh
# Builds the fuzz targets (meson option fuzz: clang's libFuzzer with AddressSanitizer and
# UndefinedBehaviorSanitizer) in ./build-fuzz and runs each, one after another, from a copy of its
# checked-in corpus (tests/fuzz/corpus/<target>/, never written to), printing one line per target:
#   fuzz <target>: N executions, cov X ft Y, ok|FAILED
# with libFuzzer's own coverage counts. Exits 1 when any target failed (a crash, a leak, a broken
# invariant, more than 2048 MB of memory, or one allocation over 256 MB), after printing the end of
# its log; the input that failed is kept in build-fuzz/crashes/.
#
# Usage: tests/fuzz/run.sh [SECONDS [RUNS [TARGET...]]]
#   SECONDS  how long each target runs (default 20; 0: no limit)
#   RUNS     stop each target after this many executions (default -1: no limit)
#   TARGET   the targets to run (default: all of them)
set -u
cd "$(dirname "$0")/../.." || exit 1
seconds=${1:-20}
runs=${2:--1}
if [ $# -gt 2 ]; then shift 2; else set --; fi
targets=${*:-$(cat tests/fuzz/targets)}
build="build-fuzz"

if [ ! -f "$build/build.ninja" ]; then
  CC=clang-14 CXX=clang++-14 meson setup "$build" -Dfuzz=true -Dtests=disabled -Ducx=disabled \
    -Dcuda=disabled -Dnccl=disabled >/dev/null || { echo "fuzz: meson setup failed"; exit 1; }
fi
executables=""
for target in $targets; do executables="$executables tests/fuzz/fuzz_$target"; done
# shellcheck disable=SC2086
ninja -C "$build" $executables >"$build/fuzz-build.log" 2>&1 ||
  { tail -n 50 "$build/fuzz-build.log"; echo "fuzz: the build failed"; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$build/crashes"
failed=0
for target in $targets; do
  mkdir -p "$work/$target"
  cp tests/fuzz/corpus/"$target"/* "$work/$target"/
  log="$work/$target.log"
  status=ok
  "$build/tests/fuzz/fuzz_$target" -max_total_time="$seconds" -runs="$runs" -rss_limit_mb=2048 \
    -malloc_limit_mb=256 -print_final_stats=1 -artifact_prefix="$build/crashes/$target-" \
    "$work/$target" >"$log" 2>&1 || status=FAILED
  executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  coverage=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -n 1 | sed 's/: / /g')
  echo "fuzz $target: ${executions:-0} executions, ${coverage:-cov 0 ft 0}, $status"
  if [ "$status" = FAILED ]; then
    tail -n 40 "$log"
    failed=$((failed + 1))
  fi
done
[ "$failed" -eq 0 ]
