#!/bin/sh
# kolorun --elastic across hosts: Horovod's elastic MNIST example on the hosts that HOSTS_FILE
# names, one "host:slots" a line. Edit the file while the job runs: a host added gets ranks (up to
# --max-np), a host removed loses its ranks at their next commit. Run it on a host that reaches
# the others with ssh keys alone; every host sees this checkout at the same path.
# From the checkout's root:  sh examples/several-hosts/kolorun-elastic.sh hosts.txt
set -eu
[ $# -eq 1 ] || { echo "usage: $0 HOSTS_FILE" >&2; exit 2; }
hosts=$(realpath "$1")          # the discovery script runs in kolorun's directory
export PYTHONPATH=$PWD/python   # kolo's Python package; kolorun forwards PYTHONPATH
build/src/kolorun --elastic -np 2 --min-np 2 --max-np 8 --host-discovery-script "cat '$hosts'" \
    /usr/bin/python3 examples/horovod/pytorch_mnist_elastic.py --epochs 12
