"""A TCP port that was free a moment ago, for a rendezvous store bound a little later.

Picked at random below the kernel's ephemeral range, as kolorun does (src/tools/free_port.hpp):
inside that range any outgoing connection, and any listener bound to port 0 (another job's), may
take the port before the store binds it; at random, so that jobs started together differ."""
import random
import socket

_LOWEST = 10000


def _bind(host, port):
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return None
        return probe.getsockname()[1]


def free_port(host=""):
    """A port free on `host` ("" for every interface) a moment ago."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral_low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    if ephemeral_low > _LOWEST + 1000:
        for _ in range(100):
            port = _bind(host, random.randrange(_LOWEST, ephemeral_low))
            if port is not None:
                return port
    port = _bind(host, 0)
    if port is None:
        raise OSError(f"cannot bind a TCP port on {host or 'any interface'}")
    return port
