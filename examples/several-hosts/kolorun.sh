#!/bin/sh
# kolorun across hosts: two ranks on each host named, started from the first host over ssh.
# Every host sees this checkout at the same path and reaches the others with ssh keys alone.
# From the checkout's root:  sh examples/several-hosts/kolorun.sh node1 node2 node3 node4
set -eu
[ $# -ge 1 ] || { echo "usage: $0 HOST..." >&2; exit 2; }
hosts=$(printf '%s:2,' "$@")    # node1:2,node2:2,...: host:slots, as horovodrun and mpirun take it
export PYTHONPATH=$PWD/python   # kolo's Python package; kolorun forwards PYTHONPATH
build/src/kolorun -np $((2 * $#)) -H "${hosts%,}" \
    build/bench/all_reduce_perf -b 8 -e 1M -f 4 -c 1
build/src/kolorun -np $((2 * $#)) -H "${hosts%,}" --tag-output \
    /usr/bin/python3 examples/pytorch_digits.py --epochs 2
