"""A training step's gradient communication from Python, three ways in one run.

    build/src/kolorun -np 2 /usr/bin/python3 bench/python_step_perf.py \
        [--model resnet50,bert-base] [--steps 5] [--warmup 1] [--max-tensor-bytes 1M]

(PYTHONPATH=python from the checkout.) The gradients are those of bench/fusion_perf (the
parameter shapes of torchvision's ResNet-50 and Hugging Face's bert-base, in definition order),
as the parameters of a model whose backward pass only writes a gradient per parameter. Each step
takes turns between:
  kolo-hooks   kolo.torch.DistributedOptimizer: its hooks submit each gradient by name as
               backpropagation produces it; step = backward + optimizer.synchronize();
  ddp-gloo     DistributedDataParallel on torch's own gloo backend (TCP), default buckets;
  ddp-kolo     DistributedDataParallel on the "kolo" torch.distributed backend;
  local        the same backward pass without any communication.
Time is the slowest rank's step, the median over the measured steps; comm = step - local (the
communication a step adds). The `vs gloo` column is ddp-gloo's comm time over this method's;
`hooks ms` is the wall time spent in the DistributedOptimizer's submissions during a step
(Python, ctypes and kolo's submit call), the slowest rank's median.
"""

import argparse
import statistics
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import kolo
import kolo.torch as hvd


def resnet(blocks_per_stage):
    shapes = [("conv1.weight", 64 * 3 * 7 * 7), ("bn1.weight", 64), ("bn1.bias", 64)]
    channels_in = 64
    for stage, blocks in enumerate(blocks_per_stage):
        planes = 64 << stage
        out = planes * 4
        for block in range(blocks):
            prefix = f"layer{stage + 1}.{block}"

            def batch_norm(name, channels):
                shapes.extend([(f"{prefix}.{name}.weight", channels),
                               (f"{prefix}.{name}.bias", channels)])
            shapes.append((f"{prefix}.conv1.weight", planes * channels_in))
            batch_norm("bn1", planes)
            shapes.append((f"{prefix}.conv2.weight", planes * planes * 9))
            batch_norm("bn2", planes)
            shapes.append((f"{prefix}.conv3.weight", out * planes))
            batch_norm("bn3", out)
            if block == 0:
                shapes.append((f"{prefix}.downsample.0.weight", out * channels_in))
                batch_norm("downsample.1", out)
            channels_in = out
    shapes.extend([("fc.weight", 1000 * channels_in), ("fc.bias", 1000)])
    return shapes


def bert_base():
    hidden, intermediate = 768, 3072
    shapes = [("embeddings.word_embeddings.weight", 30522 * hidden),
              ("embeddings.position_embeddings.weight", 512 * hidden),
              ("embeddings.token_type_embeddings.weight", 2 * hidden),
              ("embeddings.LayerNorm.weight", hidden), ("embeddings.LayerNorm.bias", hidden)]

    def dense(name, n_in, n_out):
        shapes.extend([(name + ".weight", n_out * n_in), (name + ".bias", n_out)])

    def layer_norm(name):
        shapes.extend([(name + ".weight", hidden), (name + ".bias", hidden)])
    for layer in range(12):
        prefix = f"encoder.layer.{layer}"
        for part in ("query", "key", "value"):
            dense(f"{prefix}.attention.self.{part}", hidden, hidden)
        dense(f"{prefix}.attention.output.dense", hidden, hidden)
        layer_norm(f"{prefix}.attention.output.LayerNorm")
        dense(f"{prefix}.intermediate.dense", hidden, intermediate)
        dense(f"{prefix}.output.dense", intermediate, hidden)
        layer_norm(f"{prefix}.output.LayerNorm")
    dense("pooler.dense", hidden, hidden)
    return shapes


MODELS = {"resnet50": lambda: resnet([3, 4, 6, 3]), "bert-base": bert_base}


class GradientModel(torch.nn.Module):
    """Parameters of the given element counts; forward(scale) is a sum that uses each once, in
    definition order, so backward writes every gradient, the last parameters' first."""

    def __init__(self, shapes):
        super().__init__()
        self.names = [name for name, _ in shapes]
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(count)) for _, count in shapes])

    def forward(self, scale):
        total = scale * 0
        for weight in self.weights:
            total = total + weight.sum() * scale
        return total

    def named_gradients(self):
        return [(name, weight) for name, weight in zip(self.names, self.weights)]


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def slowest(seconds, world):
    return float(world.allreduce(np.array([seconds]), op=kolo.MAX)[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50,bert-base")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-tensor-bytes", default=None,
                        help="keep only gradients smaller than this (e.g. 1M)")
    args = parser.parse_args()

    hvd.init()
    world = kolo.world()
    # torch.distributed's store on a port the kernel picks, announced through kolo.
    store = dist.TCPStore("127.0.0.1", 0, world.size, True, timeout=timedelta(seconds=120),
                          wait_for_workers=False) if world.rank == 0 else None
    port = int(world.broadcast(np.array([store.port if store else 0], np.int64))[0])
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world.size, False,
                              timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=world.rank, world_size=world.size)
    kolo_group = dist.new_group(backend="kolo")
    gloo_group = dist.group.WORLD

    if world.rank == 0:
        print(f"# N = {world.size}, {args.steps} measured steps after {args.warmup} warm-up, "
              f"median of the slowest rank; torch {torch.__version__}")
        print(f"{'model':<22}{'tensors':>8}{'MB':>8}  {'method':<11}{'step ms':>9}"
              f"{'comm ms':>9}{'vs gloo':>9}{'hooks ms':>9}")
    for model_name in args.model.split(","):
        shapes = MODELS[model_name]()
        if args.max_tensor_bytes:
            limit = parse_bytes(args.max_tensor_bytes)
            shapes = [(n, c) for n, c in shapes if 4 * c < limit]
        megabytes = 4 * sum(c for _, c in shapes) / 1e6
        scale = torch.ones((), requires_grad=False)

        local = GradientModel(shapes)
        hooked = GradientModel(shapes)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(hooked.parameters(), lr=0.0),
                                             named_parameters=hooked.named_gradients())
        ddp_gloo = torch.nn.parallel.DistributedDataParallel(GradientModel(shapes),
                                                             process_group=gloo_group)
        ddp_kolo = torch.nn.parallel.DistributedDataParallel(GradientModel(shapes),
                                                             process_group=kolo_group)

        def step_local():
            local.zero_grad(set_to_none=False)
            local(scale).backward()

        # The wall time spent in the hooks' submissions (Python, ctypes and kolo's submit call).
        submitting = [0.0]
        submit = optimizer._submit

        def timed_submit(p):
            start = time.perf_counter()
            try:
                return submit(p)
            finally:
                submitting[0] += time.perf_counter() - start
        optimizer._submit = timed_submit
        hook_times = []

        def step_hooks():
            submitting[0] = 0.0
            optimizer.zero_grad(set_to_none=False)
            hooked(scale).backward()
            optimizer.synchronize()
            hook_times.append(submitting[0])

        def step_ddp(module):
            def run():
                module.zero_grad(set_to_none=False)
                module(scale).backward()
            return run

        methods = {"local": step_local, "kolo-hooks": step_hooks,
                   "ddp-gloo": step_ddp(ddp_gloo), "ddp-kolo": step_ddp(ddp_kolo)}
        times = {name: [] for name in methods}
        for step in range(args.warmup + args.steps):
            for name, run in methods.items():
                world.barrier()
                start = time.perf_counter()
                run()
                elapsed = slowest(time.perf_counter() - start, world)
                if step >= args.warmup:
                    times[name].append(elapsed)
        median = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        hooks_ms = slowest(statistics.median(hook_times[args.warmup:]), world) * 1e3
        comm = {name: max(median[name] - median["local"], 1e-9) for name in median}
        if world.rank == 0:
            label = model_name + (f" < {args.max_tensor_bytes}" if args.max_tensor_bytes else "")
            for name in ("local", "kolo-hooks", "ddp-gloo", "ddp-kolo"):
                ratio = "" if name == "local" else f"{comm['ddp-gloo'] / comm[name]:.2f}x"
                hooks = f"{hooks_ms:.1f}" if name == "kolo-hooks" else ""
                print(f"{label:<22}{len(shapes):>8}{megabytes:>8.1f}  {name:<11}"
                      f"{median[name]:>9.1f}{'' if name == 'local' else f'{comm[name]:.1f}':>9}"
                      f"{ratio:>9}{hooks:>9}", flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
