"""kolo's numpy API on 1, 2 and 4 ranks: every collective and dtype against numpy references, in
place and out of place, named asynchronous operations, sub-communicators, errors."""

import subprocess

import numpy as np
import pytest

import ranks
from reference import DTYPES, OPS, rank_input, reduce

SIZES = [0, 1, 7, 300_007]


def _dtype_arg(dtype):
    return "bfloat16" if dtype == "bfloat16" else None


def _equal(got, expected, what):
    if got.dtype != expected.dtype or got.shape != expected.shape or \
            not np.array_equal(got, expected):
        bad = np.flatnonzero(got.reshape(-1) != expected.reshape(-1))[:5] \
            if got.shape == expected.shape else []
        raise AssertionError(f"{what}: expected {expected.dtype}{expected.shape}, got "
                             f"{got.dtype}{got.shape}; first differing elements {list(bad)}: "
                             f"got {got.reshape(-1)[bad]}, expected {expected.reshape(-1)[bad]}")


def rank_allreduce():
    import kolo
    kolo.init()
    n, me = kolo.size(), kolo.rank()
    ops = {"sum": kolo.SUM, "avg": kolo.AVG, "min": kolo.MIN, "max": kolo.MAX,
           "prod": kolo.PROD}
    for dtype in DTYPES:
        for count in SIZES:
            inputs = [rank_input(r, count, dtype) for r in range(n)]
            for op in OPS:
                expected = reduce(inputs, op, dtype)
                what = f"allreduce {dtype} {op} count {count}"
                mine = inputs[me].copy()
                got = kolo.allreduce(mine, op=ops[op], dtype=_dtype_arg(dtype))
                _equal(got, expected, what + " out of place")
                _equal(mine, inputs[me], what + ": the input was written")
                result = kolo.allreduce_(mine, op=ops[op], dtype=_dtype_arg(dtype))
                assert result is mine
                _equal(mine, expected, what + " in place")
    # Scale factors: (sum of x * 2) * 0.5 == sum of x, exactly for these small integers.
    x = rank_input(me, 1000, "float32")
    got = kolo.allreduce(x.reshape(10, 100), op=kolo.SUM, prescale=2.0, postscale=0.25)
    expected = reduce([rank_input(r, 1000, "float32") for r in range(n)], "sum", "float32") / 2
    _equal(got, expected.reshape(10, 100), "allreduce scaled")
    kolo.shutdown()


def rank_other_collectives():
    import kolo
    kolo.init()
    n, me = kolo.size(), kolo.rank()
    for dtype in DTYPES:
        dt = _dtype_arg(dtype)
        for count in SIZES:
            inputs = [rank_input(r, count, dtype) for r in range(n)]
            for root in range(n):
                got = kolo.broadcast(inputs[me], root=root, dtype=dt)
                _equal(got, inputs[root], f"broadcast {dtype} count {count} root {root}")
                buf = inputs[me].copy()
                kolo.broadcast_(buf, root=root, dtype=dt)
                _equal(buf, inputs[root], f"broadcast_ {dtype} count {count} root {root}")
            # allgather with a different first dimension on every rank
            rows = [(count + r) % 5 for r in range(n)]
            blocks = [rank_input(r, rows[r] * 3, dtype).reshape(rows[r], 3) for r in range(n)]
            got = kolo.allgather(blocks[me], dtype=dt)
            _equal(got, np.concatenate(blocks), f"allgather {dtype} rows {rows}")
            # reduce_scatter of count rows of 2, uneven split
            full = [rank_input(r, count * 2, dtype).reshape(count, 2) for r in range(n)]
            got = kolo.reduce_scatter(full[me], op=kolo.SUM, dtype=dt)
            total = reduce(full, "sum", dtype)
            start = sum(kolo.split_rows(count, n)[:me])
            _equal(got, total[start:start + kolo.split_rows(count, n)[me]],
                   f"reduce_scatter {dtype} rows {count}")
            # reduce to every root
            for root in range(n):
                got = kolo.reduce(inputs[me], root=root, op=kolo.MAX, dtype=dt)
                if me == root:
                    _equal(got, reduce(inputs, "max", dtype), f"reduce {dtype} root {root}")
                else:
                    assert got is None
            # alltoall with uneven splits: rank r sends (r + p) % 3 rows to rank p
            splits = [[(r + p) % 3 for p in range(n)] for r in range(n)]
            send = [rank_input(r, sum(splits[r]) * 2, dtype).reshape(-1, 2) for r in range(n)]
            got, received = kolo.alltoall(send[me], splits=splits[me], dtype=dt)
            expected = []
            for r in range(n):
                offset = sum(splits[r][:me])
                expected.append(send[r][offset:offset + splits[r][me]])
            _equal(got, np.concatenate(expected), f"alltoall {dtype}")
            assert received.tolist() == [splits[r][me] for r in range(n)]
    kolo.barrier()
    kolo.shutdown()


def rank_send_recv():
    import kolo
    kolo.init()
    n, me = kolo.size(), kolo.rank()
    for dtype in DTYPES:
        # a ring of messages: even ranks send first, odd ones receive first
        data = rank_input(me, 1001, dtype)
        target = np.empty_like(data)
        peer_to, peer_from = (me + 1) % n, (me - 1) % n
        if me % 2 == 0:
            kolo.world().send(data, peer_to, tag=5, dtype=_dtype_arg(dtype))
            kolo.world().recv(target, peer_from, tag=5, dtype=_dtype_arg(dtype))
        else:
            kolo.world().recv(target, peer_from, tag=5, dtype=_dtype_arg(dtype))
            kolo.world().send(data, peer_to, tag=5, dtype=_dtype_arg(dtype))
        _equal(target, rank_input(peer_from, 1001, dtype), f"recv {dtype} from {peer_from}")
    kolo.shutdown()


def rank_named():
    import kolo
    kolo.init()
    n, me = kolo.size(), kolo.rank()
    names = [f"layer{i}.grad" for i in range(20)]
    counts = [1 + 37 * i for i in range(20)]
    inputs = {name: [rank_input(r, c, "float32", seed=i) for r in range(n)]
              for i, (name, c) in enumerate(zip(names, counts))}
    for step in range(3):
        order = list(range(20))
        np.random.default_rng(me * 100 + step).shuffle(order)  # a different order per rank
        handles, buffers = {}, {}
        for i in order:
            buffers[names[i]] = inputs[names[i]][me].copy()
            if i % 2:
                handles[names[i]] = kolo.allreduce_async_(buffers[names[i]], name=names[i],
                                                          op=kolo.AVG)
            else:
                handles[names[i]] = kolo.allreduce_async(buffers[names[i]], name=names[i],
                                                         op=kolo.AVG)
        for i in range(20):
            got = kolo.synchronize(handles[names[i]])
            assert kolo.poll(handles[names[i]])
            _equal(got, reduce(inputs[names[i]], "avg", "float32"), f"named {names[i]}")
            if i % 2:
                assert got is buffers[names[i]]
    stats = kolo.fusion_stats()
    assert stats["tensors_submitted"] == 60 and stats["requests_completed"] == 60, stats
    # the time breakdown, read through the same struct (a layout off by a field reads zeros or
    # the neighbours' counts): the engine ran collectives and negotiated, and copied iff it fused
    assert stats["collective_ns"] > 0 and stats["negotiation_ns"] > 0, stats
    assert (stats["copy_ns"] > 0) == (stats["fused_collectives"] > 0), stats
    # grouped
    group = [rank_input(me, 10 * (i + 1), "int32", seed=i) for i in range(4)]
    handle = kolo.grouped_allreduce_async(group, names=[f"g{i}" for i in range(4)],
                                          op=kolo.SUM)
    for i, got in enumerate(handle.wait()):
        _equal(got, reduce([rank_input(r, 10 * (i + 1), "int32", seed=i) for r in range(n)],
                           "sum", "int32"), f"grouped member {i}")
    # broadcast and allgather by name, allgather with different rows (zero included)
    for root in range(n):
        data = rank_input(me, 33, "float64")
        got = kolo.broadcast_async(data, root=root, name=f"b{root}").wait()
        _equal(got, rank_input(root, 33, "float64"), f"broadcast_async root {root}")
    rows = [r % 3 for r in range(n)]
    blocks = [rank_input(r, rows[r] * 4, "int64").reshape(rows[r], 4) for r in range(n)]
    handle = kolo.allgather_async(blocks[me], name="gather.me")
    _equal(handle.wait(), np.concatenate(blocks), "allgather_async")
    assert handle.rows_per_rank() == rows
    # a pending handle dropped without waiting must not break anything
    kolo.allreduce_async(np.ones(10, np.float32), name="dropped")
    kolo.barrier()
    kolo.shutdown()


def rank_split():
    import kolo
    world = kolo.init()
    n, me = kolo.size(), kolo.rank()
    half = world.split(color=me % 2, key=-me)  # reversed order inside each colour
    members = [r for r in range(n) if r % 2 == me % 2]
    assert half.size == len(members)
    assert half.rank == sorted(members, reverse=True).index(me)
    got = half.allreduce(np.array([me], np.int64), op=kolo.SUM)
    assert got[0] == sum(members), (got, members)
    handle = half.allreduce_async(np.array([me], np.int32), name="half", op=kolo.MAX)
    assert handle.wait()[0] == max(members)
    none = world.split(color=kolo.COLOR_NONE if me == 0 else 1)
    assert (none is None) == (me == 0)
    if none is not None:
        assert none.size == n - 1
        none.shutdown()
    half.shutdown()
    kolo.shutdown()


def rank_dropped_communicator_is_freed_by_refcount(case):
    """A communicator the program drops is shut down then and there, by reference counting, with
    the garbage collector off: no cycle through its handles (an allgather's completion callback,
    an abandoned request) may leave it to the collector, which runs wherever Python next
    allocates, kolo's engine thread included, where its __del__ (kolo_comm_destroy, which joins
    that thread) must not run."""
    import gc
    import threading
    import weakref
    import kolo
    world = kolo.init()
    me = kolo.rank()
    gc.disable()
    comm = world.split(color=0)
    destroyed_on = []
    ref = weakref.ref(comm)
    weakref.finalize(comm, lambda: destroyed_on.append(threading.get_ident()))
    rows = np.arange(3 * (me + 1), dtype=np.int64).reshape(-1, 3)
    if case == "allgather waited":
        handle = comm.allgather_async(rows, name="gather")
        assert handle.wait().shape[0] == sum(range(1, comm.size + 1))
    elif case == "allgather dropped pending":
        handle = comm.allgather_async(rows, name="gather")
    elif case == "allgather polled":
        handle = comm.allgather_async(rows, name="gather")
        while not handle.poll():
            pass
    else:
        handle = comm.allreduce_async(np.ones(4, np.float32), name="sum")
    del handle
    comm.barrier()
    del comm
    assert ref() is None, f"{case}: the dropped communicator is still alive without the " \
                          f"garbage collector; it is referred to by " \
                          f"{[type(r).__name__ for r in gc.get_referrers(ref())]}"
    assert destroyed_on == [threading.get_ident()], destroyed_on
    gc.enable()
    world.barrier()
    kolo.shutdown()


def rank_mismatch_named():
    import kolo
    kolo.init()
    me = kolo.rank()
    count = 999 if me == kolo.size() - 1 else 1000
    handle = kolo.allreduce_async(np.zeros(count, np.float32), name="bad.tensor")
    good = kolo.allreduce_async(np.ones(5, np.float32), name="good.tensor", op=kolo.SUM)
    with pytest.raises(kolo.MismatchError) as error:
        handle.wait()
    assert "bad.tensor" in str(error.value) and error.value.status == 4, str(error.value)
    assert str(kolo.size() - 1) in error.value.message
    assert good.wait()[0] == kolo.size()  # other tensors go on
    kolo.shutdown()


def rank_mismatch_ordered():
    import kolo
    kolo.init()
    me = kolo.rank()
    count = 999 if me == 1 else 1000
    with pytest.raises(kolo.MismatchError) as error:
        kolo.allreduce(np.zeros(count, np.float32))
    assert "rank 1" in str(error.value), str(error.value)
    # the communicator is broken now: later calls report the same failure
    with pytest.raises(kolo.MismatchError):
        kolo.barrier()
    kolo.shutdown()


def rank_bad_arguments():
    import kolo
    kolo.init()
    n = kolo.size()
    cases = [
        (lambda: kolo.allreduce(np.zeros(3, bool)), "bool"),
        (lambda: kolo.allreduce([1.0, 2.0]), "numpy array"),
        (lambda: kolo.allreduce(np.zeros(3, np.float32), op=17), "op"),
        (lambda: kolo.allreduce_(np.zeros((4, 4), np.float32)[:, 1]), "contiguous"),
        (lambda: kolo.broadcast(np.zeros(3, np.float32), root=n), "root"),
        (lambda: kolo.allreduce(np.zeros(3, np.float32), dtype="bfloat16"), "uint16"),
        (lambda: kolo.alltoall(np.zeros(4, np.float32), splits=[5] * n), "splits"),
        (lambda: kolo.alltoall(np.zeros(n, np.float32), splits=[1.0] * n), "integers"),
        (lambda: kolo.allreduce_async(np.zeros(3, np.float32), name=""), "name"),
    ]
    readonly = np.zeros(3, np.float32)
    readonly.flags.writeable = False
    cases.append((lambda: kolo.allreduce_(readonly), "read-only"))
    for call, word in cases:
        with pytest.raises(kolo.InvalidArgumentError, match="") as error:
            try:
                call()
            except kolo.InvalidArgumentError:
                raise
            else:
                raise AssertionError(f"the case about '{word}' raised nothing")
        assert word in str(error.value), (word, str(error.value))
    if n > 1:  # a name still pending: the other ranks submit it only after the barrier
        if kolo.rank() == 0:
            pending = kolo.allreduce_async(np.zeros(3, np.float32), name="twice")
            with pytest.raises(kolo.InvalidArgumentError, match="twice"):
                kolo.allreduce_async(np.zeros(3, np.float32), name="twice")
            kolo.barrier()
        else:
            kolo.barrier()
            pending = kolo.allreduce_async(np.zeros(3, np.float32), name="twice")
        pending.wait()
    # the communicator still works after argument errors
    assert kolo.allreduce(np.ones(2, np.int32), op=kolo.SUM).tolist() == [n, n]
    kolo.shutdown()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_allreduce_every_dtype_and_op(n):
    ranks.run(n, __file__, "rank_allreduce", timeout=240)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_broadcast_allgather_reduce_scatter_reduce_alltoall(n):
    ranks.run(n, __file__, "rank_other_collectives", timeout=300)


@pytest.mark.parametrize("n", [2, 4])
def test_send_recv(n):
    ranks.run(n, __file__, "rank_send_recv")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_named_async_operations(n):
    ranks.run(n, __file__, "rank_named")


@pytest.mark.parametrize("n", [2, 4])
def test_split(n):
    ranks.run(n, __file__, "rank_split")


@pytest.mark.parametrize("case", ["allgather waited", "allgather polled",
                                  "allgather dropped pending", "allreduce dropped pending"])
@pytest.mark.parametrize("n", [1, 3])
def test_dropped_communicator_is_freed_by_refcount(n, case):
    ranks.run(n, __file__, "rank_dropped_communicator_is_freed_by_refcount", args={"case": case})


@pytest.mark.parametrize("n", [2, 4])
def test_mismatched_named_tensor_fails_on_every_rank(n):
    ranks.run(n, __file__, "rank_mismatch_named")


@pytest.mark.parametrize("n", [2, 4])
def test_mismatched_ordered_call_fails_on_every_rank(n):
    ranks.run(n, __file__, "rank_mismatch_ordered")


@pytest.mark.parametrize("n", [1, 2])
def test_bad_arguments(n):
    ranks.run(n, __file__, "rank_bad_arguments")


def test_a_failing_rank_is_reported():
    """The harness itself: a rank that fails is named, and the job does not hang."""
    with pytest.raises(AssertionError) as error:
        ranks.run(2, __file__, "rank_fail_on_one", timeout=60)
    text = str(error.value)
    assert "RANK 1 FAILED" in text and "rank 1 fails on purpose" in text, text
    # the survivor does not hang: it reports the lost rank by name, unless kolorun, which stops
    # the job when a rank fails, stopped it first
    assert ("PeerLostError" in text and "lost rank 1" in text) or \
        "rank 1 exited with status 1" in text, text


def rank_fail_on_one():
    import kolo
    kolo.init()
    if kolo.rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    kolo.barrier()  # rank 0 waits here until kolorun stops it


def _python(code, env):
    return subprocess.run([ranks.PYTHON, "-c", code], env=ranks.test_environment(env),
                          capture_output=True, text=True, timeout=60)


def test_library_not_found_says_where_it_looked():
    result = _python("import kolo", {"KOLO_LIBRARY": "/nonexistent/libkolo.so"})
    assert result.returncode != 0
    assert "/nonexistent/libkolo.so" in result.stderr and "KOLO_LIBRARY" in result.stderr, \
        result.stderr


def test_init_with_half_a_job_names_the_variable():
    # No launcher at all is a world of one (test_world_of_one.py); a size without a rank is a
    # launch gone wrong, refused naming what was set.
    code = ("import kolo\n"
            "try:\n    kolo.init()\nexcept kolo.ConfigError as e:\n"
            "    print('CONFIG', e.status, e)\n")
    environment = {k: v for k, v in ranks.test_environment().items()
                   if not k.startswith(("KOLO_RANK", "KOLO_SIZE", "KOLO_ADDR", "OMPI_", "PMI_",
                                        "SLURM_", "MASTER_")) and k not in ("RANK",
                                                                            "WORLD_SIZE")}
    environment["KOLO_SIZE"] = "2"
    result = subprocess.run([ranks.PYTHON, "-c", code], env=environment, capture_output=True,
                            text=True, timeout=60)
    assert "CONFIG 7" in result.stdout and "KOLO_SIZE=2" in result.stdout, \
        result.stdout + result.stderr


def test_version_is_checked():
    import kolo
    from kolo import _capi
    assert _capi.library_version // 10000 == _capi.ABI_MAJOR
    assert kolo.__version__.count(".") == 2
