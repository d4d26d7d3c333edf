"""Every torch.distributed call on the "kolo" backend, on 2, 3 and 4 ranks, each checked against
a value computed independently on every rank: reduce, reduce_scatter_tensor, all_to_all(_single),
gather, scatter, int16, sub-groups made by new_group and new_subgroups (kolo_comm_split),
point to point that cannot deadlock (an isend/irecv ring, batch_isend_irecv, tags out of order),
the timeout of init_process_group, and asynchronous works."""

import time

import pytest

import ranks


def _init(timeout_s=60):
    """init_process_group("kolo") under kolorun: rank 0 opens torch's store on a port the
    kernel picks and tells the others through a kolo communicator of its own."""
    from datetime import timedelta

    import numpy as np
    import torch.distributed as dist
    import kolo
    import kolo.torch  # noqa: F401  registers "kolo"
    world = kolo.init()
    store = dist.TCPStore("127.0.0.1", 0, world.size, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False) if world.rank == 0 else None
    port = world.broadcast(np.array([store.port if store else 0], np.int64), root=0)[0]
    if store is None:
        store = dist.TCPStore("127.0.0.1", int(port), world.size, False,
                              timeout=timedelta(seconds=60))
    dist.init_process_group("kolo", store=store, rank=world.rank, world_size=world.size,
                            timeout=timedelta(seconds=timeout_s))
    return dist


# ---- failures at wait() ----------------------------------------------------------------------

def rank_async_failure():
    import torch
    import kolo
    dist = _init()
    me = dist.get_rank()
    # the ranks disagree about the root: the operation fails on every rank, and async_op=True
    # returns a Work whose wait() raises, as gloo's does
    work = dist.broadcast(torch.ones(4), src=me, async_op=True)
    assert work.is_completed()
    try:
        work.wait()
    except kolo.MismatchError as error:
        print("wait raised", type(error).__name__, flush=True)
    else:
        raise AssertionError("a broadcast whose ranks named different roots succeeded")
    try:
        work.get_future().wait()
    except kolo.MismatchError:
        pass
    else:
        raise AssertionError("the future of a failed broadcast completed")
    # the synchronous form raises from the call, with the same error
    try:
        dist.broadcast(torch.ones(4), src=me)
    except kolo.MismatchError:
        print("sync raised", flush=True)
    else:
        raise AssertionError("a synchronous broadcast with different roots succeeded")
    # bad arguments raise at the call, before anything is sent
    try:
        dist.all_gather_into_tensor(torch.zeros(3), torch.ones(2), async_op=True)
    except kolo.InvalidArgumentError:
        print("argument error at the call", flush=True)
    else:
        raise AssertionError("a wrong-sized output was accepted")


@pytest.mark.parametrize("n", [2, 3])
def test_a_failed_collective_raises_from_wait(n):
    output = ranks.run(n, __file__, "rank_async_failure", timeout=120)
    assert output.count("wait raised MismatchError") == n, output
    assert output.count("sync raised") == n, output
    assert output.count("argument error at the call") == n, output


# ---- point to point -------------------------------------------------------------------------

def rank_isend_irecv_ring():
    """Each rank isends to the next and irecvs from the previous, then waits for both: the
    pattern that hung forever when isend blocked like send."""
    import torch
    dist = _init(timeout_s=20)
    n, me = dist.get_world_size(), dist.get_rank()
    start = time.monotonic()
    for size in (1, 1000, 300_000):
        out = torch.arange(size, dtype=torch.float32) + 1000 * me
        got = torch.full((size,), -1.0)
        sent = dist.isend(out, (me + 1) % n)
        received = dist.irecv(got, (me - 1) % n)
        sent.wait()
        received.wait()
        assert received.is_completed() and sent.is_completed()
        expected = torch.arange(size, dtype=torch.float32) + 1000 * ((me - 1) % n)
        assert torch.equal(got, expected), (size, got[:4], expected[:4])
    # The other direction, with the receive posted first and blocking calls.
    got = torch.zeros(4, dtype=torch.int64)
    request = dist.irecv(got, (me + 1) % n)
    dist.send(torch.full((4,), me, dtype=torch.int64), (me - 1) % n)
    request.wait()
    assert torch.equal(got, torch.full((4,), (me + 1) % n, dtype=torch.int64)), got
    # batch_isend_irecv: both neighbours at once, sends listed first.
    left, right = (me - 1) % n, (me + 1) % n
    from_left, from_right = torch.zeros(3), torch.zeros(3)
    operations = [dist.P2POp(dist.isend, torch.full((3,), me + 0.5), right),
                  dist.P2POp(dist.isend, torch.full((3,), me + 0.25), left),
                  dist.P2POp(dist.irecv, from_left, left),
                  dist.P2POp(dist.irecv, from_right, right)]
    for request in dist.batch_isend_irecv(operations):
        request.wait()
    # (At N = 2 both neighbours are one rank: its two messages arrive in the order sent.)
    assert torch.equal(from_left, torch.full((3,), left + 0.5)), from_left
    assert torch.equal(from_right, torch.full((3,), right + 0.25)), from_right
    # Tags received in another order than they were sent.
    sends = [dist.isend(torch.full((2,), float(100 * me + tag)), right, tag=tag)
             for tag in (1, 2, 3)]
    for tag in (3, 1, 2):
        got = torch.zeros(2)
        dist.recv(got, left, tag=tag)
        assert torch.equal(got, torch.full((2,), float(100 * left + tag))), (tag, got)
    for request in sends:
        assert request.wait() and request.is_completed()
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("n", [2, 3])
def test_isend_irecv_ring_completes(n):
    output = ranks.run(n, __file__, "rank_isend_irecv_ring", timeout=60)
    assert "FAILED" not in output


# ---- collectives ----------------------------------------------------------------------------

def _values(rank, count, dtype):
    """Rank's input: small integers, exact in every dtype, different on every rank."""
    import torch
    return ((torch.arange(count) * 7 + rank * 3) % 11 - 5).to(dtype)


def rank_collectives():
    import torch
    dist = _init()
    n, me = dist.get_world_size(), dist.get_rank()
    everyone = [_values(r, 12 * n, torch.float64) for r in range(n)]  # references in float64
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int16,
                  torch.int32, torch.int64):
        for op in ops:
            if op == dist.ReduceOp.SUM:
                expected = torch.stack(everyone).sum(0)
            elif op == dist.ReduceOp.MAX:
                expected = torch.stack(everyone).max(0).values
            elif op == dist.ReduceOp.MIN:
                expected = torch.stack(everyone).min(0).values
            else:
                expected = torch.stack(everyone).prod(0)
            for root in range(n):
                t = _values(me, 12 * n, dtype)
                dist.reduce(t, dst=root, op=op)
                want = expected.to(dtype) if me == root else _values(me, 12 * n, dtype)
                assert torch.equal(t, want), ("reduce", dtype, op, root, t, want)
            out = torch.full((12,), -99, dtype=dtype)
            dist.reduce_scatter_tensor(out, _values(me, 12 * n, dtype), op=op)
            assert torch.equal(out, expected[12 * me:12 * (me + 1)].to(dtype)), \
                ("reduce_scatter_tensor", dtype, op, out)
        gathered = torch.zeros(n * 5, dtype=dtype)
        dist.all_gather_into_tensor(gathered, _values(me, 5, dtype))
        assert torch.equal(gathered, torch.cat([_values(r, 5, dtype) for r in range(n)]))
        # all_to_all_single, even: block p of rank r is _values(r)[p-th block].
        out = torch.empty(3 * n, dtype=dtype)
        dist.all_to_all_single(out, _values(me, 3 * n, dtype))
        assert torch.equal(out, torch.cat([_values(r, 3 * n, dtype)[3 * me:3 * me + 3]
                                           for r in range(n)])), ("all_to_all_single", dtype)
        # uneven: rank r sends p + r + 1 rows of 2 to rank p.
        rows = [[p + r + 1 for p in range(n)] for r in range(n)]
        source = _values(me, 2 * sum(rows[me]), dtype).view(-1, 2)
        out = torch.empty(sum(rows[r][me] for r in range(n)), 2, dtype=dtype)
        dist.all_to_all_single(out, source, output_split_sizes=[rows[r][me] for r in range(n)],
                               input_split_sizes=rows[me])
        pieces = []
        for r in range(n):
            theirs = _values(r, 2 * sum(rows[r]), dtype).view(-1, 2)
            start = sum(rows[r][:me])
            pieces.append(theirs[start:start + rows[r][me]])
        assert torch.equal(out, torch.cat(pieces)), ("all_to_all_single uneven", dtype)
        # all_to_all, lists of different sizes: rank r sends p + 1 elements to rank p.
        inputs = [_values(me * 10 + p, p + 1, dtype) for p in range(n)]
        outputs = [torch.empty(me + 1, dtype=dtype) for _ in range(n)]
        dist.all_to_all(outputs, inputs)
        for r in range(n):
            assert torch.equal(outputs[r], _values(r * 10 + me, me + 1, dtype)), ("all_to_all",)
        for root in range(n):
            mine = _values(me, 4, dtype)
            if me == root:
                outs = [torch.empty(4, dtype=dtype) for _ in range(n)]
                dist.gather(mine, outs, dst=root)
                assert all(torch.equal(outs[r], _values(r, 4, dtype)) for r in range(n))
            else:
                dist.gather(mine, dst=root)
            got = torch.empty(3, dtype=dtype)
            dist.scatter(got, [_values(root * 10 + p, 3, dtype) for p in range(n)]
                         if me == root else None, src=root)
            assert torch.equal(got, _values(root * 10 + me, 3, dtype)), ("scatter", got)
    # AVG where torch has it (floats), int16 sums that wrap around.
    t = torch.full((6,), float(me + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.equal(t, torch.full((6,), (n + 1) / 2)), t
    t = torch.full((5,), 30000, dtype=torch.int16)
    dist.all_reduce(t)
    wrapped = (30000 * n + 32768) % 65536 - 32768
    assert torch.equal(t, torch.full((5,), wrapped, dtype=torch.int16)), t
    # Asynchronous works: wait, is_completed, and an error raised where torch raises it.
    t = torch.ones(1000)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() and work.is_completed()
    assert torch.equal(t, torch.full((1000,), float(n)))
    work = dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * n), async_op=True)
    work.wait()
    assert work.is_completed()
    try:
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * n + 1))
    except Exception as error:
        assert "reduce_scatter_tensor" in str(error) and str(4 * n + 1) in str(error), error
    else:
        raise AssertionError("a wrong-sized reduce_scatter_tensor input was accepted")
    dist.barrier()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives(n):
    ranks.run(n, __file__, "rank_collectives", timeout=180)


# ---- sub-groups -----------------------------------------------------------------------------

def rank_subgroups():
    import torch
    dist = _init()
    n, me = dist.get_world_size(), dist.get_rank()
    evens = [r for r in range(n) if r % 2 == 0]
    group = dist.new_group(evens)
    assert (group == dist.GroupMember.NON_GROUP_MEMBER) == (me not in evens)
    # What new_subgroups(2) does (torch 1.13 allows it only with CUDA): one new_group per half,
    # made by every rank in the same order.
    halves = None
    for first in range(0, n, 2):
        made = dist.new_group([first, first + 1])
        if me in (first, first + 1):
            halves = made
    for step in range(3):  # the world, a sub-group and the halves, interleaved
        t = torch.full((7,), float(me + step))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((7,), float(sum(range(n)) + n * step)))
        if me in evens:
            t = torch.full((7,), float(me))
            dist.all_reduce(t, group=group)
            assert torch.equal(t, torch.full((7,), float(sum(evens)))), t
            out = [torch.zeros(2) for _ in evens]
            dist.all_gather(out, torch.full((2,), float(me)), group=group)
            assert [o[0].item() for o in out] == [float(r) for r in evens]
        mates = [me - me % 2, me - me % 2 + 1]
        t = torch.full((3,), float(me * me))
        dist.all_reduce(t, group=halves)
        assert torch.equal(t, torch.full((3,), float(sum(r * r for r in mates)))), t
        # point to point inside the halves, with global ranks as torch takes them
        other = mates[1] if me == mates[0] else mates[0]
        got = torch.zeros(2)
        request = dist.irecv(got, other, group=halves)
        dist.isend(torch.full((2,), float(me)), other, group=halves).wait()
        request.wait()
        assert torch.equal(got, torch.full((2,), float(other)))
    dist.barrier()


@pytest.mark.parametrize("n", [2, 4])
def test_subgroups(n):
    ranks.run(n, __file__, "rank_subgroups", timeout=120)


# ---- timeouts -------------------------------------------------------------------------------

def rank_p2p_timeout():
    import torch
    import kolo
    dist = _init(timeout_s=3)
    if dist.get_rank() == 0:
        start = time.monotonic()
        work = dist.isend(torch.ones(4), 1)
        try:
            work.wait()
        except kolo.KoloTimeoutError as error:
            took = time.monotonic() - start
            assert 2 < took < 20, took
            assert "rank 1" in str(error), error
            print("timed out as expected:", error, flush=True)
        else:
            raise AssertionError("a send that nobody receives completed")
        # A collective that rank 1 never joins: bounded by the same timeout.
        start = time.monotonic()
        try:
            dist.reduce(torch.ones(3), dst=0)
        except kolo.KoloTimeoutError as error:
            took = time.monotonic() - start
            assert 2 < took < 15, took
            print("collective timed out as expected:", error, flush=True)
        else:
            raise AssertionError("a reduce that rank 1 never joined completed")
    else:
        time.sleep(25)


def test_p2p_and_collective_timeout():
    output = ranks.run(2, __file__, "rank_p2p_timeout", timeout=60)
    assert "timed out as expected" in output
    assert "collective timed out as expected" in output
