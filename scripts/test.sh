#!/bin/sh
# Installs what is missing, builds, runs the whole test suite, and ends with the line
# "N passed, N failed" (CI reads that line).
set -eu
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
sh scripts/build.sh
status=0
meson test -C build --print-errorlogs --num-processes 1 "$@" || status=$?
python3 scripts/test_summary.py build/meson-logs/testlog.json
exit $status
