"""What tests/test_mpirun.cpp runs under mpirun, one process per rank, with nothing of kolo's set:
the world communicator starts through PMIx alone. Every result is checked against a value
computed here; each scenario prints "rank R: SCENARIO checks passed" at the end.

  startup   no store listens after start-up (this process's listening TCP sockets, from
            /proc/net/tcp, are the lifeline's only: one); then an allreduce, a named allreduce
            (the fusion engine) and a split work, and from then on world rank 0's process serves
            the store (one more listening socket there, none elsewhere)
  shrink    the last rank leaves; the survivors see the loss and shrink (they meet at the
            lifeline, no store needed), and the shrunk communicator computes right
  grow      rank 0 invites a newcomer it starts itself (KOLO_INVITATION), every rank grows to
            size + 1, and the grown communicator computes right
"""

import os
import subprocess
import sys

import numpy as np

import kolo


def listening_sockets():
    """The TCP sockets this process listens on (state 0A in /proc/net/tcp and tcp6)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def check_allreduce(comm, what):
    got = comm.allreduce(np.arange(7, dtype=np.int64) + comm.rank, op=kolo.SUM)
    expected = [comm.size * i + comm.size * (comm.size - 1) // 2 for i in range(7)]
    assert list(got) == expected, (what, list(got), expected)


def startup():
    world = kolo.init()
    at_start = listening_sockets()
    print(f"rank {world.rank}: {len(at_start)} listening socket(s) after start-up", flush=True)
    assert len(at_start) == 1, at_start  # the lifeline's
    check_allreduce(world, "world")
    named = world.allreduce_async(np.full(3, world.rank + 1, np.float32), name="pmix.named")
    got = named.wait()
    assert list(got) == [world.size * (world.size + 1) / 2] * 3, list(got)
    half = world.split(world.rank % 2)
    check_allreduce(half, "split")
    later = listening_sockets()
    print(f"rank {world.rank}: {len(later)} listening socket(s) after a split and the fusion "
          f"engine", flush=True)
    # The store now serves on world rank 0's process, and the split's lifeline listens on every
    # rank.
    assert len(later) == len(at_start) + 1 + (1 if world.rank == 0 else 0), (at_start, later)
    half.shutdown()
    world.shutdown()
    return world.rank


def shrink():
    world = kolo.init()
    check_allreduce(world, "world")
    if world.rank == world.size - 1:
        print(f"rank {world.rank}: shrink checks passed (leaving)", flush=True)
        # A plain exit: PMIx_Finalize runs (atexit), so that mpirun does not end the job.
        sys.exit(0)
    try:
        while True:
            world.allreduce(np.ones(1, np.int64), op=kolo.SUM)
    except (kolo.PeerLostError, kolo.CancelledError, kolo.KoloTimeoutError) as error:
        print(f"rank {world.rank}: the world failed: {error}", flush=True)
    survivors = world.shrink()
    assert (survivors.rank, survivors.size) == (world.rank, world.size - 1), (
        survivors.rank, survivors.size)
    check_allreduce(survivors, "shrunk")
    survivors.shutdown()
    world.shutdown()
    return world.rank


NEWCOMER = r"""
import numpy as np
import kolo
comm = kolo.Communicator.create()
got = comm.allreduce(np.arange(7, dtype=np.int64) + comm.rank, op=kolo.SUM)
assert list(got) == [comm.size * i + comm.size * (comm.size - 1) // 2 for i in range(7)], got
comm.shutdown()
print("newcomer passed", flush=True)
"""


def grow():
    world = kolo.init()
    newcomer = None
    if world.rank == 0:
        invitation = world.invite()
        newcomer = subprocess.Popen([sys.executable, "-c", NEWCOMER],
                                    env=dict(os.environ, KOLO_INVITATION=invitation))
    grown = world.grow(world.size + 1)
    assert (grown.rank, grown.size) == (world.rank, world.size + 1), (grown.rank, grown.size)
    check_allreduce(grown, "grown")
    grown.shutdown()
    world.shutdown()
    if newcomer is not None:
        assert newcomer.wait(timeout=60) == 0
    return world.rank


if __name__ == "__main__":
    scenario = sys.argv[1]
    rank = {"startup": startup, "shrink": shrink, "grow": grow}[scenario]()
    print(f"rank {rank}: {scenario} checks passed", flush=True)
