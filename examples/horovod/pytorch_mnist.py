"""Horovod's PyTorch MNIST example on kolo: the structure of Horovod's
examples/pytorch/pytorch_mnist.py with `import kolo.torch as hvd`, on scikit-learn's digits
(8x8 images shipped by Debian's python3-sklearn, so no download) instead of MNIST.

    build/src/kolorun -np 2 /usr/bin/python3 examples/horovod/pytorch_mnist.py --epochs 3

(PYTHONPATH=python when running from the checkout.) DistributedSampler gives each rank its
share of the data, DistributedOptimizer averages the gradients, and the test metrics are
averaged over the ranks with hvd.allreduce.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits

import kolo.torch as hvd

# Training settings
parser = argparse.ArgumentParser(description="PyTorch digits example on kolo")
parser.add_argument("--batch-size", type=int, default=32, metavar="N",
                    help="input batch size for training (default: 32)")
parser.add_argument("--test-batch-size", type=int, default=200, metavar="N",
                    help="input batch size for testing (default: 200)")
parser.add_argument("--epochs", type=int, default=10, metavar="N",
                    help="number of epochs to train (default: 10)")
parser.add_argument("--lr", type=float, default=0.05, metavar="LR",
                    help="learning rate (default: 0.05)")
parser.add_argument("--momentum", type=float, default=0.9, metavar="M",
                    help="SGD momentum (default: 0.9)")
parser.add_argument("--seed", type=int, default=42, metavar="S",
                    help="random seed (default: 42)")
parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                    help="how many batches to wait before logging training status")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction (not in kolo: refused)")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer (default: 1.0)")
args = parser.parse_args()

# Horovod: initialize library.
hvd.init()
torch.manual_seed(args.seed)

# Horovod: limit # of CPU threads to be used per worker.
torch.set_num_threads(1)

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
images = (images - images.mean()) / images.std()
labels = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
train_dataset = torch.utils.data.TensorDataset(images[order[:1400]], labels[order[:1400]])
test_dataset = torch.utils.data.TensorDataset(images[order[1400:]], labels[order[1400:]])

# Horovod: use DistributedSampler to partition the training data.
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                           sampler=train_sampler)

# Horovod: use DistributedSampler to partition the test data.
test_sampler = torch.utils.data.distributed.DistributedSampler(
    test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                          sampler=test_sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d(0.1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, p=0.1, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


model = Net()

# By default, Adasum doesn't need scaling up learning rate.
lr_scaler = hvd.size() if not args.use_adasum else 1

# Horovod: scale learning rate by lr_scaler.
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average,
                                     gradient_predivide_factor=args.gradient_predivide_factor)


def train(epoch):
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            # Horovod: use train_sampler to determine the number of examples in
            # this worker's partition.
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}",
                  flush=True)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            pred = output.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.view_as(pred)).float().sum().item()

    # Horovod: use test_sampler to determine the number of examples in
    # this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")

    # Horovod: print output only on first rank.
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, "
              f"Accuracy: {100. * test_accuracy:.2f}%\n", flush=True)


for epoch in range(1, args.epochs + 1):
    train(epoch)
    test()
