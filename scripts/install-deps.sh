#!/bin/sh
# Installs, from Debian's archive, whatever kolo needs to build, test and benchmark that this
# machine lacks. Safe to run again: it asks apt only for missing packages.
# `sh scripts/install-deps.sh --list` prints the packages, one a line, and installs nothing
# (tests/check_install_deps.py compares it with what the Meson files require).
set -eu
# Build: compilers, Meson, and the libraries that meson.build requires.
packages="meson ninja-build g++ pkg-config libfmt-dev libcli11-dev libsodium-dev libhwloc-dev \
libucx-dev"
# The PMIx rendezvous under mpirun and srun --mpi=pmix (src/bootstrap/pmix.hpp; -Dpmix=auto).
packages="$packages libpmix-dev"
# Tests: Catch2, the timeline parser, CMake for the find_package(kolo) consumer, the tools that
# multi-process tests call, and Python with numpy, torch and pytest for the Python package.
packages="$packages catch2 nlohmann-json3-dev cmake iproute2 procps python3 python3-numpy \
python3-torch python3-pytest python3-sklearn"
# pip install . (pyproject.toml's meson-python backend) into a venv with pip, as
# tests/python/check_pip_install.py does.
packages="$packages python3-mesonpy python3-venv python3-pip"
# Fuzzing (tests/fuzz/run.sh): clang and the libFuzzer runtime that -fsanitize=fuzzer links.
packages="$packages clang-14 libclang-rt-14-dev"
# The simulated cluster's sshd (scripts/cluster.sh sshd), for tests that start ranks over ssh.
packages="$packages openssh-server"
# Benchmarks: Open MPI beside kolo in bench/compare_mpi.sh.
packages="$packages openmpi-bin libopenmpi-dev"
# The main job's plot (scripts/bench.sh draws build/main-job/main_job.png with gnuplot's png).
packages="$packages gnuplot-nox"
# Slurm on the simulated cluster (scripts/slurm.sh, tests/test_slurm.cpp): its controller, node
# daemon, commands (srun, sbatch, squeue) and the munge daemon that signs their credentials.
packages="$packages slurmctld slurmd slurm-client munge"

if [ "${1:-}" = "--list" ]; then
  printf '%s\n' $packages
  exit 0
fi
missing=""
for package in $packages; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing="$missing $package"
done
if [ -n "$missing" ]; then
  echo "installing:$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
