"""kolo.torch.DistributedOptimizer on 1, 2 and 4 ranks: the behaviours Horovod tests, the
construction-time check of the ranks' parameters, and a training run whose parameters are
bitwise identical on every rank and equal to one process training on the global batch."""

import pytest

import ranks


def _model(seed=0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _model_with_unused_layer():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _model()
            self.unused = torch.nn.Linear(2, 2)  # gets no gradient

        def forward(self, x):
            return self.body(x)
    return Net()


def _data(steps, batch):
    import torch
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(steps, batch, 8, generator=generator, dtype=torch.float32)
    y = torch.randint(0, 3, (steps, batch), generator=generator)
    return x, y


def _parameters_identical_on_every_rank(model):
    import torch
    import kolo.torch as hvd
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    for r in range(hvd.size()):
        if not torch.equal(gathered[r].view(torch.int32), gathered[0].view(torch.int32)):
            raise AssertionError(f"rank {r}'s parameters differ from rank 0's bit for bit")


def rank_training(optimizer_name, compression):
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    steps, local_batch = 6, 4
    x, y = _data(steps, local_batch * n)
    loss_function = torch.nn.CrossEntropyLoss()

    def make_optimizer(params):
        if optimizer_name == "adam":
            return torch.optim.Adam(params, lr=0.01)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model = _model(seed=me)  # different initial weights: broadcast_parameters must fix that
    optimizer = hvd.DistributedOptimizer(
        make_optimizer(model.parameters()), named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, compression))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for step in range(steps):
        optimizer.zero_grad()
        shard = slice(me * local_batch, (me + 1) * local_batch)
        loss_function(model(x[step, shard]), y[step, shard]).backward()
        optimizer.step()
    _parameters_identical_on_every_rank(model)

    reference = _model(seed=0)  # one process on the global batch
    reference_optimizer = make_optimizer(reference.parameters())
    for step in range(steps):
        reference_optimizer.zero_grad()
        loss_function(reference(x[step]), y[step]).backward()
        reference_optimizer.step()
    tolerance = 2e-3 if compression == "fp16" else 1e-5
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if not torch.allclose(p, q, atol=tolerance, rtol=0):
            raise AssertionError(f"{name}: distributed and global-batch training differ by "
                                 f"{(p - q).abs().max().item()}")
    hvd.shutdown()


def rank_join():
    """Uneven data: rank r has 2 + r steps, then joins. The others go on, the joined ranks
    counting as zeros in the averaged gradients (divided by size(), as in Horovod); join returns
    the last rank, whose parameters every rank then takes. They equal one process replaying the
    same steps: at each step the sum of the active ranks' gradients divided by size()."""
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    local_batch = 4
    steps_of = [2 + r for r in range(n)]
    x, y = _data(max(steps_of), local_batch * n)
    loss_function = torch.nn.CrossEntropyLoss()
    model = _model(seed=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    shard = lambda rank: slice(rank * local_batch, (rank + 1) * local_batch)  # noqa: E731
    for step in range(steps_of[me]):
        optimizer.zero_grad()
        loss_function(model(x[step, shard(me)]), y[step, shard(me)]).backward()
        optimizer.step()
    last = hvd.join()
    assert last == n - 1, f"join returned {last}, not {n - 1}"
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    _parameters_identical_on_every_rank(model)

    reference = _model(seed=0)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(max(steps_of)):
        reference_optimizer.zero_grad()
        active = [r for r in range(n) if steps_of[r] > step]
        total = sum(loss_function(reference(x[step, shard(r)]), y[step, shard(r)])
                    for r in active)
        (total / n).backward()
        reference_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if not torch.allclose(p, q, atol=1e-5, rtol=0):
            raise AssertionError(f"{name}: training with joined ranks and its replay differ by "
                                 f"{(p - q).abs().max().item()}")
    # Joining is over: every rank submits again, and an allreduce needs all of them.
    total = hvd.allreduce(torch.tensor([float(me + 1)]), op=hvd.Sum, name="after.join")
    assert total.item() == n * (n + 1) / 2, total
    hvd.shutdown()


def rank_behaviours():
    import torch
    import kolo.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()

    # duplicate names, and parameters missing from named_parameters
    model = _model()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named + [named[0]])
    with pytest.raises(ValueError, match="not in it"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named[1:])

    # parameters without gradients: reduced as zeros, no hang
    model = _model_with_unused_layer()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    model(torch.ones(2, 8) * me).sum().backward()
    optimizer.step()
    assert torch.equal(model.unused.weight.grad, torch.zeros(2, 2))
    expected = hvd.allreduce(model.body[2].bias.grad, op=hvd.Sum)  # averaged: all equal
    assert torch.equal(expected, model.body[2].bias.grad * n)

    # dynamic requires_grad: the first layer frozen for a step, then thawed
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for step in range(4):
        for p in model[0].parameters():
            p.requires_grad_(step % 2 == 0)
        optimizer.zero_grad()
        model(torch.ones(3, 8) * (me + 1)).sum().backward()
        optimizer.step()
    _parameters_identical_on_every_rank(model)

    # backward_passes_per_step: two passes accumulate locally, then one reduction
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2)
    model(torch.ones(1, 8) * (me + 1)).sum().backward()
    model(torch.ones(1, 8) * (me + 1)).sum().backward()
    optimizer.step()
    local = _model()
    local(torch.ones(1, 8) * (me + 1)).sum().backward()
    expected = hvd.allreduce(local[0].weight.grad * 2, op=hvd.Average)
    assert torch.allclose(model[0].weight.grad, expected, atol=1e-6)
    optimizer.zero_grad()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        for _ in range(3):
            model(torch.ones(1, 8)).sum().backward()
    optimizer.synchronize()
    optimizer.zero_grad()

    # clipping between synchronize and step
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 8) * (me + 1)).sum().backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped = [p.grad.clone() for p in model.parameters()]
    with optimizer.skip_synchronize():
        optimizer.step()
    for b, p, g in zip(before, model.parameters(), clipped):
        assert torch.allclose(p, b - g, atol=1e-7)
    norm = torch.sqrt(sum((g * g).sum() for g in clipped))
    assert norm <= 0.0100001, norm
    _parameters_identical_on_every_rank(model)

    # gradient_predivide_factor gives the same average
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters(),
                                         gradient_predivide_factor=2.0)
    model(torch.ones(1, 8) * (me + 1)).sum().backward()
    optimizer.synchronize()
    local = _model()
    local(torch.ones(1, 8) * (me + 1)).sum().backward()
    assert torch.allclose(model[0].weight.grad,
                          hvd.allreduce(local[0].weight.grad, op=hvd.Average), atol=1e-6)
    with pytest.raises(ValueError, match="Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    hvd.shutdown()


def rank_optimizer_state(optimizer_name):
    import torch
    import kolo.torch as hvd
    hvd.init()
    me = hvd.rank()
    model = _model()
    if optimizer_name == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (me + 1))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (me + 1), momentum=0.5)
    if me == 0:  # only the root has state (as after loading a checkpoint)
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(2, 8)).sum().backward()
            optimizer.step()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    state = optimizer.state_dict()
    objects = hvd.allgather_object(state)
    for r, other in enumerate(objects):
        assert other["param_groups"] == objects[0]["param_groups"], r
        assert sorted(other["state"]) == sorted(objects[0]["state"]) and other["state"], r
        for index, entries in other["state"].items():
            for key, value in entries.items():
                assert torch.equal(torch.as_tensor(value),
                                   torch.as_tensor(objects[0]["state"][index][key])), \
                    (r, index, key)
    hvd.shutdown()


def rank_model_mismatch():
    import torch
    import kolo
    import kolo.torch as hvd
    hvd.init()
    me = hvd.rank()
    width = 17 if me == hvd.size() - 1 else 16
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 3))
    with pytest.raises(kolo.MismatchError) as error:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
    text = str(error.value)
    assert "'0.weight'" in text and "[16, 8]" in text and "[17, 8]" in text and \
        f"rank {hvd.size() - 1}" in text, text
    hvd.shutdown()


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_training_matches_the_global_batch_bitwise_identical_on_every_rank(n, optimizer_name):
    ranks.run(n, __file__, "rank_training", args={"optimizer_name": optimizer_name,
                                                  "compression": "none"})


@pytest.mark.parametrize("n", [2, 4])
def test_training_with_fp16_compression(n):
    ranks.run(n, __file__, "rank_training", args={"optimizer_name": "sgd",
                                                  "compression": "fp16"})


@pytest.mark.parametrize("n", [1, 2, 4])
def test_join_with_uneven_data_equals_its_replay(n):
    ranks.run(n, __file__, "rank_join")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_horovod_behaviours(n):
    ranks.run(n, __file__, "rank_behaviours")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_broadcast_optimizer_state(n, optimizer_name):
    ranks.run(n, __file__, "rank_optimizer_state", args={"optimizer_name": optimizer_name})


@pytest.mark.parametrize("n", [2, 4])
def test_models_that_differ_fail_at_construction_on_every_rank(n):
    ranks.run(n, __file__, "rank_model_mismatch", timeout=60)
