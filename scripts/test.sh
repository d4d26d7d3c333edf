#!/bin/sh
# Installs what is missing, builds, runs tests, and ends with the line "N passed, N failed" (CI
# reads that line). What each part costs is in docs/contributing.md.
#   sh scripts/test.sh                   the plain suite (about 15 minutes on 2 cores): every test
#                                        of the plain build but the long ones named in LONG below
#   sh scripts/test.sh --all             everything (what .ci/run does): the long tests too, and
#                                        the sanitizer builds. Each test runs once: kolo's C tests
#                                        under AddressSanitizer and UndefinedBehaviorSanitizer
#                                        (scripts/sanitize.sh asan, which lists them), the rest (the
#                                        Python package, the soak, the fuzz suite, pip install, the
#                                        install and layering checks) in the plain build; then the
#                                        ThreadSanitizer run of the fusion engine, splits and
#                                        threaded unit tests. The last line counts every build.
#   sh scripts/test.sh --no-sanitizers   every test of the plain build, long ones included
#   sh scripts/test.sh NAMES/OPTIONS     passed to `meson test` of the plain build
set -eu
cd "$(dirname "$0")/.."
# The long tests, left to --all: the soak (2 minutes of load), the fuzz suite (a build of its
# own), `pip install .` in a venv (a build of its own), the simulated cluster, the strangers at
# every listener, and the repeats of the multi-process tests over other transport flavours (UCX
# through its TCP, shared-memory and stream paths, the fusion engine over UCX, TCP beside kolo's
# rings); the plain suite keeps each test over TCP and UCX as kolo picks them by default.
LONG='^(soak|fuzz_.*|pip_install|cluster_.*|(ucx_)?strangers|ucx_(tcp|shm|stream|fusion)_.*|tcp_shm_.*)$'
mode=quick
case "${1:-}" in
  --all) mode=all; shift ;;
  --no-sanitizers) mode=plain; shift ;;
esac
[ $# -eq 0 ] || mode=plain
sh scripts/install-deps.sh
if [ "$mode" = all ]; then
  # The plain build compiles only what its share of the tests needs (`meson test` builds the
  # selected tests' dependencies); the AddressSanitizer build compiles every target.
  [ -f build/build.ninja ] || meson setup build
else
  sh scripts/build.sh
fi
status=0
logs=build/meson-logs/testlog.json
all_tests() {
  meson test -C build --no-rebuild --list 2>/dev/null | grep " / " | sed 's|.* / ||'
}
case "$mode" in
  quick)
    tests=$(all_tests | grep -v -E "$LONG")
    # shellcheck disable=SC2086
    meson test -C build --print-errorlogs --num-processes 1 $tests || status=$?
    ;;
  all)
    under_asan=$(sh scripts/sanitize.sh --list-asan build)
    tests=$(all_tests | grep -v -x -F "$under_asan")
    rm -f "$logs"
    # The sanitizer builds compile at the lowest priority while the plain build's tests run, on
    # the CPU time those tests leave idle (they wait on launchers, timeouts and each other's
    # ranks); a build that fails there fails again, with its errors shown, in sanitize.sh below.
    # Where the kernel groups processes by session (sched_autogroup), a nice value only ranks
    # processes within their group, and each test runs in a session of its own: the builds get a
    # session whose group is itself at nice 19.
    setsid -w sh -c 'echo 19 >/proc/self/autogroup 2>/dev/null
      exec nice -n 19 sh scripts/sanitize.sh --build' >build/sanitizer-builds.log 2>&1 &
    builds=$!
    # shellcheck disable=SC2086
    meson test -C build --print-errorlogs --num-processes 1 $tests || status=$?
    wait "$builds" || true
    sh scripts/sanitize.sh asan || status=$?
    sh scripts/sanitize.sh tsan || status=$?
    logs="$logs build-asan/meson-logs/stream1.json build-asan/meson-logs/stream2.json"
    logs="$logs build-tsan/meson-logs/testlog.json"
    ;;
  plain)
    meson test -C build --print-errorlogs --num-processes 1 "$@" || status=$?
    ;;
esac
# shellcheck disable=SC2086
python3 scripts/test_summary.py $logs
exit $status
