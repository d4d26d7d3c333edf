"""Horovod's PyTorch synthetic benchmark on kolo: the structure and flags of Horovod's
examples/pytorch/pytorch_synthetic_benchmark.py, with `import kolo.torch as hvd` and a model
defined here (torchvision is not needed): images/second of training steps on random data.

    build/src/kolorun -np 2 /usr/bin/python3 examples/horovod/pytorch_synthetic_benchmark.py \\
        --model convnet --batch-size 16 --num-iters 3

(PYTHONPATH=python when running from the checkout.) CPU only unless CUDA is available; kolo's
named operations (the DistributedOptimizer's gradients) take CPU tensors.
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import kolo.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark on kolo",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="convnet", choices=["convnet", "mlp"],
                    help="model to benchmark")
parser.add_argument("--image-size", type=int, default=32, help="height and width of the images")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=5,
                    help="number of warm-up batches that don't count towards the benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=5,
                    help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction (not in kolo: refused)")
args = parser.parse_args()
# kolo's named operations (the optimizer's gradients) take CPU tensors
args.cuda = False

hvd.init()
torch.set_num_threads(1)


class ConvNet(nn.Module):
    """A small ResNet-like stack: enough layers for several gradients of several sizes."""

    def __init__(self, classes=1000):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.block1 = nn.Conv2d(16, 16, 3, padding=1)
        self.block2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(32)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = F.relu(x + self.block1(x))
        x = F.relu(self.norm(self.block2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def make_model(name):
    if name == "convnet":
        return ConvNet()
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * args.image_size ** 2, 512), nn.ReLU(),
                         nn.Linear(512, 1000))


model = make_model(args.model)

# By default, Adasum doesn't need scaling up learning rate.
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Set up fixed fake data
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % 1000


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(text):
    if hvd.rank() == 0:
        print(text, flush=True)


log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
device = "GPU" if args.cuda else "CPU"
log(f"Number of {device}s: {hvd.size()}")

log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
    img_secs.append(img_sec)

img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} "
    f"+-{hvd.size() * img_sec_conf:.1f}")
