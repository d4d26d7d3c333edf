#!/bin/sh
# Configures (once) and builds kolo in ./build with Meson and Ninja.
set -eu
cd "$(dirname "$0")/.."
if [ ! -f build/build.ninja ]; then
  meson setup build "$@"
fi
ninja -C build
