#!/bin/sh
# Runs the C11 ABI test as 3 ranks under kolorun: $1 is the test program, $2 kolorun.
set -eu
exec "$2" -np 3 "$1"
