"""The torch.distributed backend "kolo": a ProcessGroup written in Python (torch 1.13 lets Python
subclasses implement allreduce, broadcast, allgather, barrier, reduce_scatter, send and recv),
each operation an ordered kolo collective on a communicator of the group's own.

Rendezvous: torch hands the backend its store (torchrun's, or the one init_process_group made
at MASTER_ADDR:MASTER_PORT, which already listens on MASTER_PORT). Rank 0 of the group picks a
free port for kolo's own rendezvous store and a random job secret and publishes both in torch's
store; every rank then joins kolo there.

Completion: every operation runs to the end inside the call (the GIL released while kolo works)
and returns a Work whose future is already complete. Nothing is left to a Python thread that
would need the GIL to complete a future while torch waits for it in C++ holding the GIL
(which would deadlock); the price is that DistributedDataParallel's reductions do not overlap
backpropagation. isend/irecv are therefore blocking too: two ranks that both isend before
their irecv cannot proceed (kolo's sends are synchronous; order such exchanges).
"""

import os
import secrets
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from ..communicator import Communicator, kolo_dtype_of
from ..errors import InvalidArgumentError, UnsupportedError
from ._convert import as_array, check_tensor

_OPS = {}


def _reduce_op(op):
    if not _OPS:
        from .. import communicator as c
        _OPS.update({dist.ReduceOp.SUM: c.SUM, dist.ReduceOp.MIN: c.MIN,
                     dist.ReduceOp.MAX: c.MAX, dist.ReduceOp.PRODUCT: c.PROD})
        if hasattr(dist.ReduceOp, "AVG"):
            _OPS[dist.ReduceOp.AVG] = c.AVG
    for key, value in _OPS.items():
        if op == key:
            return value
    raise UnsupportedError(f"the kolo backend reduces with SUM, AVG, MIN, MAX and PRODUCT, not "
                           f"{op}")


def _CompletedWork(result=None):
    """A Work whose operation has already finished (failures raise in the call itself): torch's
    own work around a completed future, so that C++ callers see wait() and get_future() of a
    finished operation without calling back into Python."""
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _tensors(tensors, what):
    for tensor in tensors:
        check_tensor(tensor, what)
        if not tensor.is_contiguous():
            raise InvalidArgumentError(f"{what} must be contiguous for the kolo backend")
    return tensors


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class ProcessGroupKolo(dist.ProcessGroup):
    """A torch.distributed process group on a kolo communicator. Made by
    torch.distributed.init_process_group("kolo") or new_group(backend="kolo"); every operation
    blocks until it has finished on this rank (bounded by the timeout given to
    init_process_group) and raises kolo's errors (MismatchError, PeerLostError, ...)."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        if rank == 0:
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            store.set("kolo/addr", f"{host}:{_free_port()}")
            store.set("kolo/secret", secrets.token_hex(16))
        address = store.get("kolo/addr").decode()
        secret = store.get("kolo/secret").decode()
        self._comm = Communicator.create(rank=rank, size=size, addr=address, secret=secret,
                                         timeout=timeout_s)

    def getBackendName(self):
        """"kolo"."""
        return "kolo"

    _get_backend_name = getBackendName

    def allreduce(self, tensors, opts=None):
        """Reduces each tensor in place with opts.reduceOp (SUM, AVG, MIN, MAX, PRODUCT). Blocks
        until done; returns a completed Work."""
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for tensor in _tensors(tensors, "allreduce tensor"):
            array, dtype = as_array(tensor)
            self._comm.allreduce_(array, op=op, dtype=dtype)
        return _CompletedWork(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        """As allreduce, one tensor after the other."""
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        """Copies opts.rootRank's tensors into every rank's, in place. Blocks until done."""
        root = opts.rootRank if opts is not None else 0
        for tensor in _tensors(tensors, "broadcast tensor"):
            array, dtype = as_array(tensor)
            self._comm.broadcast_(array, root=root, dtype=dtype)
        return _CompletedWork(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """Fills output_tensors[i][r] with rank r's input_tensors[i] (same shapes on every
        rank). Blocks until done."""
        for outputs, tensor in zip(output_tensors, _tensors(input_tensors, "allgather tensor")):
            if len(outputs) != self._comm.size:
                raise InvalidArgumentError(f"allgather needs {self._comm.size} output tensors, "
                                           f"not {len(outputs)}")
            gathered = torch.empty((self._comm.size,) + tuple(tensor.shape), dtype=tensor.dtype)
            send, dtype = as_array(tensor)
            receive, _ = as_array(gathered)
            self._comm.raw_allgatherv(send.ctypes.data if send.size else None,
                                      receive.ctypes.data if receive.size else None,
                                      [send.size] * self._comm.size,
                                      kolo_dtype_of(send, dtype))
            for r, output in enumerate(outputs):
                output.copy_(gathered[r])
        return _CompletedWork(output_tensors)

    def _allgather_base(self, output, input, opts=None):
        """allgather into one tensor of size x input's shape (rank order). Blocks."""
        self.allgather([list(output.chunk(self._comm.size))], [input], opts)
        return _CompletedWork(output)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """output_tensors[i] receives the reduction over the ranks of their
        input_tensors[i][rank]. Blocks until done."""
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for output, inputs in zip(_tensors(output_tensors, "reduce_scatter output"),
                                  input_tensors):
            stacked = torch.stack([t.reshape(output.shape) for t in inputs]).contiguous()
            array, dtype = as_array(stacked)
            target, _ = as_array(output)
            self._comm.raw_reduce_scatterv(
                array.ctypes.data if array.size else None,
                target.ctypes.data if target.size else None, [output.numel()] * self._comm.size,
                kolo_dtype_of(array, dtype), op)
        return _CompletedWork(output_tensors)

    def barrier(self, opts=None):
        """Returns once every rank of the group has entered it."""
        self._comm.barrier()
        return _CompletedWork()

    def send(self, tensors, dst_rank, tag=0):
        """Sends each tensor to dst_rank (kolo_send: blocks until the receiver has it)."""
        for tensor in _tensors(tensors, "send tensor"):
            array, dtype = as_array(tensor)
            self._comm.send(array, dst_rank, tag=tag, dtype=dtype)
        return _CompletedWork()

    def recv(self, tensors, src_rank, tag=0):
        """Receives each tensor from src_rank (same shapes, dtype and tag). Blocks."""
        for tensor in _tensors(tensors, "recv tensor"):
            array, dtype = as_array(tensor)
            self._comm.recv(array, src_rank, tag=tag, dtype=dtype)
        return _CompletedWork(tensors)

    def shutdown(self):
        """Closes the kolo communicator of the group."""
        self._comm.shutdown()


def _create(store, rank, size, timeout):
    return ProcessGroupKolo(store, rank, size, timeout)


def register():
    """Registers "kolo" with torch.distributed (done by `import kolo.torch`; harmless twice)."""
    if "KOLO" not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend("kolo", _create)
