"""kolo.torch as Horovod's PyTorch API: a failed collective fails that call only, on every rank
(the ranks stay in step for the calls after it); join semantics (allreduce goes on with a joined
rank, allgather and broadcast raise); the calls Horovod has beyond kolo's first API
(reducescatter_async, grouped_allgather, grouped_reducescatter, sparse_allreduce_async, ...);
roots of process sets numbered as ranks of the job; broadcast_optimizer_state of an optimizer
that has not stepped; and the runner of Horovod's own suite (tests/horovod/run_suite.py)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import ranks


def _mismatch_everywhere(call, what):
    import kolo
    try:
        call()
    except kolo.MismatchError as error:
        return str(error)
    raise AssertionError(f"{what}: expected MismatchError on every rank, got none")


def rank_failed_calls_leave_the_ranks_in_step():
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    # Each bad call is followed by good ones of every kind: before the agreement, the first bad
    # ordered call left every later call failing with the first call's mismatch.
    bad_calls = {
        "allreduce, other counts": lambda: hvd.allreduce(torch.ones([17 + me] * 2)),
        "allreduce, same count, other shape": lambda: hvd.allreduce(
            torch.ones([6, 4] if me == 0 else [4, 6])),
        "allreduce, other dtypes": lambda: hvd.allreduce(
            torch.ones(3, dtype=torch.float32 if me == 0 else torch.float64)),
        "allgather, other trailing dimensions": lambda: hvd.allgather(torch.ones(2, 3 + me)),
        "broadcast, other roots": lambda: hvd.broadcast(torch.ones(3), root_rank=me),
        "alltoall, other trailing dimensions": lambda: hvd.alltoall(torch.ones(n, 1 + me)),
        "reducescatter, other ops": lambda: hvd.reducescatter(
            torch.ones(n), op=hvd.Sum if me == 0 else hvd.Average),
        "different operations": lambda: (hvd.allreduce(torch.ones(4)) if me == 0 else
                                         hvd.broadcast(torch.ones(4), root_rank=0)),
        "barrier against allreduce": lambda: (hvd.barrier() if me == 0 else
                                              hvd.allreduce(torch.ones(1))),
    }
    for what, call in bad_calls.items():
        message = _mismatch_everywhere(call, what)
        assert "disagree" in message and "rank 0" in message and "rank 1" in message, \
            (what, message)
        # every kind of call still works, with the right values
        got = hvd.allreduce(torch.full((5,), float(me + 1)), op=hvd.Sum)
        assert got.tolist() == [n * (n + 1) / 2] * 5, (what, got)
        got = hvd.allgather(torch.full((me + 1, 2), me))
        expected = torch.cat([torch.full((r + 1, 2), r) for r in range(n)])
        assert torch.equal(got, expected), (what, got)
        assert hvd.broadcast(torch.full((3,), me), root_rank=n - 1).tolist() == [n - 1] * 3
        got = hvd.alltoall(torch.arange(n) + 10 * me)
        assert got.tolist() == [10 * r + me for r in range(n)], (what, got)
        hvd.barrier()
        assert hvd.broadcast_object({"r": me}, root_rank=0) == {"r": 0}
    # the message says what each rank called
    message = _mismatch_everywhere(lambda: hvd.allreduce(torch.ones(2, 3 + me)), "message")
    assert "rank 0: allreduce of float32 [2, 3]" in message and \
        "rank 1: allreduce of float32 [2, 4]" in message, message
    hvd.shutdown()


def rank_join():
    import torch
    import kolo
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    for first in range(n):
        if me == first:
            last = hvd.join()
        else:
            with pytest.raises(kolo.MismatchError, match=f"rank {first} has joined"):
                hvd.allgather(torch.ones(2, 2))
            live = min(set(range(n)) - {first})
            with pytest.raises(kolo.MismatchError, match="joined"):
                hvd.broadcast(torch.ones(2), root_rank=live)
            # a named broadcast goes through kolo's engine, which refuses it too
            with pytest.raises(kolo.InvalidArgumentError, match=f"rank {first} has called kolo_join"):
                hvd.broadcast(torch.ones(2), root_rank=live, name="broadcast.while.joined")
            # allreduce goes on, the joined rank counting as zeros (Average divides by n)
            got = hvd.allreduce(torch.full((3,), 2.0), op=hvd.Sum)
            assert got.tolist() == [2.0 * (n - 1)] * 3, got
            got = hvd.allreduce(torch.full((3,), 2.0))
            assert torch.allclose(got, torch.full((3,), 2.0 * (n - 1) / n)), got
            last = hvd.join()
        assert last != first, (last, first)
        # after join every call works again, on every rank
        assert hvd.allgather(torch.tensor([last])).tolist() == [last] * n
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]
    hvd.shutdown()


def rank_horovod_calls():
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    assert not hvd.mpi_enabled() and not hvd.ccl_built() and not hvd.gloo_enabled()
    assert issubclass(hvd.HorovodInternalError, RuntimeError)

    # reducescatter: rows // n each, one more for the first rows % n ranks (Horovod's split)
    rows = 2 * n + 1
    tensor = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * (me + 1)
    total = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * (n * (n + 1) / 2)
    sizes = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    start = sum(sizes[:me])
    mine = total[start:start + sizes[me]]
    assert torch.equal(hvd.reducescatter(tensor, op=hvd.Sum), mine)
    handle = hvd.reducescatter_async(tensor, name="rs", op=hvd.Sum)
    assert torch.equal(hvd.synchronize(handle), mine)
    handle = hvd.reducescatter_async(tensor, name="rs.avg")
    assert torch.allclose(hvd.synchronize(handle), mine / n)
    # a name still pending is refused at once; the others submit it only after the barrier,
    # so rank 0's first submission cannot have completed (alone, it may have: nothing to wait for)
    if me == 0:
        first = hvd.reducescatter_async(tensor, name="twice", op=hvd.Sum)
        if n > 1:
            with pytest.raises(ValueError, match="twice"):
                hvd.reducescatter_async(tensor, name="twice", op=hvd.Sum)
        hvd.barrier()
    else:
        hvd.barrier()
        first = hvd.reducescatter_async(tensor, name="twice", op=hvd.Sum)
    assert torch.equal(hvd.synchronize(first), mine)
    got = hvd.grouped_reducescatter([tensor, 2 * tensor], op=hvd.Sum)
    assert torch.equal(got[0], mine) and torch.equal(got[1], 2 * mine)
    got = hvd.synchronize(hvd.grouped_reducescatter_async([tensor, 2 * tensor], name="grs",
                                                          op=hvd.Sum))
    assert torch.equal(got[0], mine) and torch.equal(got[1], 2 * mine)

    # integers keep their dtype under prescale/postscale: scaled in float64, truncated
    ints = torch.arange(2 * n * 3, dtype=torch.int32).reshape(2 * n, 3)
    got = hvd.grouped_reducescatter([ints, ints.long()], op=hvd.Sum, prescale_factor=1.5,
                                    postscale_factor=0.5)
    expected = (((ints.double() * 1.5).int() * n).double() * 0.5).int()[2 * me:2 * me + 2]
    assert got[0].dtype == torch.int32 and torch.equal(got[0], expected), got
    assert got[1].dtype == torch.int64 and torch.equal(got[1], expected.long()), got

    # grouped allgather, alltoall_async
    parts = [torch.full((me + 1,), me), torch.full((1, 2), 10.0 * me)]
    expected = [torch.cat([torch.full((r + 1,), r) for r in range(n)]),
                torch.cat([torch.full((1, 2), 10.0 * r) for r in range(n)])]
    for got in (hvd.grouped_allgather(parts),
                hvd.synchronize(hvd.grouped_allgather_async(parts, name="gag"))):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), got
    got = hvd.synchronize(hvd.alltoall_async(torch.arange(n) + 10 * me))
    assert got.tolist() == [10 * r + me for r in range(n)]
    # splits that are not integers are refused before anything is sent, whatever their values
    # (uninitialized memory included, which a conversion to int could overflow)
    for bad in (torch.full((n,), 1e30), torch.ones(n, dtype=torch.float64)):
        with pytest.raises(ValueError, match="integers"):
            hvd.alltoall(torch.ones(n), bad)

    # sparse allreduce: every rank's entries; duplicates add up once coalesced
    sparse = torch.sparse_coo_tensor([[me, n]], [1.0 + me, 1.0], (n + 1,))
    result = hvd.sparse_allreduce_async(sparse, name="emb", op=hvd.Sum)().coalesce()
    dense = torch.zeros(n + 1)
    dense[:n] = torch.arange(1.0, n + 1)
    dense[n] = n
    assert torch.equal(result.to_dense(), dense), result
    result = hvd.sparse_allreduce_async(sparse, name="emb.avg", op=hvd.Average)()
    assert torch.allclose(result.to_dense(), dense / n)

    # a process set's root is a rank of the job
    if n == 1:
        hvd.shutdown()
        return
    odd = hvd.add_process_set([r for r in range(n) if r % 2 == 1])
    if odd.included():
        got = hvd.broadcast(torch.full((2,), float(me)), root_rank=odd.ranks[-1],
                            process_set=odd)
        assert got.tolist() == [odd.ranks[-1]] * 2, got
        assert hvd.broadcast_object(me, root_rank=odd.ranks[0], process_set=odd) == odd.ranks[0]
        with pytest.raises(ValueError, match="not a member"):
            hvd.broadcast(torch.ones(1), root_rank=0, process_set=odd)
    hvd.barrier()  # removing a set does not wait for its members to be done with it
    hvd.remove_process_set(odd)
    hvd.shutdown()


def rank_optimizer_state_before_any_step():
    import warnings
    import torch
    import kolo.torch as hvd
    hvd.init()
    me = hvd.rank()
    torch.manual_seed(me)
    model = torch.nn.Linear(3, 2)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    optimizer = torch.optim.SGD(list(model.parameters()) + [frozen], lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=list(
        model.named_parameters()) + [("frozen", frozen)])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # Horovod's: parameters that need a gradient get a zero one; the state stays empty
    assert frozen.grad is None and not optimizer.state_dict()["state"]
    for p in model.parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    # one step on every rank; then rank 1 loses its state and gets the root's back
    model(torch.full((1, 3), float(me))).sum().backward()
    optimizer.step()
    if me == 1:
        optimizer.state.clear()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for p in model.parameters():
        buffer = optimizer.state[p]["momentum_buffer"]
        assert torch.equal(hvd.broadcast(buffer, root_rank=0), buffer)
    # step() after synchronize() outside skip_synchronize() warns in Horovod's words
    optimizer.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    assert len(caught) == 1 and "optimizer.step() called without " \
        "optimizer.skip_synchronize()" in str(caught[0].message), [str(w.message) for w in caught]
    hvd.shutdown()


def rank_int16():
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    # 20000 * (1 + 2 + ...) overflows int16: the sum wraps as two's complement integers do
    values = np.array([20000, -32768, 7, me], np.int64) * (me + 1)
    mine = torch.tensor(values.astype(np.int16))
    everyone = sum((np.array([20000, -32768, 7, r], np.int64) * (r + 1)).astype(np.int16)
                   .astype(np.int64) for r in range(n))
    wrapped = torch.tensor(((everyone + 32768) % 65536 - 32768).astype(np.int16))
    assert torch.equal(hvd.allreduce(mine, op=hvd.Sum), wrapped)
    assert torch.equal(hvd.synchronize(hvd.allreduce_async(mine, name="i16", op=hvd.Sum)), wrapped)
    gathered = hvd.allgather(mine.reshape(1, 4))
    assert gathered.dtype == torch.int16 and gathered.shape == (n, 4)
    assert torch.equal(gathered[me], mine)
    assert torch.equal(hvd.broadcast(mine, root_rank=n - 1), gathered[n - 1])
    model = torch.nn.Linear(2, 1)
    model.register_buffer("steps", torch.tensor([me], dtype=torch.int16))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert model.steps.item() == 0
    hvd.shutdown()


@pytest.mark.parametrize("n", [2, 3])
def test_int16_through_the_horovod_api(n):
    ranks.run(n, __file__, "rank_int16", timeout=300)


@pytest.mark.parametrize("n", [2, 3])
def test_a_failed_call_fails_only_itself_on_every_rank(n):
    ranks.run(n, __file__, "rank_failed_calls_leave_the_ranks_in_step", timeout=300)


@pytest.mark.parametrize("n", [2, 3])
def test_join_allreduce_goes_on_allgather_and_broadcast_raise(n):
    ranks.run(n, __file__, "rank_join", timeout=300)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_horovod_calls_beyond_the_first_api(n):
    ranks.run(n, __file__, "rank_horovod_calls", timeout=300)


def test_broadcast_optimizer_state_before_any_step():
    ranks.run(2, __file__, "rank_optimizer_state_before_any_step", timeout=300)


def test_suite_runner_skips_without_a_checkout():
    runner = os.path.join(ranks.CHECKOUT, "tests", "horovod", "run_suite.py")
    result = subprocess.run([sys.executable, runner], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 77, (result.returncode, result.stdout, result.stderr)
    assert "SKIP" in result.stdout and "Horovod checkout" in result.stdout, result.stdout


def test_suite_runner_judges_kolo_torch_when_given_a_checkout():
    """Runs a few of Horovod's own tests through the runner when HOROVOD_CHECKOUT names a
    checkout of github.com/horovod/horovod (CI has none: skipped)."""
    checkout = os.environ.get("HOROVOD_CHECKOUT")
    if not checkout:
        pytest.skip("HOROVOD_CHECKOUT is not set (a checkout of github.com/horovod/horovod)")
    runner = os.path.join(ranks.CHECKOUT, "tests", "horovod", "run_suite.py")
    result = subprocess.run(
        [sys.executable, runner, checkout, "--mode", "one", "-k",
         "test_horovod_allreduce_error or test_horovod_allreduce_average or "
         "test_horovod_join_allgather or test_horovod_broadcast_process_sets"],
        capture_output=True, text=True, timeout=600, env=ranks.test_environment())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "4 passed, 0 failed" in result.stdout, result.stdout


def rank_sparse_embedding(sparse_as_dense):
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    reference = torch.nn.Embedding(10, 3)
    reference.load_state_dict(embedding.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.5),
                                         named_parameters=embedding.named_parameters(),
                                         sparse_as_dense=sparse_as_dense)
    inputs = [torch.tensor([[1, 2, 4], [4, 3 + r % 2, 9]]) for r in range(n)]
    embedding(inputs[me]).sum().backward()
    optimizer.step()
    assert embedding.weight.grad.is_sparse
    # one process: the average of every rank's dense gradient
    for r in range(n):
        (reference(inputs[r]).sum() / n).backward()
    with torch.no_grad():
        reference.weight -= 0.5 * reference.weight.grad
    assert torch.allclose(embedding.weight, reference.weight, atol=1e-6), \
        (embedding.weight, reference.weight)
    hvd.shutdown()


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_gradients_are_averaged(sparse_as_dense):
    ranks.run(2, __file__, "rank_sparse_embedding", timeout=300,
              args={"sparse_as_dense": sparse_as_dense})


def rank_horovod_variables():
    import torch
    import kolo.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(3), name="start.the.engine")
    stats = hvd.global_process_set.communicator().fusion_stats()
    assert stats["fusion_threshold"] == 1 << 20, stats
    assert abs(stats["cycle_time_ms"] - 2.5) < 1e-9, stats
    hvd.shutdown()


def test_horovod_variables_reach_the_library():
    env = ranks.test_environment({"HOROVOD_FUSION_THRESHOLD": "1048576",
                                  "HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_NOT_IN_KOLO": "1",
                                  "KOLO_DEBUG": "INFO"})
    output = ranks.run(2, __file__, "rank_horovod_variables", timeout=300, env=env,
                       kolorun_options=["--tag-output"])
    for rank in range(2):
        lines = [line for line in output.splitlines() if line.startswith(f"[{rank}]")]
        mapped = [line for line in lines if "HOROVOD_FUSION_THRESHOLD=1048576 read as "
                  "KOLO_FUSION_THRESHOLD=1048576" in line]
        ignored = [line for line in lines if "HOROVOD_NOT_IN_KOLO is set, but kolo does not "
                   "honour" in line]
        assert mapped and all(" INFO " in line for line in mapped), output[-3000:]
        assert len(ignored) == 1 and " WARN " in ignored[0], output[-3000:]
