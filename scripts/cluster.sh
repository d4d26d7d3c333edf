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
#   cluster.sh sshd NAME               starts an sshd on every host (see below)
#   cluster.sh down NAME               kills every process on the hosts and removes everything
#
# `sshd` makes a host key and a user key for this cluster only and starts OpenSSH's sshd on port 22
# of every host. From then on every command run with `exec` sees, over the caller's ~/.ssh (again
# a private mount), a folder holding that key, the hosts' keys as known hosts and a config, so that
# `ssh NAME2 cmd`, mpirun and kolorun -H reach the other hosts as root with nothing else set, as
# on a cluster whose nodes trust each other's keys. The machine's own ~/.ssh is never changed.
#
# Needs root and `ip netns`. `up` first removes what an earlier cluster of the same NAME left.
# CLUSTER_SUBNET (default 10.77.0) is the /24 the hosts get addresses in: .1, .2, …; they
# also get IPv6 addresses CLUSTER_SUBNET6::1, ::2, … (default fd77, a unique local prefix).
set -eu

usage() {
  sed -n '10,15p' "$0" >&2
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

# Keys, known hosts and client config in $state/ssh/home (mounted over ~/.ssh by `exec`); an sshd
# per host, started inside the host by `exec`, so that what it runs sees the host's name and files.
start_sshd() {
  [ -f "$state/hosts-count" ] || { echo "cluster.sh: no cluster '$name' (run: cluster.sh up $name HOSTS)" >&2; exit 2; }
  count=$(cat "$state/hosts-count")
  dir=$state/ssh
  rm -rf "$dir"
  mkdir -p -m 700 "$dir" "$dir/home"
  ssh-keygen -q -t ed25519 -N '' -C "$name-host" -f "$dir/host_key"
  ssh-keygen -q -t ed25519 -N '' -C "$name-user" -f "$dir/home/id_ed25519"
  cp "$dir/home/id_ed25519.pub" "$dir/home/authorized_keys"
  for host in $(seq 1 "$count"); do
    printf '%s,%s.%s %s\n' "$(host_namespace "$host")" "$subnet" "$host" "$(cat "$dir/host_key.pub")"
  done >"$dir/home/known_hosts"
  printf 'Host *\n  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n' >"$dir/home/config"
  cat >"$dir/sshd_config" <<EOF
Port 22
HostKey $dir/host_key
AuthorizedKeysFile $dir/home/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
MaxStartups 100:30:200
MaxSessions 100
EOF
  mkdir -p /run/sshd
  for host in $(seq 1 "$count"); do
    sh "$0" exec "$name" "$host" /usr/sbin/sshd -f "$dir/sshd_config" -o "PidFile=$dir/sshd.$host.pid"
  done
  for host in $(seq 1 "$count"); do  # sshd forks once it listens; its pid file says so
    tries=0
    until [ -s "$dir/sshd.$host.pid" ]; do
      tries=$((tries + 1))
      [ "$tries" -le 50 ] || { echo "cluster.sh: sshd on host $host did not start" >&2; exit 1; }
      sleep 0.1
    done
  done
}

case "$command" in
  up) [ $# -ge 1 ] || usage; up "$@" ;;
  sshd) start_sshd ;;
  down) down ;;
  addr) [ $# -eq 1 ] || usage; echo "$subnet.$1 $subnet6::$1" ;;
  cut) [ $# -eq 1 ] || usage; ip -n "$switch" link set "port$1" down ;;
  exec)
    [ $# -ge 2 ] || usage
    host=$1
    shift
    [ -f "$state/hosts.$host" ] || { echo "cluster.sh: no cluster '$name' (run: cluster.sh up $name HOSTS)" >&2; exit 2; }
    namespace=$(host_namespace "$host")
    ssh_home=""
    if [ -d "$state/ssh/home" ]; then
      ssh_home=$(getent passwd "$(id -u)" | cut -d: -f6)/.ssh
      [ -d "$ssh_home" ] || mkdir -m 700 "$ssh_home"
    fi
    exec ip netns exec "$namespace" unshare --uts --mount sh -c \
      'mount --bind "$1" /etc/hosts && hostname "$2" &&
       { [ -z "$4" ] || mount --bind "$3" "$4"; } && shift 4 && exec "$@"' \
      sh "$state/hosts.$host" "$namespace" "$state/ssh/home" "$ssh_home" "$@"
    ;;
  *) usage ;;
esac
