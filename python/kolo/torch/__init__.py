"""Horovod's PyTorch API on kolo: `import kolo.torch as hvd` in a Horovod training script.

    import kolo.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Importing it also registers the torch.distributed backend "kolo", so that
torch.distributed.init_process_group("kolo") and DistributedDataParallel run on kolo. CPU tensors
throughout; GPU tensors only for the synchronous allreduce and broadcast, through
kolo's stream-ordered calls. kolo.torch.elastic is Horovod's elastic training: going on without
ranks that were lost. The README's Python section has a table of Horovod's API against this one.
"""

from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .ops import (Adasum, Average, HorovodInternalError, Max, Min, ProcessSet, Product, Sum,
                  add_process_set, allgather, allgather_async, allreduce, allreduce_,
                  allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
                  broadcast, broadcast_, broadcast_async, broadcast_async_, ccl_built,
                  cross_rank, cross_size, cuda_built, ddl_built, global_process_set,
                  gloo_built, gloo_enabled, grouped_allgather, grouped_allgather_async,
                  grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                  grouped_allreduce_async_, grouped_reducescatter, grouped_reducescatter_async,
                  init, is_initialized, join, local_rank, local_size, mpi_built, mpi_enabled,
                  mpi_threads_supported, nccl_built, poll, rank, reducescatter,
                  reducescatter_async, remove_process_set, rocm_built, shrink, shutdown, size,
                  sparse_allreduce_async, start_timeline, stop_timeline, synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from . import elastic
from . import process_group as _process_group
from kolo import __version__  # the version of libkolo, as hvd.__version__ is Horovod's

_process_group.register()

__all__ = [
    "Compression", "allgather_object", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "Adasum", "Average", "Max", "Min", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather", "allgather_async", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "cross_rank", "cross_size", "global_process_set",
    "gloo_built", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "init", "is_initialized", "join", "local_rank", "local_size",
    "mpi_built", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "remove_process_set", "shrink", "shutdown", "size", "synchronize", "DistributedOptimizer",
    "SyncBatchNorm", "elastic", "HorovodInternalError", "alltoall_async", "ccl_built",
    "cuda_built", "ddl_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "mpi_enabled", "reducescatter_async",
    "rocm_built", "sparse_allreduce_async", "start_timeline", "stop_timeline",
]
