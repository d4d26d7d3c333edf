#!/bin/sh
# Builds kolo with sanitizers and runs tests under them; scripts/test.sh calls it beside the plain
# suite and counts its results in its last line. What each part costs is in
# docs/contributing.md ("Sanitizers").
#   build-asan  AddressSanitizer (with LeakSanitizer) and UndefinedBehaviorSanitizer on kolo's own
#               code (-Dsanitize_kolo: the core, libkolo, kolorun; the workers and benchmarks that
#               drive it are built at -O1 without them, the Catch2 test programs at -O0): the
#               whole suite except the Python
#               package's (Python would need libasan preloaded), the soak (its memory bounds
#               measure the plain build; the sanitizers' quarantine would break them), the fuzz
#               suite (its own build, sanitized as well), and the checks that run no kolo code
#               under the sanitizers: layers, install_deps, scaling_model (Python scripts) and
#               install_consumers (programs built outside Meson, without the sanitizer runtime
#               that the sanitized libkolo needs to come first). `sh scripts/sanitize.sh
#               --list-asan BUILD_DIR` prints these tests' names; scripts/test.sh runs the others
#               in the plain build, so that each test runs once.
#   build-tsan  ThreadSanitizer: the fusion engine (fusion_*, and two of them over TCP beside
#               kolo's rings), the splits, a shrink past ranks killed in a named batch and during
#               the agreement, and the threaded unit tests, over kolo's own transports; only what
#               they need is built.
# Any report fails the test that made it (halt_on_error). Both runs set UCX_MEM_EVENTS=no: UCX's
# libucm hooks madvise, which glibc calls as a thread exits, and takes a lock there that the
# sanitizer's runtime no longer handles for that thread (SIGSEGV in __tsan::MutexPreReadLock
# under ucm_madvise); without memory events UCX only gives up its registration cache.
# Suppressions, for third-party libraries only, are in tests/sanitizers/ with the reason for each.
#   sh scripts/sanitize.sh [asan|tsan]     both by default, or one of them
#   sh scripts/sanitize.sh --list-asan DIR the AddressSanitizer run's tests, from DIR's test list
#   sh scripts/sanitize.sh --build         builds both, runs nothing (scripts/test.sh --all
#                                          runs it at the lowest priority beside the plain tests)
set -u
cd "$(dirname "$0")/.."
here=$(pwd)
which=${1:-all}
status=0

# The real launchers' cluster tests (Slurm, mpirun, torchrun, kolorun -H and --elastic) start their
# ranks through daemons, ssh and Debian's python, which cannot load an instrumented library without
# preloading its runtime; what they reach of kolo runs under the sanitizers in the one-machine tests (kolorun,
# mpirun_pmix, test_config, the store's and the start-up's tests). The main job (main_job) runs
# Open MPI's benchmark beside kolo's: built instrumented, it fails on the leaks LeakSanitizer finds
# in Open MPI at exit; the same kolo programs run under ASan in all_reduce_perf_check.
list_asan() {
  meson test -C "$1" --no-rebuild --list --no-suite python --no-suite soak --no-suite fuzz \
    2>/dev/null | grep " / " |
    sed 's|.* / ||' |
    grep -v -E '^(install_consumers|install_deps|layers|scaling_model|docs|docs_self_test|main_job)$' |
    grep -v -E '^cluster_(slurm|mpirun|torchrun|kolorun|elastic)$'
}
if [ "$which" = --list-asan ]; then
  list_asan "$2"
  exit
fi

# Configures (once) and builds a sanitizer build dir: DIR, then `meson setup` options, `--`, and
# the targets to build (all when none).
build() {
  dir=$1
  shift
  options=
  while [ "$1" != -- ]; do
    options="$options $1"
    shift
  done
  shift
  rm -f "$dir"/meson-logs/*.json
  if [ ! -f "$dir/build.ninja" ]; then
    # shellcheck disable=SC2086
    meson setup "$dir" $options -Db_lundef=false >/dev/null || return 1
  fi
  ninja -C "$dir" "$@"
}

# One stream of the AddressSanitizer run's tests: its number, then the tests.
run_stream() {
  stream=$1
  shift
  ASAN_OPTIONS="detect_leaks=1:halt_on_error=1" \
  LSAN_OPTIONS="suppressions=$here/tests/sanitizers/lsan.supp:print_suppressions=0" \
  UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" UCX_MEM_EVENTS=no \
    meson test -C build-asan --no-rebuild --print-errorlogs --num-processes 1 \
      --logbase "stream$stream" "$@"
}

build_asan() {
  build build-asan -Dbuildtype=plain -Doptimization=1 -Ddebug=false \
    -Dsanitize_kolo=address,undefined --
}
build_tsan() {
  build build-tsan -Dbuildtype=debugoptimized -Db_sanitize=thread -- \
    src/kolorun tests/test_fusion tests/kolo_fusion_worker tests/test_fusion_units \
    tests/test_more_collectives tests/kolo_test_collectives tests/test_store tests/test_gate \
    tests/test_config tests/test_split tests/test_shm_ring \
    tests/test_elastic tests/kolo_test_elastic
}
if [ "$which" = --build ]; then
  build_asan && build_tsan
  exit
fi

if [ "$which" != tsan ]; then
  if build_asan; then
    asan_tests=$(list_asan build-asan)
    # Two streams of tests at once, their logs meson-logs/stream1.json and stream2.json: one
    # stream alone left the two CPUs idle a third of its time (its tests wait on timeouts, slow
    # ranks and launchers). The simulated cluster's tests share its namespaces: all of them in
    # the second stream, one after another.
    first=$(echo "$asan_tests" | grep -v '^cluster_' | awk 'NR % 2 == 1')
    second=$(echo "$asan_tests" | grep -v '^cluster_' | awk 'NR % 2 == 0'
      echo "$asan_tests" | grep '^cluster_')
    # shellcheck disable=SC2086
    run_stream 2 $second >build-asan/meson-logs/stream2.out 2>&1 &
    second_pid=$!
    # shellcheck disable=SC2086
    run_stream 1 $first || status=$?
    wait "$second_pid" || status=$?
    cat build-asan/meson-logs/stream2.out
  else
    status=1
  fi
fi

if [ "$which" != asan ]; then
  tsan_tests="test_store test_gate test_config test_fusion_units test_split split"
  tsan_tests="$tsan_tests fault_sigkill_split shrink_fused shrink_during tcp_shm_fusion_threads"
  tsan_tests="$tsan_tests tcp_shm_fusion_peerlost test_shm_ring"
  for tag in orders many bitwise large mixed cache group broadcast duplicate mismatch badargs \
    peerlost destroy leave stall threads idle late allgather allgather_errors join autotune \
    measured one_ring; do
    tsan_tests="$tsan_tests fusion_$tag"
  done
  if build_tsan; then
    # shellcheck disable=SC2086
    TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$here/tests/sanitizers/tsan.supp" \
    UCX_MEM_EVENTS=no \
      meson test -C build-tsan --no-rebuild --print-errorlogs --num-processes 1 $tsan_tests ||
      status=$?
  else
    status=1
  fi
fi
exit $status
