#!/bin/sh
# The main job: installs what is missing, builds, and runs a 4-rank allreduce benchmark on this
# machine (nccl-tests' table, float32 sum, 64 KiB to 256 MiB).
set -eu
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
sh scripts/build.sh
exec build/src/kolorun -np 4 build/bench/all_reduce_perf -b 64K -e 256M -f 4 -n 10 -w 3 "$@"
