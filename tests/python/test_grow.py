"""Communicator.invite and Communicator.grow (kolo_comm_invite, kolo_comm_grow): two ranks under
kolorun grow to three with a newcomer that rank 0 starts itself with KOLO_INVITATION, and ranks
that ask for different sizes get MismatchError and keep their communicator. Results are checked
against values computed here."""

import os
import subprocess
import sys

import numpy as np

import ranks

# The newcomer: joins with KOLO_INVITATION (its KOLO_RANK, KOLO_SIZE and KOLO_ADDR, inherited
# from rank 0, are ignored) and takes part in the grown communicator's allreduce.
NEWCOMER = r"""
import numpy as np
import kolo
comm = kolo.Communicator.create()
assert (comm.rank, comm.size) == (2, 3), (comm.rank, comm.size)
got = comm.allreduce(np.arange(5, dtype=np.int64) + comm.rank, op=kolo.SUM)
assert list(got) == [3 * i + 3 for i in range(5)], got
comm.shutdown()
print("newcomer passed")
"""


def rank_grow():
    import kolo
    world = kolo.Communicator.create()
    newcomer = None
    if world.rank == 0:
        invitation = world.invite()
        assert invitation.startswith("kolo-grow-1:"), invitation
        newcomer = subprocess.Popen([sys.executable, "-c", NEWCOMER],
                                    env=dict(os.environ, KOLO_INVITATION=invitation))
    grown = world.grow(3)
    assert (grown.rank, grown.size) == (world.rank, 3), (grown.rank, grown.size)
    got = grown.allreduce(np.arange(5, dtype=np.int64) + grown.rank, op=kolo.SUM)
    assert list(got) == [3 * i + 3 for i in range(5)], got
    try:
        world.allreduce(np.array([1], np.int64), op=kolo.SUM)
    except kolo.CancelledError as error:
        assert "grew to 3 ranks" in str(error), error
    else:
        raise AssertionError("the old communicator still ran an allreduce after grow")
    grown.shutdown()
    world.shutdown()
    if newcomer is not None:
        assert newcomer.wait(timeout=60) == 0


def rank_grow_mismatch():
    import kolo
    world = kolo.Communicator.create()
    if world.rank == 0:
        world.invite()
    else:
        try:
            world.invite()
        except kolo.InvalidArgumentError as error:
            assert "only rank 0" in str(error), error
        else:
            raise AssertionError("invite() worked on rank 1")
    try:
        world.grow(3 + world.rank)
    except kolo.MismatchError as error:
        assert "rank 0 asked for 3 ranks, rank 1 for 4" in str(error), error
    else:
        raise AssertionError("grow with different sizes succeeded")
    got = world.allreduce(np.array([world.rank + 1], np.int64), op=kolo.SUM)
    assert got[0] == 3, got
    world.shutdown()


def test_grow_with_a_newcomer():
    ranks.run(2, __file__, "rank_grow")


def test_grow_with_different_sizes():
    ranks.run(2, __file__, "rank_grow_mismatch")
