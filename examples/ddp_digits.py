"""The digits classifier with torch's DistributedDataParallel on the "kolo" backend.

    /usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1 --nproc_per_node 2 \\
        examples/ddp_digits.py

(PYTHONPATH=python from the checkout.) `import kolo.torch` registers the backend; the rest is
plain torch.distributed.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import kolo.torch  # noqa: F401  registers the "kolo" backend

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=20)
args = parser.parse_args()

dist.init_process_group("kolo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target, dtype=torch.int64)
train = TensorDataset(x[:1500], y[:1500])
sampler = DistributedSampler(train, num_replicas=size, rank=rank, drop_last=True)
loader = DataLoader(train, batch_size=32, sampler=sampler)

model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * size, momentum=0.9)
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for batch_x, batch_y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(batch_x), batch_y).backward()
        optimizer.step()
    with torch.no_grad():
        correct = torch.tensor([(model(x[1500:]).argmax(1) == y[1500:]).sum().item()],
                               dtype=torch.int64)
    dist.all_reduce(correct)  # the same on every rank: a check that they agree
    if rank == 0:
        print(f"epoch {epoch + 1}: test accuracy {correct.item() / size / len(y[1500:]):.3f}",
              flush=True)
# Every rank ends with the same parameters; the digest lets a launcher's test compare them.
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print(f"rank {rank}: parameters sha256 {hashlib.sha256(flat.numpy().tobytes()).hexdigest()}",
      flush=True)
dist.destroy_process_group()
