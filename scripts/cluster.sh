#!/bin/sh
# A simulated cluster on one machine: H "hosts", each a network namespace with a host name of its
# own (a UTS namespace per command), joined through veth links to a bridge that lives in a
# namespace of its own, every link shaped by tc tbf to a rate you choose in both directions.
# Addresses come from a private range used only inside these namespaces; the names resolve through
# a hosts file that each command sees over /etc/hosts (a private mount namespace), never the
# machine's; each host's own name maps to 127.0.1.1 there, as on a Debian machine. Nothing is
# added to the machine's own network namespace.
#
#   cluster.sh up NAME HOSTS [RATE]    makes hosts NAME1..NAMEH (RATE: e.g. 1gbit; none = unshaped)
#   cluster.sh exec NAME H CMD [ARG…]  runs CMD on host H (1-based) as host name NAMEH
#   cluster.sh addr NAME H             prints host H's IPv4 and IPv6 addresses
#   cluster.sh cut NAME H              takes host H's link down (the host vanishes from the network)
#   cluster.sh down NAME               kills every process on the hosts and removes everything
#
# Needs root and `ip netns`. `up` first removes what an earlier cluster of the same NAME left.
# CLUSTER_SUBNET (default 10.77.0) is the /24 the hosts get addresses in: .1, .2, …; they
# also get IPv6 addresses CLUSTER_SUBNET6::1, ::2, … (default fd77, a unique local prefix).
set -eu

usage() {
  sed -n '10,14p' "$0" >&2
  exit 2
}

[ $# -ge 2 ] || usage
command=$1
name=$2
shift 2
case "$name" in
  *[!a-z0-9]* | "") echo "cluster.sh: NAME must be lower-case letters and digits: '$name'" >&2; exit 2 ;;
esac
subnet=${CLUSTER_SUBNET:-10.77.0}
subnet6=${CLUSTER_SUBNET6:-fd77}
state=/run/kolo-cluster/$name
switch=$name-switch

host_namespace() { echo "$name$1"; }

down() {
  [ -f "$state/hosts-count" ] || { ip netns del "$switch" 2>/dev/null || true; return 0; }
  count=$(cat "$state/hosts-count")
  for host in $(seq 1 "$count"); do
    namespace=$(host_namespace "$host")
    pids=$(ip netns pids "$namespace" 2>/dev/null || true)
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    ip netns del "$namespace" 2>/dev/null || true
  done
  ip netns del "$switch" 2>/dev/null || true
  rm -rf "$state"
}

shape() {  # namespace device rate
  [ "$3" = none ] && return 0
  tc -n "$1" qdisc add dev "$2" root tbf rate "$3" burst 512kb latency 100ms
}

up() {
  hosts=$1
  rate=${2:-none}
  case "$hosts" in *[!0-9]* | "" | 0) echo "cluster.sh: HOSTS must be 1..200: '$hosts'" >&2; exit 2 ;; esac
  [ "$hosts" -le 200 ] || { echo "cluster.sh: HOSTS must be 1..200: '$hosts'" >&2; exit 2; }
  down
  mkdir -p "$state"
  echo "$hosts" >"$state/hosts-count"
  ip netns add "$switch"
  ip -n "$switch" link add br0 type bridge
  ip -n "$switch" link set br0 up
  for host in $(seq 1 "$hosts"); do
    namespace=$(host_namespace "$host")
    ip netns add "$namespace"
    ip -n "$namespace" link set lo up
    ip -n "$namespace" link add eth0 type veth peer name "port$host" netns "$switch"
    ip -n "$namespace" addr add "$subnet.$host/24" dev eth0
    ip -n "$namespace" -6 addr add "$subnet6::$host/64" dev eth0 nodad
    ip -n "$namespace" link set eth0 up
    ip -n "$switch" link set "port$host" master br0
    ip -n "$switch" link set "port$host" up
    shape "$namespace" eth0 "$rate"       # what the host sends
    shape "$switch" "port$host" "$rate"   # what the host receives
  done
  # Each host's own name maps to 127.0.1.1 in its hosts file, as Debian's installer writes it, so
  # that a host name in KOLO_ADDR resolves to loopback on rank 0's host and to its address elsewhere.
  for host in $(seq 1 "$hosts"); do
    {
      printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n' "$(host_namespace "$host")"
      for other in $(seq 1 "$hosts"); do
        [ "$other" = "$host" ] || printf '%s\t%s\n' "$subnet.$other" "$(host_namespace "$other")"
      done
    } >"$state/hosts.$host"
  done
}

case "$command" in
  up) [ $# -ge 1 ] || usage; up "$@" ;;
  down) down ;;
  addr) [ $# -eq 1 ] || usage; echo "$subnet.$1 $subnet6::$1" ;;
  cut) [ $# -eq 1 ] || usage; ip -n "$switch" link set "port$1" down ;;
  exec)
    [ $# -ge 2 ] || usage
    host=$1
    shift
    [ -f "$state/hosts.$host" ] || { echo "cluster.sh: no cluster '$name' (run: cluster.sh up $name HOSTS)" >&2; exit 2; }
    namespace=$(host_namespace "$host")
    exec ip netns exec "$namespace" unshare --uts --mount sh -c \
      'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
      sh "$state/hosts.$host" "$namespace" "$@"
    ;;
  *) usage ;;
esac
