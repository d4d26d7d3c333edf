#!/bin/sh
# mpirun.sh HOSTS PROGRAM [ARGUMENT...]: one rank per slot of HOSTS ("node1:4,node2:4" is four
# ranks on each of two hosts), started over ssh by Open MPI's mpirun. kolo finds rank 0 through
# mpirun's PMIx server: no KOLO_ADDR, no port to choose. KOLO_SECRET_FILE, when set, names a file
# that only you can read on a file system every host sees; its name goes to every rank.
set -eu
hosts=$1
shift
exec mpirun --host "$hosts" --bind-to none --map-by slot \
    ${KOLO_SECRET_FILE:+-x KOLO_SECRET_FILE} "$@"
