"""torch.distributed on the "kolo" backend beside gloo, in one run: the communication of a
sharded (FSDP-style) training step and an all_to_all exchange.

    build/src/kolorun -np 4 /usr/bin/python3 bench/torch_dist_perf.py \
        [--sizes 256K,4M,32M] [--iterations 10] [--warmup 2] [--json bench/results/FILE.json]

(PYTHONPATH=python and KOLO_LIBRARY=build/capi/libkolo.so from the checkout.) The default group
is gloo; the kolo group is new_group(backend="kolo") over the same ranks; the two take turns on
every iteration, so that both see the same machine.

  sharded   one step's communication of a model whose flat float32 parameters are SIZE bytes,
            sharded over the ranks: all_gather_into_tensor of the parameter shards, then
            reduce_scatter_tensor of the gradients. torch 1.13's gloo has no reduce-scatter of
            a tensor: there the gradients are all_reduce'd and each rank keeps its shard (what
            a sharded step on gloo does), and all_gather_into_tensor falls back to all_gather
            where gloo lacks it; the `gloo method` column says which ran.
  alltoall  all_to_all_single of SIZE bytes of float32 per rank, even splits.

Time is the slowest rank's, the median over the iterations (milliseconds); every result is
checked against its reference once.
"""

import argparse
import json
import statistics
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import kolo
import kolo.torch  # noqa: F401  registers "kolo"


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def try_call(call, fallback):
    """call(); where the backend refuses it, fallback(). Returns the name of what ran."""
    try:
        call()
        return "native"
    except RuntimeError as error:
        if "support" not in str(error):
            raise
        fallback()
        return "fallback"


def sharded_step(group, shard, full, grads, grad_shard, methods):
    n, me = dist.get_world_size(group), dist.get_rank(group)

    def gather_list():
        pieces = list(full.chunk(n))
        dist.all_gather(pieces, shard, group=group)

    def reduce_by_allreduce():
        dist.all_reduce(grads, group=group)
        grad_shard.copy_(grads.chunk(n)[me])

    if methods.get("gather") != "fallback":
        methods["gather"] = try_call(
            lambda: dist.all_gather_into_tensor(full, shard, group=group), gather_list)
    else:
        gather_list()
    if methods.get("reduce") != "fallback":
        methods["reduce"] = try_call(
            lambda: dist.reduce_scatter_tensor(grad_shard, grads, group=group),
            reduce_by_allreduce)
    else:
        reduce_by_allreduce()


def slowest(seconds, group):
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256K,4M,32M")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results there (rank 0)")
    args = parser.parse_args()

    world = kolo.init()
    store = dist.TCPStore("127.0.0.1", 0, world.size, True, timeout=timedelta(seconds=120),
                          wait_for_workers=False) if world.rank == 0 else None
    port = int(world.broadcast(np.array([store.port if store else 0], np.int64), root=0)[0])
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world.size, False,
                              timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=world.rank, world_size=world.size)
    groups = {"gloo": dist.group.WORLD, "kolo": dist.new_group(backend="kolo")}
    n, me = world.size, world.rank
    torch.set_num_threads(1)

    rows = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        elements = max(n, size // 4 // n * n)
        per_rank = elements // n
        # The sharded step: parameters i * 1e-3 (shard r holds its block), gradients rank + 1.
        shard = torch.arange(me * per_rank, (me + 1) * per_rank, dtype=torch.float32) * 1e-3
        grads = torch.full((elements,), float(me + 1))
        times = {"sharded": {}, "alltoall": {}}
        methods = {"gloo": {}, "kolo": {}}
        source = torch.arange(elements, dtype=torch.float32) + me * elements
        expected_a2a = torch.cat([torch.arange(me * per_rank, (me + 1) * per_rank,
                                               dtype=torch.float32) + r * elements
                                  for r in range(n)])
        expected_full = torch.arange(elements, dtype=torch.float32) * 1e-3
        for name in groups:
            times["sharded"][name] = []
            times["alltoall"][name] = []
        for iteration in range(args.warmup + args.iterations):
            for name, group in groups.items():
                full = torch.empty(elements)
                grad_shard = torch.empty(per_rank)
                work_grads = grads.clone()
                dist.barrier(group=group)
                start = time.perf_counter()
                sharded_step(group, shard, full, work_grads, grad_shard, methods[name])
                took = slowest(time.perf_counter() - start, group)
                if iteration == 0:
                    assert torch.equal(full, expected_full), f"{name}: parameters gathered wrong"
                    assert torch.equal(grad_shard, torch.full((per_rank,),
                                                              float(n * (n + 1) // 2))), \
                        f"{name}: gradients reduced wrong"
                if iteration >= args.warmup:
                    times["sharded"][name].append(took)
                out = torch.empty(elements)
                dist.barrier(group=group)
                start = time.perf_counter()
                dist.all_to_all_single(out, source, group=group)
                took = slowest(time.perf_counter() - start, group)
                if iteration == 0:
                    assert torch.equal(out, expected_a2a), f"{name}: all_to_all wrong"
                if iteration >= args.warmup:
                    times["alltoall"][name].append(took)
        for kind in ("sharded", "alltoall"):
            gloo_ms = statistics.median(times[kind]["gloo"]) * 1e3
            kolo_ms = statistics.median(times[kind]["kolo"]) * 1e3
            gloo_method = "-"
            if kind == "sharded":
                gloo_method = ("all_gather_into_tensor" if methods["gloo"]["gather"] == "native"
                               else "all_gather") + " + " + (
                    "reduce_scatter_tensor" if methods["gloo"]["reduce"] == "native"
                    else "all_reduce")
            rows.append({"test": kind, "bytes": elements * 4, "ranks": n,
                         "gloo_ms": round(gloo_ms, 3), "kolo_ms": round(kolo_ms, 3),
                         "kolo_speedup": round(gloo_ms / kolo_ms, 2),
                         "gloo_method": gloo_method})
    if me == 0:
        print(f"{'test':>9} {'bytes':>10} {'gloo ms':>9} {'kolo ms':>9} {'gloo/kolo':>9}  "
              f"gloo method")
        for row in rows:
            print(f"{row['test']:>9} {row['bytes']:>10} {row['gloo_ms']:>9.3f} "
                  f"{row['kolo_ms']:>9.3f} {row['kolo_speedup']:>9.2f}  {row['gloo_method']}")
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"ranks": n, "iterations": args.iterations, "rows": rows}, out,
                          indent=1)
                out.write("\n")
    dist.barrier(group=groups["kolo"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
