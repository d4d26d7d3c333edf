"""Trains a small classifier on scikit-learn's digits as a Horovod user would, on kolo.

    build/src/kolorun -np 2 /usr/bin/python3 examples/pytorch_digits.py
    /usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1 --nproc_per_node 2 \\
        examples/pytorch_digits.py

(PYTHONPATH=python when running from the checkout; Debian's /usr/bin/python3 sees
python3-torch and python3-sklearn.) Each rank trains on its share of every batch; the
DistributedOptimizer averages the gradients, so every rank ends with the same model.
"""

import argparse
import hashlib

import torch
from sklearn.datasets import load_digits

import kolo.torch as hvd

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the size")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(42))
x, y = x[order], y[order]
train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]

# Every rank takes every size-th sample: the same number of batches on every rank.
per_rank = len(train_x) // hvd.size()
train_x = train_x[hvd.rank()::hvd.size()][:per_rank]
train_y = train_y[hvd.rank()::hvd.size()][:per_rank]

model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

loss_function = torch.nn.CrossEntropyLoss()
for epoch in range(args.epochs):
    model.train()
    permutation = torch.randperm(per_rank, generator=torch.Generator().manual_seed(epoch))
    total = torch.zeros(2)
    for start in range(0, per_rank - args.batch_size + 1, args.batch_size):
        batch = permutation[start:start + args.batch_size]
        optimizer.zero_grad()
        loss = loss_function(model(train_x[batch]), train_y[batch])
        loss.backward()
        optimizer.step()
        total += torch.tensor([loss.item(), 1.0])
    total = hvd.allreduce(total, op=hvd.Sum, name="epoch.loss")
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean()
    if hvd.rank() == 0:
        print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}, "
              f"test accuracy {accuracy:.3f}", flush=True)

# Every rank ends with bitwise the same parameters.
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
assert torch.equal(hvd.broadcast(flat, root_rank=0), flat), "ranks disagree"
# A digest each rank prints, for a launcher's test to compare without trusting kolo.
print(f"rank {hvd.rank()}: parameters sha256 {hashlib.sha256(flat.numpy().tobytes()).hexdigest()}",
      flush=True)
if hvd.rank() == 0:
    print(f"done: {hvd.size()} ranks, final test accuracy {accuracy:.3f}")
hvd.shutdown()
