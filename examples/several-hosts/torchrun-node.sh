#!/bin/sh
# One node's share of a kolo job under torchrun: run it on every node, with the same settings.
#   NNODES            how many nodes take part (torchrun waits until all of them have joined)
#   NPROC_PER_NODE    ranks on each node (default 2)
#   RDZV_HOST         the node that serves torchrun's rendezvous (any one of them)
#   RDZV_PORT         its port (default 29400)
#   JOB_ID            a name for this job, the same on every node (default kolo)
#   KOLO_SECRET_FILE  the job secret: a file on the shared file system, readable by you only
# The arguments are the program and its own: a Python script, or --no_python and a program.
set -eu
: "${NNODES:?set NNODES to the number of nodes}"
: "${RDZV_HOST:?set RDZV_HOST to the node that serves the rendezvous}"
: "${KOLO_SECRET_FILE:?set KOLO_SECRET_FILE to the job secret file}"
exec torchrun --nnodes "$NNODES" --nproc_per_node "${NPROC_PER_NODE:-2}" \
  --rdzv_backend c10d --rdzv_endpoint "$RDZV_HOST:${RDZV_PORT:-29400}" \
  --rdzv_id "${JOB_ID:-kolo}" --redirects 1 --tee 1 "$@"
