#!/bin/sh
# Installs, from Debian's archive, whatever kolo needs to build, test and benchmark that this
# machine lacks. Safe to run again: it asks apt only for missing packages.
set -eu
packages="meson ninja-build g++ pkg-config python3 libfmt-dev libcli11-dev libsodium-dev \
libhwloc-dev libucx-dev catch2 openmpi-bin libopenmpi-dev iproute2 procps"
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
