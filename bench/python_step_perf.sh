#!/bin/sh
# A training step's communication from Python beside the same step from C, one after the other:
# bench/fusion_perf (C, named operations fused by kolo's engine) and bench/python_step_perf.py
# (kolo.torch's DistributedOptimizer hooks, DDP on gloo, DDP on kolo), on N ranks (default 2).
# Python's share of a step = (kolo-hooks comm ms - fusion_perf fused ms) / kolo-hooks comm ms.
#   sh bench/python_step_perf.sh [N] [extra python_step_perf.py arguments]
# KOLO_TRANSPORT defaults to tcp here.
set -eu
cd "$(dirname "$0")/.."
n=${1:-2}
[ $# -gt 0 ] && shift
export PYTHONPATH="$PWD/python"
# Over TCP unless told otherwise, as DDP on gloo beside it (kolo's own default would take the
# shared-memory rings on one host).
export KOLO_TRANSPORT="${KOLO_TRANSPORT:-tcp}"
build/src/kolorun -np "$n" build/bench/fusion_perf --model resnet50,bert-base --steps 5 \
    --warmup 1 --no-ordered
build/src/kolorun -np "$n" /usr/bin/python3 bench/python_step_perf.py \
    --model resnet50,bert-base --steps 5 --warmup 1 "$@"
