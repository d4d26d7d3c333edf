#!/bin/sh
#SBATCH --job-name=kolo-digits
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:10:00
#SBATCH --output=kolo-digits-%j.out
# Submit from the kolo checkout (sbatch runs this in the folder it was submitted from):
#   sbatch examples/several-hosts/slurm-job.sh
# srun starts one rank per task on every node; each finds rank 0's store on the step's first
# node, at a port made from the job and step ids, so no address is set here.
set -eu
# A job secret that only you can read, on the file system that every node shares.
umask 077
secret=$HOME/.kolo-secret-$SLURM_JOB_ID
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$secret"
trap 'rm -f "$secret"' EXIT
export KOLO_SECRET_FILE="$secret"
export PYTHONPATH="$PWD/python" KOLO_LIBRARY="$PWD/build/capi/libkolo.so"
# The network first: an allreduce that checks its results, then the training.
srun build/bench/all_reduce_perf -b 1K -e 4M -f 4 -c 1
srun python3 examples/pytorch_digits.py --epochs 2
