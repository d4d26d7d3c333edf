#!/bin/sh
# The main job: installs what is missing, builds, and runs kolo's allreduce beside Open MPI's on
# this machine (bench/main_job.sh): N = 2, and N = 4 where there are 4 cores, interleaved rounds,
# every element checked; one table with each one's time, bus bandwidth and the ratio, a verdict
# line per N, and a plot in build/main-job/main_job.png. Settings: see bench/main_job.sh.
set -eu
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
sh scripts/build.sh
exec bash bench/main_job.sh "$@"
