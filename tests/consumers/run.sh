#!/bin/sh
# Installs kolo into a scratch DESTDIR and builds tests/consumers/consumer.c against that install
# twice, as projects outside kolo would: with CMake (find_package(kolo), kolo::kolo) and with
# pkg-config; runs each under the installed kolorun with two ranks. A find_package request for a
# version the install does not satisfy must fail. Then the C++ example (examples/cpp/, kolo.hpp)
# the same two ways, each with its own build files: its CMakeLists.txt, and its meson.build as a
# standalone Meson project that finds kolo.pc.
# Usage: run.sh BUILD_DIR [CMAKE]
set -eu
build=$(cd "$1" && pwd)
cmake=${2:-cmake}
here=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

meson install -C "$build" --destdir "$scratch/root" --no-rebuild --quiet
config=$(find "$scratch/root" -name koloConfig.cmake)
pc_file=$(find "$scratch/root" -name kolo.pc)
kolorun=$(find "$scratch/root" -path '*/bin/kolorun')
hpp=$(find "$scratch/root" -path '*/kolo/kolo.hpp')
[ -n "$config" ] && [ -n "$pc_file" ] && [ -n "$kolorun" ] && [ -n "$hpp" ] || {
  echo "FAIL: the install lacks koloConfig.cmake, kolo.pc, kolorun or kolo.hpp: $(find "$scratch/root" -type f)"
  exit 1
}
prefix=$(sed -n 's/^prefix=//p' "$pc_file")
libdir=$(dirname "$(dirname "$pc_file")")

run_two_ranks() {  # program label
  output=$(LD_LIBRARY_PATH="$libdir" "$kolorun" -np 2 "$1" 2>&1) || {
    echo "FAIL: $2 consumer under kolorun -np 2:"; echo "$output"; exit 1
  }
  echo "$output"
  count=$(echo "$output" | grep -c ': ok$' || true)
  [ "$count" = 2 ] || { echo "FAIL: $2 consumer: expected 2 ranks reporting ok, got $count"; exit 1; }
}

echo "== CMake: find_package(kolo 0.2) from $scratch/root$prefix"
# Ninja, which kolo's own build installs, rather than CMake's default of make.
"$cmake" -G Ninja -S "$here/cmake" -B "$scratch/cmake" -DCMAKE_PREFIX_PATH="$scratch/root$prefix" >"$scratch/cmake.log" 2>&1 ||
  { cat "$scratch/cmake.log"; echo "FAIL: cmake could not configure the consumer"; exit 1; }
"$cmake" --build "$scratch/cmake" >>"$scratch/cmake.log" 2>&1 ||
  { cat "$scratch/cmake.log"; echo "FAIL: the CMake consumer did not build"; exit 1; }
run_two_ranks "$scratch/cmake/consumer" CMake

echo "== CMake: find_package(kolo 1.0) must be refused"
if "$cmake" -G Ninja -S "$here/cmake" -B "$scratch/cmake-wrong" -DCMAKE_PREFIX_PATH="$scratch/root$prefix" \
     -DKOLO_WANT_VERSION=1.0 >"$scratch/wrong.log" 2>&1; then
  echo "FAIL: find_package(kolo 1.0) succeeded against kolo $(sed -n 's/^Version: //p' "$pc_file")"
  exit 1
fi
grep -q "version: $(sed -n 's/^Version: //p' "$pc_file")" "$scratch/wrong.log" || { cat "$scratch/wrong.log"; echo "FAIL: no version message"; exit 1; }
echo "refused, as it should be"

echo "== pkg-config: cc consumer.c \$(pkg-config --cflags --libs kolo)"
flags=$(PKG_CONFIG_PATH="$(dirname "$pc_file")" PKG_CONFIG_SYSROOT_DIR="$scratch/root" \
  pkg-config --cflags --libs kolo)
cc -std=c11 -Wall -Werror "$here/consumer.c" $flags -o "$scratch/pkgconfig-consumer"
run_two_ranks "$scratch/pkgconfig-consumer" pkg-config

example=$(cd "$here/../../examples/cpp" && pwd)
echo "== the C++ example with CMake: $example/CMakeLists.txt"
"$cmake" -G Ninja -S "$example" -B "$scratch/cpp-cmake" -DCMAKE_PREFIX_PATH="$scratch/root$prefix" \
  >"$scratch/cpp-cmake.log" 2>&1 && "$cmake" --build "$scratch/cpp-cmake" >>"$scratch/cpp-cmake.log" 2>&1 ||
  { cat "$scratch/cpp-cmake.log"; echo "FAIL: the C++ example did not build with CMake"; exit 1; }
run_two_ranks "$scratch/cpp-cmake/allreduce_broadcast" "C++ example (CMake)"

echo "== the C++ example with Meson: $example/meson.build"
PKG_CONFIG_PATH="$(dirname "$pc_file")" PKG_CONFIG_SYSROOT_DIR="$scratch/root" \
  meson setup "$scratch/cpp-meson" "$example" >"$scratch/cpp-meson.log" 2>&1 &&
  ninja -C "$scratch/cpp-meson" >>"$scratch/cpp-meson.log" 2>&1 ||
  { cat "$scratch/cpp-meson.log"; echo "FAIL: the C++ example did not build with Meson"; exit 1; }
run_two_ranks "$scratch/cpp-meson/allreduce_broadcast" "C++ example (Meson)"
echo "all consumers passed"
