"""kolo.torch's Horovod operations on 1, 2 and 4 ranks: every operation and dtype against
references, in place and out of place, synchronous and asynchronous, their gradients, process
sets, SyncBatchNorm, object helpers and errors."""

import numpy as np
import pytest

import ranks
from reference import DTYPES, rank_input, reduce

TORCH_OPS = {"sum": "Sum", "avg": "Average", "min": "Min", "max": "Max", "prod": "Product"}


def _tensor(array, dtype):
    import torch
    if dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _storage(tensor):
    import torch
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def _same(got, expected, what):
    got = _storage(got)
    if got.shape != expected.shape or not np.array_equal(got, expected):
        raise AssertionError(f"{what}: expected {expected.reshape(-1)[:8]} {expected.shape}, "
                             f"got {got.reshape(-1)[:8]} {got.shape}")


def rank_operations():
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    for dtype in DTYPES:
        for count in (0, 1, 1003):
            inputs = [rank_input(r, count, dtype) for r in range(n)]
            for op, name in TORCH_OPS.items():
                if op == "avg" and dtype in ("int8", "uint8", "int32", "int64"):
                    continue  # integer averages are tested in test_numpy
                expected = reduce(inputs, op, dtype)
                what = f"{dtype} {op} count {count}"
                x = _tensor(inputs[me], dtype)
                _same(hvd.allreduce(x, op=getattr(hvd, name)), expected, "allreduce " + what)
                _same(x, inputs[me], "allreduce wrote its input " + what)
                _same(hvd.allreduce(x, op=getattr(hvd, name), name=f"ar.{dtype}.{op}.{count}"),
                      expected, "named allreduce " + what)
                y = x.clone()
                assert hvd.allreduce_(y, op=getattr(hvd, name)) is y
                _same(y, expected, "allreduce_ " + what)
                h = hvd.allreduce_async(x, op=getattr(hvd, name), name=f"a.{dtype}.{op}")
                _same(hvd.synchronize(h), expected, "allreduce_async " + what)
                y = x.clone()
                h = hvd.allreduce_async_(y, op=getattr(hvd, name))
                assert hvd.synchronize(h) is y
                _same(y, expected, "allreduce_async_ " + what)
            x = _tensor(inputs[me], dtype)
            for root in range(n):
                _same(hvd.broadcast(x, root), inputs[root], f"broadcast {dtype} root {root}")
                y = x.clone()
                hvd.broadcast_(y, root)
                _same(y, inputs[root], f"broadcast_ {dtype}")
                _same(hvd.synchronize(hvd.broadcast_async(x, root, name=f"b.{dtype}.{root}")),
                      inputs[root], f"broadcast_async {dtype}")
                y = x.clone()
                assert hvd.synchronize(hvd.broadcast_async_(y, root)) is y
                _same(y, inputs[root], f"broadcast_async_ {dtype}")
        # grouped forms
        group_inputs = [[rank_input(r, 10 + i, dtype, seed=i) for r in range(n)]
                        for i in range(3)]
        mine = [_tensor(g[me], dtype) for g in group_inputs]
        expected = [reduce(g, "sum", dtype) for g in group_inputs]
        for got, e in zip(hvd.grouped_allreduce(mine, op=hvd.Sum), expected):
            _same(got, e, f"grouped_allreduce {dtype}")
        for got, e in zip(hvd.synchronize(hvd.grouped_allreduce_async(mine, op=hvd.Sum)),
                          expected):
            _same(got, e, f"grouped_allreduce_async {dtype}")
        copies = [t.clone() for t in mine]
        hvd.grouped_allreduce_(copies, op=hvd.Sum, name=f"g.{dtype}")
        for got, e in zip(copies, expected):
            _same(got, e, f"grouped_allreduce_ {dtype}")
        copies = [t.clone() for t in mine]
        hvd.synchronize(hvd.grouped_allreduce_async_(copies, op=hvd.Sum))
        for got, e in zip(copies, expected):
            _same(got, e, f"grouped_allreduce_async_ {dtype}")
        # allgather with a different first dimension per rank
        rows = [r + 1 if r % 2 else 0 for r in range(n)]
        blocks = [rank_input(r, rows[r] * 3, dtype).reshape(rows[r], 3) for r in range(n)]
        _same(hvd.allgather(_tensor(blocks[me], dtype)), np.concatenate(blocks),
              f"allgather {dtype}")
        _same(hvd.synchronize(hvd.allgather_async(_tensor(blocks[me], dtype),
                                                  name=f"ag.{dtype}")),
              np.concatenate(blocks), f"allgather_async {dtype}")
        # alltoall, even and with splits
        send = [rank_input(r, 2 * n * 2, dtype).reshape(2 * n, 2) for r in range(n)]
        got = hvd.alltoall(_tensor(send[me], dtype))
        _same(got, np.concatenate([send[r][2 * me:2 * me + 2] for r in range(n)]),
              f"alltoall {dtype}")
        splits = [[(r + p) % 3 for p in range(n)] for r in range(n)]
        send = [rank_input(r, sum(splits[r]), dtype) for r in range(n)]
        got, received = hvd.alltoall(_tensor(send[me], dtype), splits=splits[me])
        expected_rows = [send[r][sum(splits[r][:me]):sum(splits[r][:me + 1])]
                         for r in range(n)]
        _same(got, np.concatenate(expected_rows), f"alltoall splits {dtype}")
        assert received.tolist() == [splits[r][me] for r in range(n)]
        # reducescatter, uneven rows
        full = [rank_input(r, (2 * n + 1) * 2, dtype).reshape(2 * n + 1, 2) for r in range(n)]
        total = reduce(full, "sum", dtype)
        start = sum((2 * n + 1) // n + (1 if r < (2 * n + 1) % n else 0) for r in range(me))
        mine_rows = (2 * n + 1) // n + (1 if me < (2 * n + 1) % n else 0)
        _same(hvd.reducescatter(_tensor(full[me], dtype), op=hvd.Sum),
              total[start:start + mine_rows], f"reducescatter {dtype}")
    # a non-contiguous tensor in place
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    hvd.allreduce_(x, op=hvd.Sum)
    assert torch.equal(x, torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * n)
    hvd.barrier()
    hvd.shutdown()


def rank_gradients():
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    x = torch.full((4,), float(me + 1), requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * (me + 1)).sum().backward()
    # d/dx_me of sum_r (r+1) * sum_q x_q = sum_r (r+1)
    assert torch.equal(x.grad, torch.full((4,), float(n * (n + 1) / 2))), x.grad
    x.grad = None
    hvd.allreduce(x).sum().backward()  # Average: each rank's loss has weight 1/n per input
    assert torch.allclose(x.grad, torch.ones(4)), x.grad
    x = torch.full((me + 1, 2), 1.0, requires_grad=True)
    gathered = hvd.allgather(x)
    weights = torch.arange(gathered.shape[0], dtype=torch.float32).unsqueeze(1)
    (gathered * weights).sum().backward()
    start = sum(r + 1 for r in range(me))
    expected = weights[start:start + me + 1].expand(me + 1, 2)  # Horovod's: the average
    assert torch.equal(x.grad, expected), (x.grad, expected)
    x = torch.ones(3, requires_grad=True)
    hvd.broadcast(x, 0).sum().backward()
    assert torch.equal(x.grad, torch.ones(3) if me == 0 else torch.zeros(3)), x.grad
    x = torch.ones(2 * n, 1, requires_grad=True)
    out = hvd.reducescatter(x, op=hvd.Sum)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((2 * n, 1), float(n))), x.grad  # Horovod's: x size
    x = torch.arange(2 * n, dtype=torch.float32).unsqueeze(1).requires_grad_()
    out = hvd.alltoall(x)
    (out * (me + 1)).sum().backward()
    expected = torch.tensor([float(p + 1) for p in range(n) for _ in range(2)]).unsqueeze(1)
    assert torch.equal(x.grad, expected), (x.grad, expected)
    hvd.shutdown()


def rank_errors():
    import torch
    import kolo
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    if n > 1:
        count = 7 if me == n - 1 else 8
        with pytest.raises(kolo.MismatchError) as error:
            hvd.allreduce(torch.zeros(count), name="model.bad.grad")
        assert "model.bad.grad" in str(error.value) and f"rank {n - 1}" in str(error.value), \
            str(error.value)
        handle = hvd.allreduce_async(torch.zeros(count), name="async.bad")
        with pytest.raises(kolo.MismatchError, match="async.bad"):
            hvd.synchronize(handle)
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]  # still works
    with pytest.raises(kolo.InvalidArgumentError, match="dtype"):
        hvd.allreduce(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(kolo.InvalidArgumentError, match="dtype"):
        hvd.allreduce(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(kolo.InvalidArgumentError, match="root"):
        hvd.broadcast(torch.zeros(3), n)
    with pytest.raises(kolo.InvalidArgumentError, match="Tensor"):
        hvd.allreduce_async([1.0])
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.zeros(3), op=hvd.Adasum)
    last = hvd.join()  # every rank at once: the same rank everywhere
    assert 0 <= last < n and hvd.allgather(torch.tensor([last])).tolist() == [last] * n, last
    with pytest.raises(ValueError, match="average"):
        hvd.allreduce(torch.zeros(3), average=True, op=hvd.Sum)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]
    hvd.shutdown()
    with pytest.raises(ValueError, match="init"):
        hvd.size()


def rank_process_sets():
    import torch
    import kolo.torch as hvd
    evens = hvd.ProcessSet(range(0, 4, 2))
    hvd.init(process_sets=[evens])
    me = hvd.rank()
    assert evens.included() == (me % 2 == 0)
    if evens.included():
        assert evens.rank() == me // 2 and evens.size() == 2
        got = hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum, process_set=evens)
        assert got.item() == 2.0, got
        got = hvd.synchronize(hvd.allreduce_async(torch.tensor([me]), name="evens", op=hvd.Max,
                                                  process_set=evens))
        assert got.item() == 2
    odds = hvd.add_process_set([1, 3])
    if odds.included():
        assert hvd.allgather(torch.tensor([me]), process_set=odds).tolist() == [1, 3]
    assert hvd.remove_process_set(odds)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == 4
    hvd.shutdown()


def rank_sync_batch_norm():
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    full = torch.randn(4 * n, 3, 5, dtype=torch.float64)
    weight = torch.randn(3, dtype=torch.float64)
    reference = torch.nn.BatchNorm1d(3).double()
    synced = hvd.SyncBatchNorm(3).double()
    with torch.no_grad():
        reference.weight.copy_(weight)
        synced.weight.copy_(weight)
    x_all = full.clone().requires_grad_()
    out_all = reference(x_all)
    (out_all * torch.arange(out_all.numel(), dtype=torch.float64)
     .reshape(out_all.shape)).sum().backward()
    x = full[4 * me:4 * me + 4].clone().requires_grad_()
    out = synced(x)
    weights = torch.arange(out_all.numel(), dtype=torch.float64).reshape(out_all.shape)
    (out * weights[4 * me:4 * me + 4]).sum().backward()
    assert torch.allclose(out, out_all[4 * me:4 * me + 4].detach(), atol=1e-10)
    assert torch.allclose(x.grad, x_all.grad[4 * me:4 * me + 4], atol=1e-10), \
        (x.grad, x_all.grad[4 * me:4 * me + 4])
    weight_grad = hvd.allreduce(synced.weight.grad, op=hvd.Sum)
    assert torch.allclose(weight_grad, reference.weight.grad, atol=1e-10)
    assert torch.allclose(synced.running_mean, reference.running_mean, atol=1e-12)
    assert torch.allclose(synced.running_var, reference.running_var, atol=1e-12)
    hvd.shutdown()


def rank_objects():
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    assert hvd.broadcast_object({"rank": me, "data": list(range(me))}, root_rank=n - 1) == \
        {"rank": n - 1, "data": list(range(n - 1))}
    assert hvd.allgather_object(("r", me) * me) == [("r", r) * r for r in range(n)]
    assert hvd.is_initialized() and hvd.local_size() == n and hvd.local_rank() == me
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    hvd.shutdown()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_operations_every_dtype(n):
    ranks.run(n, __file__, "rank_operations", timeout=400)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gradients_of_collectives(n):
    ranks.run(n, __file__, "rank_gradients")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_errors(n):
    ranks.run(n, __file__, "rank_errors")


def test_process_sets():
    ranks.run(4, __file__, "rank_process_sets")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_sync_batch_norm_equals_batch_norm_on_the_global_batch(n):
    ranks.run(n, __file__, "rank_sync_batch_norm")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_broadcast_and_allgather_objects(n):
    ranks.run(n, __file__, "rank_objects")
