#!/bin/sh
# Installs what is missing, builds, runs the whole test suite, then the ThreadSanitizer run of
# scripts/sanitize.sh, and ends with the line "N passed, N failed" (CI reads that line), which
# counts the tests of both builds. The AddressSanitizer run (`sh scripts/sanitize.sh asan`) is not
# part of it yet: it has not completed once on the whole suite, and its estimated cost would take
# .ci/run past its 45 minutes (README, Development).
#   sh scripts/test.sh                     everything (what .ci/run does)
#   sh scripts/test.sh --no-sanitizers     the plain build's suite only
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
meson test -C build --print-errorlogs --num-processes 1 "$@" || status=$?
logs=build/meson-logs/testlog.json
if [ "$sanitizers" = yes ]; then
  sh scripts/sanitize.sh tsan || status=$?
  logs="$logs build-tsan/meson-logs/testlog.json"
fi
# shellcheck disable=SC2086
python3 scripts/test_summary.py $logs
exit $status
