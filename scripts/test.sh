#!/bin/sh
# Installs what is missing, builds, runs the whole test suite, and ends with the line
# "N passed, N failed" (CI reads that line), which counts the tests of every build. Each test runs
# once: kolo's C tests under AddressSanitizer and UndefinedBehaviorSanitizer (scripts/sanitize.sh
# asan, which lists them), the rest (the Python package, the soak, the fuzz suite, the install and
# layering checks) in the plain build; then the ThreadSanitizer
# run of the fusion engine, splits and threaded unit tests. What each part costs is in the README
# (Development).
#   sh scripts/test.sh                     everything (what .ci/run does)
#   sh scripts/test.sh --no-sanitizers     the whole suite in the plain build, no sanitizer
#   sh scripts/test.sh [...] NAMES/OPTIONS passed to `meson test` of the plain build; with any,
#                                          the sanitizer runs are left out
set -eu
cd "$(dirname "$0")/.."
sanitizers=yes
if [ "${1:-}" = "--no-sanitizers" ]; then
  sanitizers=no
  shift
fi
[ $# -eq 0 ] || sanitizers=no
sh scripts/install-deps.sh
sh scripts/build.sh
status=0
logs=build/meson-logs/testlog.json
if [ "$sanitizers" = yes ]; then
  under_asan=$(sh scripts/sanitize.sh --list-asan build)
  plain_tests=$(meson test -C build --no-rebuild --list 2>/dev/null | grep " / " |
    sed 's|.* / ||' | grep -v -x -F "$under_asan")
  # shellcheck disable=SC2086
  meson test -C build --print-errorlogs --num-processes 1 $plain_tests || status=$?
  sh scripts/sanitize.sh asan || status=$?
  sh scripts/sanitize.sh tsan || status=$?
  logs="$logs build-asan/meson-logs/testlog.json build-tsan/meson-logs/testlog.json"
else
  meson test -C build --print-errorlogs --num-processes 1 "$@" || status=$?
fi
# shellcheck disable=SC2086
python3 scripts/test_summary.py $logs
exit $status
