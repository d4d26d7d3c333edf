"""Real clients of the "kolo" torch.distributed backend at N = 2 and 4, each checked against
training computed independently: ZeroRedundancyOptimizer over DDP and a sharded (FSDP-style)
step made of reduce_scatter_tensor and all_gather_into_tensor, each reaching the parameters of
plain DDP; DDP with gradient_as_bucket_view and no_sync against one process on the global
batch; a pipeline-parallel loop with isend/irecv against the whole model in one process; an
all_to_all "expert" exchange against the same routing done locally."""

import pytest

import ranks
from test_torch_distributed import _init

STEPS = 4


def _model(seed=0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(step, rank, rows=8):
    """Rank's part of the global batch of a step: the same on every run."""
    import torch
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 6, generator=generator), torch.randn(rows, 3, generator=generator)


def _loss(model, x, y):
    import torch
    return torch.nn.functional.mse_loss(model(x), y)


def _train_ddp(dist, steps=STEPS, optimizer_class=None):
    import torch
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(_model())
    if optimizer_class is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = optimizer_class(model.parameters())
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, *_batch(step, dist.get_rank())).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])


def _close(a, b, what):
    import torch
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), \
        f"{what}: largest difference {(a - b).abs().max().item()}"


def rank_zero_redundancy():
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    dist = _init()
    plain = _train_ddp(dist)
    zero = _train_ddp(dist, optimizer_class=lambda params: ZeroRedundancyOptimizer(
        params, optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9))
    _close(zero, plain, "ZeroRedundancyOptimizer over DDP vs plain DDP")
    everyone = [torch.empty_like(zero) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, zero)
    assert all(torch.equal(e, zero) for e in everyone), "ranks ended with different parameters"
    print("zero checks passed", flush=True)


def rank_sharded_step():
    """FSDP's step by hand: each rank keeps a shard of the flat parameters and its optimizer
    state; forward and backward run on the full parameters gathered with
    all_gather_into_tensor; gradients are averaged and scattered with reduce_scatter_tensor."""
    import torch
    dist = _init()
    n, me = dist.get_world_size(), dist.get_rank()
    plain = _train_ddp(dist)
    model = _model()
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    shard = -(-total // n)  # padded so that every rank holds the same number
    flat = torch.zeros(shard * n)
    flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
    mine = flat[me * shard:(me + 1) * shard].clone()
    optimizer = torch.optim.SGD([mine], lr=0.1, momentum=0.9)
    for step in range(STEPS):
        full = torch.empty(shard * n)
        dist.all_gather_into_tensor(full, mine.detach())
        offset = 0
        for p in params:
            p.data.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
            p.grad = None
        _loss(model, *_batch(step, me)).backward()
        grads = torch.zeros(shard * n)
        grads[:total] = torch.cat([p.grad.reshape(-1) for p in params])
        grad_shard = torch.empty(shard)
        dist.reduce_scatter_tensor(grad_shard, grads, op=dist.ReduceOp.SUM)
        mine.grad = grad_shard / n
        optimizer.step()
    full = torch.empty(shard * n)
    dist.all_gather_into_tensor(full, mine.detach())
    _close(full[:total], plain, "sharded step vs plain DDP")
    print("sharded checks passed", flush=True)


def rank_ddp_bucket_view_no_sync():
    """DDP with gradient_as_bucket_view, two micro-batches accumulated under no_sync and a
    third synchronised, against one process on the global batch."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    dist = _init()
    n, me = dist.get_world_size(), dist.get_rank()
    model = DistributedDataParallel(_model(), gradient_as_bucket_view=True,
                                    bucket_cap_mb=0.0001)  # several buckets
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference = _model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(STEPS):
        optimizer.zero_grad()
        with model.no_sync():
            for micro in range(2):
                (_loss(model, *_batch(10 * step + micro, me)) / 3).backward()
        (_loss(model, *_batch(10 * step + 2, me)) / 3).backward()
        optimizer.step()
        # The reference: every rank's micro-batches in one process; DDP averages over ranks.
        reference_optimizer.zero_grad()
        for r in range(n):
            for micro in range(3):
                (_loss(reference, *_batch(10 * step + micro, r)) / (3 * n)).backward()
        reference_optimizer.step()
    _close(torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]),
           torch.cat([p.detach().reshape(-1) for p in reference.parameters()]),
           "DDP with no_sync and gradient_as_bucket_view vs one process")
    print("no_sync checks passed", flush=True)


def rank_pipeline():
    """Stage r of n holds layer r of a chain of Linear+Tanh layers; micro-batches flow forward
    with isend/irecv of activations and backward with isend/irecv of their gradients (several
    in flight at once, as a 1F1B schedule's warm-up has). The last stage's loss is the whole
    model's; after the steps every stage's layer must equal the same layer of the whole model
    trained in one process."""
    import torch
    dist = _init()
    n, me = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(5)
    layers = [torch.nn.Linear(4, 4) for _ in range(n)]
    reference = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                      for _ in range(n)])
    for layer, ref in zip(layers, reference):
        ref[0].load_state_dict(layer.state_dict())
    stage = torch.nn.Sequential(layers[me], torch.nn.Tanh())
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    micro_batches = 3
    for step in range(STEPS):
        inputs = [_batch(100 * step + m, 0, rows=5)[0][:, :4] for m in range(micro_batches)]
        targets = [_batch(100 * step + m, 1, rows=5)[1][:, :1].expand(5, 4).contiguous()
                   for m in range(micro_batches)]
        optimizer.zero_grad()
        outputs, received = [], []
        requests = []
        for m in range(micro_batches):  # every forward first, receives posted up front
            if me > 0:
                x = torch.empty(5, 4)
                requests.append((dist.irecv(x, me - 1), x))
        for m in range(micro_batches):
            if me == 0:
                x = inputs[m]
            else:
                request, x = requests[m]
                request.wait()
            x = x.requires_grad_(me > 0)
            y = stage(x)
            received.append(x)
            outputs.append(y)
            if me < n - 1:
                dist.isend(y.detach().contiguous(), me + 1)
        gradient_requests = {}
        for m in reversed(range(micro_batches)):  # in the order the next stage sends them
            if me < n - 1:
                g = torch.empty(5, 4)
                gradient_requests[m] = (dist.irecv(g, me + 1), g)
        sends = []
        for m in reversed(range(micro_batches)):
            if me == n - 1:
                (torch.nn.functional.mse_loss(outputs[m], targets[m]) / micro_batches).backward()
            else:
                request, g = gradient_requests[m]
                request.wait()
                outputs[m].backward(g)
            if me > 0:
                sends.append(dist.isend(received[m].grad.contiguous(), me - 1))
        for send in sends:
            send.wait()
        optimizer.step()
        reference_optimizer.zero_grad()
        for m in range(micro_batches):
            (torch.nn.functional.mse_loss(reference(inputs[m]), targets[m]) /
             micro_batches).backward()
        reference_optimizer.step()
    for mine, theirs in zip(stage[0].parameters(), reference[me][0].parameters()):
        _close(mine.detach(), theirs.detach(), f"pipeline stage {me}")
    dist.barrier()
    print("pipeline checks passed", flush=True)


def rank_pipeline_1f1b():
    """The same chain of stages on a one-forward-one-backward schedule: stage s runs n - s - 1
    warm-up forwards, then alternates, exchanging with each neighbour through
    batch_isend_irecv with its own send listed first: an activation goes to s + 1 while the
    gradient of an earlier micro-batch comes back from it, and the gradient goes to s - 1 while
    the next activation comes from it. Neighbours send to each other at the same moment, which
    only point to point that does not block on the send can run."""
    import torch
    dist = _init()
    n, me = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(6)
    layers = [torch.nn.Linear(4, 4) for _ in range(n)]
    reference = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                      for _ in range(n)])
    for layer, ref in zip(layers, reference):
        ref[0].load_state_dict(layer.state_dict())
    stage = torch.nn.Sequential(layers[me], torch.nn.Tanh())
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    micro_batches = n + 2
    first, last = me == 0, me == n - 1

    def exchange(send, send_to, receive_from):
        """Sends `send` (if any) and receives one (5, 4) tensor (if asked), both at once."""
        received = torch.empty(5, 4) if receive_from is not None else None
        operations = []
        if send is not None:
            operations.append(dist.P2POp(dist.isend, send.detach().contiguous(), send_to))
        if receive_from is not None:
            operations.append(dist.P2POp(dist.irecv, received, receive_from))
        if operations:
            for request in dist.batch_isend_irecv(operations):
                request.wait()
        return received

    for step in range(STEPS):
        inputs = [_batch(200 * step + m, 0, rows=5)[0][:, :4] for m in range(micro_batches)]
        targets = [_batch(200 * step + m, 1, rows=5)[1][:, :1].expand(5, 4).contiguous()
                   for m in range(micro_batches)]
        optimizer.zero_grad()
        kept = {}  # micro-batch -> (input, output) until its backward

        def forward(m, x):
            x = x.requires_grad_(not first)
            y = stage(x)
            kept[m] = (x, y)
            return y

        def backward(m, gradient):
            x, y = kept.pop(m)
            if last:
                (torch.nn.functional.mse_loss(y, targets[m]) / micro_batches).backward()
            else:
                y.backward(gradient)
            return None if first else x.grad

        warmup = min(n - me - 1, micro_batches)
        for m in range(warmup):
            x = inputs[m] if first else exchange(None, None, me - 1)
            y = forward(m, x)
            exchange(y, me + 1, None)
        x = None
        if warmup < micro_batches:
            x = inputs[warmup] if first else exchange(None, None, me - 1)
        for i in range(micro_batches - warmup):
            m = warmup + i
            y = forward(m, x)
            gradient = None if last else exchange(y, me + 1, me + 1)
            dx = backward(i, gradient)
            if i == micro_batches - warmup - 1:
                if not first:
                    exchange(dx, me - 1, None)
            elif first:
                x = inputs[m + 1]
            else:
                x = exchange(dx, me - 1, me - 1)
        for i in range(micro_batches - warmup, micro_batches):
            gradient = exchange(None, None, me + 1)
            dx = backward(i, gradient)
            if not first:
                exchange(dx, me - 1, None)
        optimizer.step()
        reference_optimizer.zero_grad()
        for m in range(micro_batches):
            (torch.nn.functional.mse_loss(reference(inputs[m]), targets[m]) /
             micro_batches).backward()
        reference_optimizer.step()
    for mine, theirs in zip(stage[0].parameters(), reference[me][0].parameters()):
        _close(mine.detach(), theirs.detach(), f"1F1B pipeline stage {me}")
    dist.barrier()
    print("1f1b checks passed", flush=True)


def rank_experts():
    """Mixture of experts: rank r hosts expert r (multiply by r + 2, add r). Every rank routes
    each of its tokens to an expert chosen from the token's value; all_to_all_single sends the
    tokens (uneven splits, exchanged first with an all_to_all of the counts), the experts run,
    and a second all_to_all_single brings the results back in place."""
    import torch
    dist = _init()
    n, me = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(77 + me)
    tokens = torch.randn(23 + me, 8, generator=generator)
    choice = (tokens[:, 0].abs() * 1000).long() % n
    order = torch.argsort(choice, stable=True)
    send_counts = torch.bincount(choice, minlength=n)
    receive_counts = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(receive_counts, send_counts)
    arriving = torch.empty(int(receive_counts.sum()), 8)
    dist.all_to_all_single(arriving, tokens[order], output_split_sizes=receive_counts.tolist(),
                           input_split_sizes=send_counts.tolist())
    processed = arriving * (me + 2) + me
    returned = torch.empty(len(tokens), 8)
    dist.all_to_all_single(returned, processed, output_split_sizes=send_counts.tolist(),
                           input_split_sizes=receive_counts.tolist())
    result = torch.empty_like(tokens)
    result[order] = returned
    expected = tokens * (choice[:, None] + 2).float() + choice[:, None].float()
    _close(result, expected, "expert exchange")
    print("expert checks passed", flush=True)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("client", ["zero_redundancy", "sharded_step", "ddp_bucket_view_no_sync",
                                    "pipeline", "pipeline_1f1b", "experts"])
def test_training_clients(client, n):
    output = ranks.run(n, __file__, "rank_" + client, timeout=240)
    assert "checks passed" in output
