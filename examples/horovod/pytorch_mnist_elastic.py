"""Horovod's elastic PyTorch MNIST example on kolo: the structure of Horovod's
examples/elastic/pytorch/pytorch_mnist_elastic.py with `import kolo.torch as hvd`, on
scikit-learn's digits instead of MNIST. When a rank dies, the others go on from the state they
last committed (hvd.elastic.run), with the learning rate scaled to the new size.

    build/src/kolorun --elastic -np 4 /usr/bin/python3 examples/horovod/pytorch_mnist_elastic.py

(PYTHONPATH=python when running from the checkout.) kolorun --elastic keeps the job going when
a rank is killed; the state travels pickled, which kolo allows only with a job secret (kolorun
makes one). Ranks cannot be added to a running kolo job (Horovod's host discovery).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data
from sklearn.datasets import load_digits

import kolo.torch as hvd

# Training settings
parser = argparse.ArgumentParser(description="PyTorch elastic digits example on kolo")
parser.add_argument("--batch-size", type=int, default=32, metavar="N",
                    help="input batch size for training (default: 32)")
parser.add_argument("--test-batch-size", type=int, default=200, metavar="N",
                    help="input batch size for testing (default: 200)")
parser.add_argument("--epochs", type=int, default=5, metavar="N",
                    help="number of epochs to train (default: 5)")
parser.add_argument("--lr", type=float, default=0.05, metavar="LR",
                    help="learning rate (default: 0.05)")
parser.add_argument("--momentum", type=float, default=0.9, metavar="M",
                    help="SGD momentum (default: 0.9)")
parser.add_argument("--seed", type=int, default=42, metavar="S",
                    help="random seed (default: 42)")
parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                    help="how many batches to wait before logging training status")
parser.add_argument("--batches-per-commit", type=int, default=5, metavar="N",
                    help="number of batches processed before calling state.commit()")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
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

# Horovod: use an ElasticSampler to partition the training data; it re-shards what the
# committed model has not seen yet when the number of ranks changes.
train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                           sampler=train_sampler)
test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


model = Net()

# Horovod: scale learning rate by the number of ranks.
optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def check_rank(epoch):
    """Horovod's example logs the ranks at every epoch; so does this one."""
    if hvd.rank() == 0:
        print(f"epoch {epoch}: {hvd.size()} ranks", flush=True)


@hvd.elastic.run
def train(state):
    # post synchronization event (a rank lost) init ...
    while state.epoch < args.epochs:
        check_rank(state.epoch)
        state.model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            state.optimizer.zero_grad()
            output = state.model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            state.optimizer.step()
            train_sampler.record_batch(batch_idx, args.batch_size)
            state.batch += 1
            if state.batch % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {state.epoch} batch {state.batch}\t"
                      f"Loss: {loss.item():.6f}", flush=True)
            # Horovod: commit state at the end of every few batches
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        state.epoch += 1
        state.batch = 0
        train_sampler.set_epoch(state.epoch)
        state.commit()


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.view_as(pred)).float().sum().item()
    test_loss /= len(test_dataset)
    test_accuracy /= len(test_dataset)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, "
              f"Accuracy: {100. * test_accuracy:.2f}%\n", flush=True)


# adjust learning rate on reset
def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
test()
