#!/bin/sh
# Proves the README's two commands on a really fresh Debian 12: builds a minimal root with
# debootstrap, copies a clean clone of this checkout's HEAD into it, and runs `sh scripts/bench.sh`
# and `sh scripts/test.sh` there under chroot, then prints the last line of each.
#
#   sh scripts/fresh-machine.sh [ROOT]        as root; ROOT defaults to /var/tmp/kolo-fresh
#
# Slow (the root, every package, a full build and the whole suite: tens of minutes) and not part of
# CI; run it whenever the dependencies change. The mounts live in a private mount namespace
# (unshare), so they vanish with it whatever happens, and a trap unmounts them on any exit as well.
# The root gets the /etc/hosts a Debian installer writes (debootstrap writes none).
# The root is deleted at the end unless KEEP_ROOT=1; the logs stay in ROOT.logs/.
set -eu
cd "$(dirname "$0")/.."
source_dir=$(pwd)
root=${1:-/var/tmp/kolo-fresh}
mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null |
  head -n 1)}
mirror=${mirror:-http://deb.debian.org/debian}

if [ "$(id -u)" != 0 ]; then
  echo "fresh-machine.sh: needs root (debootstrap, mount, chroot)" >&2
  exit 2
fi

if [ "${KOLO_FRESH_INSIDE:-}" != 1 ]; then
  command -v debootstrap >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  if [ -e "$root" ] || [ -e "$root.logs" ]; then
    echo "fresh-machine.sh: $root exists; or $root.logs exists; remove them or name another folder" >&2
    exit 2
  fi
  echo "== debootstrap bookworm into $root from $mirror"
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.debootstrap.log" 2>&1 || {
    tail -n 20 "$root.debootstrap.log" >&2
    exit 1
  }
  git clone -q "$source_dir" "$root/root/kolo"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  # What Debian's installer writes and debootstrap does not: the machine's own name resolves.
  printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' \
    "$(hostname)" >"$root/etc/hosts"
  status=0
  KOLO_FRESH_INSIDE=1 unshare --mount --propagation private sh "$0" "$root" || status=$?
  mkdir -p "$root.logs"
  cp "$root/root/bench.log" "$root/root/test.log" "$root.logs/" 2>/dev/null || true
  mv "$root.debootstrap.log" "$root.logs/debootstrap.log"
  echo "logs in $root.logs/"
  # The mounts were made in the private namespace only; never delete through a live mount.
  if [ "${KEEP_ROOT:-0}" != 1 ] && ! grep -q " $root/" /proc/self/mounts; then
    rm -rf "$root"
  fi
  exit $status
fi

# Inside the private mount namespace.
cleanup() {
  for mount_point in dev/shm dev sys proc ""; do
    umount -l "$root/$mount_point" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP
# The root a mount point of its own, as / is on a machine: `ip netns` (the cluster tests) needs it.
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount -t sysfs sysfs "$root/sys"
mount --bind /dev "$root/dev"
mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"

run_in_root() {
  chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    sh -c "cd /root/kolo && $1"
}
echo "== sh scripts/bench.sh (log: $root/root/bench.log)"
bench_status=0
started=$(date +%s)
run_in_root "sh scripts/bench.sh" >"$root/root/bench.log" 2>&1 || bench_status=$?
bench_seconds=$(($(date +%s) - started))
echo "== sh scripts/test.sh (log: $root/root/test.log)"
test_status=0
started=$(date +%s)
run_in_root "sh scripts/test.sh" >"$root/root/test.log" 2>&1 || test_status=$?
test_seconds=$(($(date +%s) - started))

echo "bench.sh exit $bench_status after $bench_seconds s, last lines:"
tail -n 3 "$root/root/bench.log"
echo "test.sh exit $test_status after $test_seconds s, last line: $(tail -n 1 "$root/root/test.log")"
[ "$bench_status" = 0 ] && [ "$test_status" = 0 ]
