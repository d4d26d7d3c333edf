"""Horovod's PyTorch operations on kolo: the same names, signatures and semantics, on CPU tensors.

How calls map onto kolo:
  - a synchronous operation without a name (allreduce(t), broadcast(t, 0), ...) is an ordered
    kolo collective: every rank makes the same calls in the same order, as they do in a training
    script. Before it, the ranks agree on what they are about to do (_agree: a small named
    allgather of each rank's operation, dtype, shape, op and root through kolo's fusion engine).
    Ranks that disagree (one passes a tensor of another shape, or calls another operation) get
    MismatchError on every rank and nothing reaches the ordered path, so the calls after it run
    normally, as in Horovod, where one bad tensor fails that tensor only. The agreement also
    shows which ranks have joined (join()): an allreduce then runs through the fusion engine
    with zeros for them, and allgather, broadcast, alltoall, reducescatter and barrier raise, as
    Horovod's do;
  - a synchronous operation with a name, and every asynchronous one, is a named operation of
    kolo's fusion engine: ranks may submit in any order, tensors are fused, and a tensor that
    ranks submit differently fails with MismatchError naming it on every rank. Unnamed
    asynchronous operations get automatic names ("allreduce.noname.7"), which requires every
    rank to submit its unnamed operations in the same order, as in Horovod.
Synchronous out-of-place operations are autograd functions whose gradients are Horovod's.
"""

import itertools
import zlib

import numpy as np
import torch

import kolo
from .. import _capi
from ..errors import InvalidArgumentError, UnsupportedError
from ._convert import KOLO_DTYPES, as_array, check_tensor, from_array

Sum = kolo.SUM
Average = kolo.AVG
Min = kolo.MIN
Max = kolo.MAX
Product = kolo.PROD
Adasum = "Adasum"  # named so that scripts that mention it import; using it raises


# ---- process sets ------------------------------------------------------------------------------

class ProcessSet:
    """A subset of the ranks that runs collectives of its own (Horovod's ProcessSet), backed by a
    kolo sub-communicator. Make it with ProcessSet(ranks), then register it on every rank with
    init(process_sets=[...]) or add_process_set(); pass it as process_set= to operations."""

    def __init__(self, ranks=None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = None
        self._comm = None

    def _bind(self, comm, ranks, process_set_id):
        self._comm = comm
        self.ranks = ranks
        self.process_set_id = process_set_id

    def included(self):
        """True if this rank belongs to the set. Raises ValueError if the set is not
        registered."""
        self._registered()
        return self._comm is not None

    def size(self):
        """The number of ranks in the set."""
        self._registered()
        return len(self.ranks)

    def rank(self):
        """This rank's index in the set; ValueError if it is not a member."""
        return self.communicator().rank

    def _registered(self):
        if self.process_set_id is None:
            raise ValueError("this process set is not registered: pass it to "
                             "kolo.torch.init(process_sets=...) or add_process_set() first")

    def communicator(self):
        """The kolo Communicator of the set (for this rank). Raises ValueError when the set is
        not registered or this rank is not a member."""
        self._registered()
        if self._comm is None or self._comm.closed:
            raise ValueError(f"rank {kolo.rank()} is not a member of the process set "
                             f"{self.ranks}")
        return self._comm

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
_process_sets = {}
_cross = {"size": 1, "rank": 0}


def init(comm=None, process_sets=None):
    """Joins the job (kolo.init(): KOLO_* variables, kolorun, mpirun, srun or torchrun) and
    registers the process sets given. comm (an MPI communicator or a list of ranks in Horovod) is
    not supported: start the ranks that should train together. Blocks until every rank has
    joined, bounded by KOLO_TIMEOUT."""
    if comm is not None:
        raise NotImplementedError("kolo.torch.init(comm=...) is not supported: kolo joins every "
                                  "rank the launcher started; use a ProcessSet for a subset")
    world = kolo.init()
    if global_process_set.process_set_id is None or global_process_set._comm is not world:
        _bind_world(world)
    for process_set in process_sets or []:
        add_process_set(process_set)


def _bind_world(world):
    """Makes world the communicator of the global process set (the only one registered) and
    counts the nodes: a collective on world."""
    global_process_set._bind(world, list(range(world.size)), 0)
    _process_sets.clear()
    _process_sets[0] = global_process_set
    # cross rank/size: the nodes, counted by the ranks that are first on their node
    firsts = world.allgather(np.array([1 if world.local_rank == 0 else 0], np.int64))
    _cross["size"] = max(1, int(firsts.sum()))
    _cross["rank"] = max(0, int(firsts[:world.rank + 1].sum()) - 1)


def shrink():
    """Goes on without the ranks that were lost: replaces the world by its surviving ranks
    (kolo.shrink(), kolo_comm_shrink), ranked in their old order, and makes every later kolo.torch
    call (rank(), size(), the operations, DistributedOptimizer) use it. Every surviving rank calls
    it, after an operation raised PeerLostError or KoloTimeoutError; kolo.torch.elastic.run does
    it for you. Pending operations of the old world are abandoned: their handles raise
    PeerLostError (also one submitted while the fusion engine was still connecting to the lost
    rank), and every DistributedOptimizer forgets the gradients it had submitted (zero the
    gradients and compute them again). Process sets other than the global one are removed and
    their communicators shut down (their ranks numbered the old world): add them again. Blocks
    while the survivors agree (at most about three times KOLO_TIMEOUT) and for one allgather on
    the new world. Raises PeerLostError or KoloTimeoutError when this rank was left out or the
    shrink must be tried again (the old world then stays, broken, and shrink() may be called
    again); ValueError before init(). Returns the new size."""
    _world()
    from .optimizer import _forget_pending_gradients
    _forget_pending_gradients()  # before the old world goes, which frees their requests
    kolo.shrink()
    for process_set in list(_process_sets.values()):
        if process_set is not global_process_set:
            remove_process_set(process_set)
    _bind_world(kolo.world())
    return kolo.world().size


def add_process_set(process_set):
    """Registers a ProcessSet (or a list of ranks) on every rank: a collective on all ranks, which
    must pass the same ranks in the same order of calls. Returns the ProcessSet. Blocks until
    every member has connected. Raises ValueError for ranks out of range or repeated, and
    MismatchError when ranks pass different sets."""
    world = _world()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = process_set.ranks
    if ranks is None or not ranks or len(set(ranks)) != len(ranks) or \
            any(r < 0 or r >= world.size for r in ranks):
        raise ValueError(f"a process set needs distinct ranks in [0, {world.size}), not {ranks}")
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is already registered")
    digest = np.array([zlib.crc32(np.array(ranks, np.int64).tobytes())], np.int64)
    everyone = world.allgather(digest)
    if np.any(everyone != everyone[0]):
        differ = [r for r in range(world.size) if everyone[r] != everyone[0]]
        raise kolo.MismatchError(f"add_process_set: ranks {differ} passed other ranks than "
                                 f"rank 0 (this rank passed {ranks})")
    member = world.rank in ranks
    comm = world.split(0 if member else kolo.COLOR_NONE, ranks.index(world.rank) if member
                       else 0)
    process_set_id = max(_process_sets) + 1
    process_set._bind(comm, ranks, process_set_id)
    _process_sets[process_set_id] = process_set
    return process_set


def remove_process_set(process_set):
    """Unregisters a process set and closes its communicator (on every rank). Returns True if it
    was registered. Does not block."""
    if process_set is global_process_set:
        raise ValueError("the global process set cannot be removed")
    if _process_sets.pop(process_set.process_set_id, None) is None:
        return False
    if process_set._comm is not None:
        process_set._comm.shutdown()
    process_set._bind(None, process_set.ranks, None)
    return True


def _world():
    if not kolo.is_initialized():
        raise ValueError("kolo.torch has not been initialised; call kolo.torch.init() first")
    return kolo.world()


def _comm(process_set):
    _world()
    return (process_set or global_process_set).communicator()


def shutdown():
    """Leaves the job (closes every communicator). Pending operations fail with
    CancelledError."""
    for process_set in list(_process_sets.values()):
        if process_set is not global_process_set and process_set._comm is not None:
            process_set._comm.shutdown()
    _process_sets.clear()
    global_process_set._bind(None, None, None)
    kolo.shutdown()


def is_initialized():
    """True between init() and shutdown()."""
    return kolo.is_initialized()


def size():
    """The number of ranks."""
    return _world().size


def rank():
    """This process's rank."""
    return _world().rank


def local_size():
    """The number of ranks on this machine."""
    return _world().local_size


def local_rank():
    """This process's rank on its machine."""
    return _world().local_rank


def cross_size():
    """The number of machines (nodes) of the job."""
    _world()
    return _cross["size"]


def cross_rank():
    """This rank's node index (ranks are assumed to be numbered node by node, as launchers do)."""
    _world()
    return _cross["rank"]


def mpi_threads_supported():
    """kolo needs no MPI: always False (there is no MPI underneath)."""
    return False


def mpi_built():
    """False: kolo does not use MPI (it starts under mpirun all the same)."""
    return False


def gloo_built():
    """False: kolo has its own transports (torch's gloo is separate)."""
    return False


def nccl_built():
    """Whether libkolo was built with NCCL is not exposed by the C ABI; False."""
    return False


def mpi_enabled():
    """False: kolo runs no MPI (Horovod's suite asks before testing MPI-only features)."""
    return False


def gloo_enabled():
    """False: kolo's own transports carry the collectives, not Gloo."""
    return False


def ccl_built():
    """False: kolo has no oneCCL backend."""
    return False


def ddl_built():
    """False: kolo has no IBM DDL backend."""
    return False


def cuda_built():
    """Whether torch can see CUDA (kolo's GPU calls need it); kolo's own build is not asked."""
    return torch.cuda.is_available()


def rocm_built():
    """False: kolo has no ROCm support."""
    return False


def start_timeline(file_path, mark_cycles=False):
    """Horovod's run-time timeline is not in kolo: raises UnsupportedError. kolo writes a
    Chrome-trace timeline of the whole run to the file KOLO_TIMELINE (or HOROVOD_TIMELINE) names
    when the job starts."""
    raise UnsupportedError("start_timeline: kolo's timeline cannot be started from the program; "
                           "set KOLO_TIMELINE (or HOROVOD_TIMELINE) to a file before the job "
                           "starts")


def stop_timeline():
    """Horovod's run-time timeline is not in kolo: raises UnsupportedError (see
    start_timeline)."""
    raise UnsupportedError("stop_timeline: kolo's timeline cannot be stopped from the program; "
                           "it covers the whole run of a job started with KOLO_TIMELINE set")


# Horovod raises HorovodInternalError when a collective fails; kolo raises a KoloError subclass
# naming what failed, so the two names are one class and `except HorovodInternalError` catches
# every kolo failure.
HorovodInternalError = kolo.KoloError


# ---- helpers -----------------------------------------------------------------------------------

def _resolve_op(average, op):
    if average is not None:
        if op is not None:
            raise ValueError("average and op cannot both be given; op=Average replaces average")
        return Average if average else Sum
    if op is None:
        return Average
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented in kolo; use Average or Sum")
    if op not in (Sum, Average, Min, Max, Product):
        raise InvalidArgumentError(f"unknown op {op!r}: use Sum, Average, Min, Max or Product")
    return op


class _Handle:
    """The handle of an asynchronous kolo.torch operation: poll(handle) and synchronize(handle)
    (or handle.poll(), handle.wait()). wait() returns the output tensor."""

    def __init__(self, inner, finish):
        self._inner = inner
        self._finish = finish
        self._done = False
        self._value = None

    def poll(self):
        """True once the operation has completed. Never blocks."""
        return self._inner.poll()

    def wait(self):
        """Blocks (bounded by KOLO_TIMEOUT) and returns the output; raises its KoloError."""
        if not self._done:
            self._value = self._finish(self._inner.wait())
            self._done = True
        return self._value

    synchronize = wait


def poll(handle):
    """True if the asynchronous operation of handle has completed. Never blocks."""
    return handle.poll()


def synchronize(handle):
    """Waits for the asynchronous operation of handle (bounded by KOLO_TIMEOUT) and returns its
    output tensor. Raises its KoloError (e.g. MismatchError naming the tensor and the ranks)."""
    return handle.wait()


def _require_tensor(tensor, what="tensor"):
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    return tensor


def _contiguous_target(tensor):
    """A contiguous tensor (outside autograd) sharing tensor's memory where it can, and a
    function that copies it back into tensor when it could not and returns tensor."""
    base = tensor.detach()
    if base.is_contiguous():
        return base, lambda *_: tensor
    work = base.contiguous()

    def copy_back(*_):
        base.copy_(work)
        return tensor
    return work, copy_back


def _device_allreduce(tensor, output, op, prescale, postscale, comm):
    """allreduce of a GPU tensor with kolo's stream-ordered call on torch's current stream."""
    kind = _convert_dtype(tensor)
    stream = torch.cuda.current_stream(tensor.device).cuda_stream
    comm._check(_capi.lib.kolo_allreduce_scaled_on_stream(
        comm._live(), tensor.data_ptr(), output.data_ptr(), tensor.numel(), kind, op,
        float(prescale), float(postscale), stream))
    return output


def _device_broadcast(tensor, root, comm):
    kind = _convert_dtype(tensor)
    stream = torch.cuda.current_stream(tensor.device).cuda_stream
    comm._check(_capi.lib.kolo_broadcast_on_stream(comm._live(), tensor.data_ptr(),
                                                    tensor.numel(), kind, int(root), stream))
    return tensor


def _convert_dtype(tensor):
    if tensor.dtype not in KOLO_DTYPES:
        raise InvalidArgumentError(f"tensor has dtype {tensor.dtype}, which kolo does not have")
    return KOLO_DTYPES[tensor.dtype]


# ---- agreement before an ordered collective --------------------------------------------------

# Descriptor of one rank's ordered call, as int64: its rank, the operation, the dtype, the op, the
# root, the number of dimensions, the first eight dimensions (-1 beyond), a CRC of the whole shape.
_KINDS = {"allreduce": 1, "broadcast": 2, "allgather": 3, "alltoall": 4, "reducescatter": 5,
          "barrier": 6}
_KIND_NAMES = {code: name for name, code in _KINDS.items()}
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_SHOWN_DIMS = 8
_FIELDS = 6 + _SHOWN_DIMS + 1


def _describe_call(rank, kind, dtype, shape, op, root, first_dim_free):
    shape = list(shape)
    if first_dim_free and shape:
        shape[0] = -2  # allgather, alltoall: first dimensions may differ
    row = np.full(_FIELDS, -1, np.int64)
    row[:6] = [rank, _KINDS[kind], _DTYPES.index(dtype) if dtype in _DTYPES else
               100 + zlib.crc32(str(dtype).encode()) % 1000, int(op), int(root), len(shape)]
    row[6:6 + min(len(shape), _SHOWN_DIMS)] = shape[:_SHOWN_DIMS]
    row[-1] = zlib.crc32(np.array(shape, np.int64).tobytes())
    return row


def _call_text(row):
    kind = _KIND_NAMES.get(int(row[1]), "an operation")
    if kind == "barrier":
        return "barrier"
    dtype = _DTYPES[row[2]] if 0 <= row[2] < len(_DTYPES) else "another dtype"
    dims = [int(d) for d in row[6:6 + min(int(row[5]), _SHOWN_DIMS)]]
    shape = "[" + ", ".join("*" if d == -2 else str(d) for d in dims) + \
        (", ..." if row[5] > _SHOWN_DIMS else "") + "]"
    text = f"{kind} of {str(dtype).replace('torch.', '')} {shape}"
    if kind in ("allreduce", "reducescatter"):
        text += f" ({kolo.OP_NAMES.get(int(row[3]), int(row[3]))})"
    if kind == "broadcast":
        text += f" from rank {int(row[4])}"
    return text


def _agree(comm, kind, tensor=None, op=0, root=-1, first_dim_free=False):
    """Every rank of comm states the ordered call it is about to make (a named allgather of a
    small descriptor through kolo's fusion engine, which completes even when ranks disagree) and
    checks that all agree. Returns the ranks that have joined (join()), which contribute nothing.
    Raises MismatchError on every rank that took part when the descriptors differ, naming each
    rank's call. Blocks (bounded by KOLO_TIMEOUT)."""
    if comm.size == 1:  # nobody to disagree with, nobody to have joined
        return []
    shape = () if tensor is None else tuple(tensor.shape)
    dtype = None if tensor is None else tensor.dtype
    mine = _describe_call(comm.rank, kind, dtype, shape, op, root, first_dim_free)
    gathered = np.full((comm.size, _FIELDS), -1, np.int64)
    handle = comm._submit_allgather(comm._name(None, "kolo.torch.agree"), mine, _FIELDS, gathered,
                                    gathered.size, kolo.INT64, None, keep=(mine,))
    handle.wait()
    present = {int(row[0]): row for row in gathered if row[0] >= 0}
    joined = [r for r in range(comm.size) if r not in present]
    first = next(iter(present.values()))
    if any(np.any(row[1:] != first[1:]) for row in present.values()):
        calls = "; ".join(f"rank {r}: {_call_text(row)}" for r, row in sorted(present.items()))
        raise kolo.MismatchError(f"{kind}: ranks disagree about the call ({calls})")
    return joined


def _refuse_joined(kind, joined):
    raise kolo.MismatchError(f"{kind}: rank{'s' if len(joined) > 1 else ''} "
                             f"{', '.join(map(str, joined))} ha{'ve' if len(joined) > 1 else 's'} "
                             f"joined (join()); as in Horovod, only allreduce goes on with ranks "
                             f"that have joined")


# ---- allreduce ----------------------------------------------------------------------------------

def _allreduce_into(tensor, output, name, op, prescale, postscale, process_set):
    """Reduces tensor into output (both contiguous; the same tensor: in place). Blocks."""
    comm = _comm(process_set)
    if tensor.is_cuda:
        if name is not None:
            raise UnsupportedError("named (fused) operations take CPU tensors only; GPU tensors "
                                   "use kolo's stream-ordered allreduce: pass no name")
        return _device_allreduce(tensor, output, op, prescale, postscale, comm)
    joined = _agree(comm, "allreduce", tensor, op) if name is None else []
    check_tensor(tensor)
    source, dtype = as_array(tensor)
    target, _ = as_array(output)
    if name is None and not joined:
        comm.raw_allreduce(source.ctypes.data if source.size else None,
                           target.ctypes.data if target.size else None, source.size,
                           kolo.communicator.kolo_dtype_of(source, dtype), op, prescale,
                           postscale)
    else:  # named, or some rank has joined: the fusion engine runs it with zeros for them
        name = comm._name(name, "allreduce")
        comm.raw_allreduce_async(name, source.ctypes.data if source.size else None,
                                 target.ctypes.data if target.size else None, source.size,
                                 kolo.communicator.kolo_dtype_of(source, dtype), op, prescale,
                                 postscale, keep=(source, target)).wait()
    return output


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, \
            process_set
        source = tensor.detach().contiguous()
        return _allreduce_into(source, torch.empty_like(source), name, op, prescale, postscale,
                               process_set)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.op not in (Sum, Average):
            raise NotImplementedError("the gradient of an allreduce is defined for Sum and "
                                      "Average only")
        grad = grad_output.contiguous()
        result = _allreduce_into(grad, torch.empty_like(grad), None, ctx.op, ctx.prescale,
                                 ctx.postscale, ctx.process_set)
        return result, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Returns a new tensor: the reduction (op: Average by default, Sum, Min, Max, Product) of
    tensor over the ranks of process_set, each input multiplied by prescale_factor and the result
    by postscale_factor. Differentiable: the gradient is the allreduce of the gradient. The input
    is only read. Blocks until done. Raises KoloError subclasses (MismatchError when ranks
    disagree), InvalidArgumentError for a bad dtype or op."""
    _require_tensor(tensor)
    from .compression import Compression
    compression = compression or Compression.none
    op = _resolve_op(average, op)
    compressed, context = compression.compress(tensor)
    reduced = _AllreduceFunction.apply(compressed, name, op, prescale_factor, postscale_factor,
                                       process_set)
    return compression.decompress(reduced, context)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """allreduce in place: tensor receives the result and is returned. Not differentiable.
    Blocks until done."""
    _require_tensor(tensor)
    op = _resolve_op(average, op)
    work, finish = _contiguous_target(tensor)
    _allreduce_into(work, work, name, op, prescale_factor, postscale_factor, process_set)
    return finish(work)


def _submit_allreduce(tensor, output, name, op, prescale, postscale, process_set, finish):
    comm = _comm(process_set)
    check_tensor(tensor)
    source, dtype = as_array(tensor)
    target, _ = as_array(output)
    name = comm._name(name, "allreduce")
    inner = comm.raw_allreduce_async(
        name, source.ctypes.data if source.size else None,
        target.ctypes.data if target.size else None, source.size,
        kolo.communicator.kolo_dtype_of(source, dtype), op, prescale, postscale,
        keep=(source, target, tensor, output))
    return _Handle(inner, lambda _: finish(output))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Submits the allreduce of a copy of tensor under name (any order across ranks) and returns
    a handle at once; synchronize(handle) returns the new tensor. Raises InvalidArgumentError at
    once for bad arguments or a name still pending."""
    _require_tensor(tensor)
    op = _resolve_op(average, op)
    source = tensor.detach().contiguous().clone()
    return _submit_allreduce(source, source, name, op, prescale_factor, postscale_factor,
                             process_set, lambda output: output)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """allreduce_async in place: tensor must not be used until synchronize(handle), which
    returns it holding the result."""
    _require_tensor(tensor)
    op = _resolve_op(average, op)
    work, finish = _contiguous_target(tensor)
    return _submit_allreduce(work, work, name, op, prescale_factor, postscale_factor,
                             process_set, finish)


# ---- grouped allreduce -----------------------------------------------------------------------

def _group_names(comm, name, n):
    base = comm._name(name, "grouped_allreduce")
    return [f"{base}.{i}" for i in range(n)]


def _submit_group(tensors, outputs, name, op, prescale, postscale, process_set):
    comm = _comm(process_set)
    if not tensors:
        raise InvalidArgumentError("grouped_allreduce needs at least one tensor")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise InvalidArgumentError(f"grouped_allreduce needs tensors of one dtype, not "
                                   f"{sorted(str(d) for d in dtypes)}")
    arrays = []
    for i, (tensor, output) in enumerate(zip(tensors, outputs)):
        check_tensor(tensor, f"tensor {i}")
        arrays.append((as_array(tensor), as_array(output)[0]))
    kind = kolo.communicator.kolo_dtype_of(arrays[0][0][0], arrays[0][0][1])
    return comm.raw_allreduce_group_async(
        _group_names(comm, name, len(tensors)),
        [a[0][0].ctypes.data if a[0][0].size else None for a in arrays],
        [a[1].ctypes.data if a[1].size else None for a in arrays],
        [a[0][0].size for a in arrays], kind, op, prescale, postscale,
        keep=(arrays, tensors, outputs))


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, \
            process_set
        sources = [t.detach().contiguous() for t in tensors]
        outputs = [s.clone() for s in sources]
        _submit_group(outputs, outputs, name, op, prescale, postscale, process_set).wait()
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.op not in (Sum, Average):
            raise NotImplementedError("the gradient of an allreduce is defined for Sum and "
                                      "Average only")
        outputs = [g.contiguous().clone() for g in grads]
        _submit_group(outputs, outputs, None, ctx.op, ctx.prescale, ctx.postscale,
                      ctx.process_set).wait()
        return (None, None, None, None, None) + tuple(outputs)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduces a list of tensors of one dtype together (one fused kolo collective) and returns
    the list of new tensors. Differentiable. Blocks until done."""
    if not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError("tensors must be a list of tensors")
    for i, tensor in enumerate(tensors):
        _require_tensor(tensor, f"tensor {i}")
    from .compression import Compression
    compression = compression or Compression.none
    op = _resolve_op(average, op)
    compressed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduceFunction.apply(name, op, prescale_factor, postscale_factor,
                                              process_set, *[c[0] for c in compressed])
    return [compression.decompress(r, c[1]) for r, c in zip(reduced, compressed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """grouped_allreduce in place; returns the tensors. Blocks until done."""
    if not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError("tensors must be a list of tensors")
    for i, tensor in enumerate(tensors):
        _require_tensor(tensor, f"tensor {i}")
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Submits a grouped allreduce of copies; synchronize(handle) returns the new tensors."""
    if not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError("tensors must be a list of tensors")
    for i, tensor in enumerate(tensors):
        _require_tensor(tensor, f"tensor {i}")
    op = _resolve_op(average, op)
    outputs = [t.detach().contiguous().clone() for t in tensors]
    inner = _submit_group(outputs, outputs, name, op, prescale_factor, postscale_factor,
                          process_set)
    return _Handle(inner, lambda _: outputs)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Submits a grouped allreduce in place; synchronize(handle) returns the tensors."""
    if not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError("tensors must be a list of tensors")
    for i, tensor in enumerate(tensors):
        _require_tensor(tensor, f"tensor {i}")
    op = _resolve_op(average, op)
    works = [_contiguous_target(t) for t in tensors]
    inner = _submit_group([w for w, _ in works], [w for w, _ in works], name, op,
                          prescale_factor, postscale_factor, process_set)
    return _Handle(inner, lambda _: [finish() for _, finish in works])


# ---- allgather -------------------------------------------------------------------------------

def _allgather(tensor, name, process_set):
    comm = _comm(process_set)
    if name is None:
        joined = _agree(comm, "allgather", tensor, first_dim_free=True)
        if joined:
            _refuse_joined("allgather", joined)
    check_tensor(tensor)
    source, dtype = as_array(tensor.detach().contiguous())
    if name is None:
        result, rows = comm.allgather_rows(source, dtype)
    else:
        handle = comm.allgather_async(source, name=name, dtype=dtype)
        result = handle.wait()
        rows = handle.rows_per_rank()
    return from_array(result, tensor.dtype), rows


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        output, rows = _allgather(tensor, name, process_set)
        ctx.rows, ctx.process_set = rows, process_set
        ctx.rank = _comm(process_set).rank
        return output

    @staticmethod
    def backward(ctx, grad_output):
        # Horovod's: the average of the ranks' gradients (each rank's loss weighs 1/size)
        grad = grad_output.contiguous()
        averaged = _allreduce_into(grad, torch.empty_like(grad), None, Average, 1.0, 1.0,
                                   ctx.process_set)
        start = sum(ctx.rows[:ctx.rank])
        return averaged.narrow(0, start, ctx.rows[ctx.rank]), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Returns a new tensor: every rank's tensor concatenated along the first dimension in rank
    order (first dimensions may differ; the others must agree, else MismatchError on every
    rank). Differentiable as in Horovod: the gradient is this rank's slice of the average of the
    ranks' gradients. Blocks."""
    _require_tensor(tensor)
    if tensor.dim() == 0:
        raise InvalidArgumentError("allgather needs a tensor of at least one dimension")
    return _AllgatherFunction.apply(tensor, name, process_set)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Submits an allgather of a copy of tensor; synchronize(handle) returns the gathered
    tensor. Does not block."""
    _require_tensor(tensor)
    comm = _comm(process_set)
    check_tensor(tensor)
    if tensor.dim() == 0:
        raise InvalidArgumentError("allgather needs a tensor of at least one dimension")
    source, dtype = as_array(tensor.detach().contiguous().clone())
    inner = comm.allgather_async(source, name=name, dtype=dtype)
    return _Handle(inner, lambda result: from_array(result, tensor.dtype))


# ---- broadcast -------------------------------------------------------------------------------

def _set_rank(process_set, rank, what="root_rank"):
    """The index in process_set of the global rank `rank`, as Horovod numbers roots: by their
    rank in the job. ValueError when it is not a member."""
    process_set = process_set or global_process_set
    if process_set is global_process_set:
        return rank
    try:
        return process_set.ranks.index(int(rank))
    except ValueError:
        raise InvalidArgumentError(f"{what} {rank} is not a member of {process_set} (roots are "
                                   f"ranks of the job, as in Horovod)") from None


def _broadcast_inplace(tensor, root_rank, name, process_set):
    comm = _comm(process_set)
    root = _set_rank(process_set, root_rank)
    if tensor.is_cuda:
        if name is not None:
            raise UnsupportedError("named (fused) operations take CPU tensors only")
        return _device_broadcast(tensor, root, comm)
    if name is None:
        joined = _agree(comm, "broadcast", tensor, root=root)
        if joined:
            _refuse_joined("broadcast", joined)
    check_tensor(tensor)
    array, dtype = as_array(tensor)
    if name is None:
        comm.broadcast_(array, root=root, dtype=dtype)
    else:
        comm.broadcast_async_(array, root=root, name=name, dtype=dtype).wait()
    return tensor


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast_inplace(tensor.detach().contiguous().clone(), root_rank, name,
                                  process_set)

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous()
        reduced = _allreduce_into(grad, torch.empty_like(grad), None, Average, 1.0, 1.0,
                                  ctx.process_set)
        if _comm(ctx.process_set).rank != _set_rank(ctx.process_set, ctx.root_rank):
            reduced.zero_()
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns a new tensor holding root_rank's tensor (every rank passes one of the same shape
    and dtype). Differentiable as in Horovod: the root's gradient is the average of the ranks'
    gradients, the others' zero. Blocks. InvalidArgumentError for a root outside the set."""
    _require_tensor(tensor)
    return _BroadcastFunction.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """broadcast in place: tensor receives root_rank's values and is returned. Blocks."""
    _require_tensor(tensor)
    work, finish = _contiguous_target(tensor)
    _broadcast_inplace(work, root_rank, name, process_set)
    return finish()


def _submit_broadcast(work, root_rank, name, process_set, finish):
    comm = _comm(process_set)
    root = _set_rank(process_set, root_rank)
    check_tensor(work)
    array, dtype = as_array(work)
    inner = comm.broadcast_async_(array, root=root, name=name, dtype=dtype)
    return _Handle(inner, finish)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Submits a broadcast of a copy of tensor from root_rank; synchronize(handle) returns the
    new tensor."""
    _require_tensor(tensor)
    work = tensor.detach().contiguous().clone()
    return _submit_broadcast(work, root_rank, name, process_set, lambda _: work)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Submits a broadcast into tensor itself; synchronize(handle) returns it."""
    _require_tensor(tensor)
    work, finish = _contiguous_target(tensor)
    return _submit_broadcast(work, root_rank, name, process_set, finish)


# ---- alltoall and reducescatter ------------------------------------------------------------

def _alltoall(tensor, splits, process_set):
    comm = _comm(process_set)
    joined = _agree(comm, "alltoall", tensor, first_dim_free=True)
    if joined:
        _refuse_joined("alltoall", joined)
    check_tensor(tensor)
    source, dtype = as_array(tensor.detach().contiguous())
    result, received = comm.alltoall(source, splits=splits, dtype=dtype)
    return from_array(result, tensor.dtype), received.tolist()


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set):
        output, received = _alltoall(tensor, splits, process_set)
        ctx.received, ctx.process_set = received, process_set
        received_splits = torch.tensor(received, dtype=torch.int32)
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, _grad_splits):
        grad, _ = _alltoall(grad_output, ctx.received, ctx.process_set)
        return grad, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends splits[p] rows (first-dimension slices, in rank order) of tensor to rank p and
    returns what every rank sent here, concatenated in rank order; with splits given, returns
    (tensor, received_splits). splits None: the first dimension divided evenly (a multiple of
    the set's size). Differentiable. Blocks (two collectives). name is accepted and unused."""
    _require_tensor(tensor)
    if tensor.dim() == 0:
        raise InvalidArgumentError("alltoall needs a tensor of at least one dimension")
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or \
                splits.dtype == torch.bool:
            raise InvalidArgumentError(
                f"alltoall: splits must be a tensor of integers (row counts), not {splits.dtype}")
        splits = splits.tolist()
    output, received = _AlltoallFunction.apply(tensor, splits, process_set)
    return output if splits is None else (output, received)


def _scaled(tensor, factor):
    """tensor times factor in tensor's dtype: integers are scaled in float64 and truncated, as
    Horovod scales them; half types in float32."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() and tensor.element_size() >= 4:
        return tensor * factor
    wide = torch.float32 if tensor.is_floating_point() else torch.float64
    return (tensor.to(wide) * factor).to(tensor.dtype)


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, process_set):
        comm = _comm(process_set)
        joined = _agree(comm, "reducescatter", tensor, op)
        if joined:
            _refuse_joined("reducescatter", joined)
        check_tensor(tensor)
        source = _scaled(tensor.detach().contiguous(), prescale)
        array, dtype = as_array(source)
        result = _scaled(from_array(comm.reduce_scatter(array, op=op, dtype=dtype),
                                    tensor.dtype), postscale)
        ctx.op, ctx.scale, ctx.process_set = op, prescale * postscale, process_set
        return result

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.op not in (Sum, Average):
            raise NotImplementedError("the gradient of reducescatter is defined for Sum and "
                                      "Average only")
        # Horovod's: the gathered gradients, times size for Sum (each rank's loss weighs 1/size
        # under Average, as for allgather), times the scale factors
        grad, _ = _allgather(grad_output.contiguous(), None, ctx.process_set)
        scale = ctx.scale * (_comm(ctx.process_set).size if ctx.op == Sum else 1)
        return grad * scale, None, None, None, None


def reducescatter(tensor, name=None, compression=None, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces tensor (the same shape on every rank) with op (Average or Sum) and returns this
    rank's share of the first dimension: rows // size each, one more for the first rows % size
    ranks. Differentiable. Blocks. name is accepted and unused."""
    _require_tensor(tensor)
    from .compression import Compression
    compression = compression or Compression.none
    if op not in (Sum, Average, Min, Max, Product):
        raise InvalidArgumentError(f"unknown op {op!r}")
    if tensor.dim() == 0:
        raise InvalidArgumentError("reducescatter needs a tensor of at least one dimension")
    compressed, context = compression.compress(tensor)
    result = _ReducescatterFunction.apply(compressed, op, prescale_factor, postscale_factor,
                                          process_set)
    return compression.decompress(result, context)


# ---- barrier and join ------------------------------------------------------------------------

def barrier(process_set=global_process_set):
    """Returns once every rank of process_set has entered the barrier. Blocks (bounded)."""
    comm = _comm(process_set)
    joined = _agree(comm, "barrier")
    if joined:
        _refuse_joined("barrier", joined)
    comm.barrier()


def join(device=-1):
    """Horovod's join, for uneven data: this rank has run out of batches. Until every rank has
    joined, the allreduces the others submit (DistributedOptimizer's gradients, the _async calls)
    run with zeros for this rank, so Average divides their sum by size(), as in Horovod; their
    named allgathers get no rows from it; their broadcasts, unnamed allgathers, alltoalls,
    reducescatters and barriers raise, as Horovod's do. Blocks until every rank has
    joined (bounded by KOLO_TIMEOUT) and returns the rank that joined last, the same on every
    rank: a rank that joined early has missed the last updates, so broadcast the parameters from
    that rank afterwards (broadcast_parameters(model.state_dict(), root_rank=join())). Works on
    the global process set, whose named operations it covers; `device` is accepted for Horovod's
    signature (kolo's named operations take CPU tensors)."""
    del device
    world = _world()
    last = world.join()
    # The ranks that joined early skipped the agreements (and automatic names) of the calls made
    # meanwhile; every rank starts counting again here, where all of them are.
    world._names = itertools.count()
    return last


# ---- composite and derived operations --------------------------------------------------------

class _GroupHandle:
    """The handle of several kolo.torch operations submitted together: poll() is True once all
    have completed; wait() returns finish(list of their outputs)."""

    def __init__(self, handles, finish=list):
        self._handles = handles
        self._finish = finish
        self._done = False
        self._value = None

    def poll(self):
        """True once every part has completed. Never blocks."""
        return all(handle.poll() for handle in self._handles)

    def wait(self):
        """Blocks (each part bounded by KOLO_TIMEOUT) and returns the outputs; raises the first
        part's KoloError (the other parts are still waited for, so none is left pending)."""
        if not self._done:
            outputs, error = [], None
            for handle in self._handles:
                try:
                    outputs.append(handle.wait())
                except kolo.KoloError as failure:
                    error = error or failure
            if error is not None:
                raise error
            self._value = self._finish(outputs)
            self._done = True
        return self._value

    synchronize = wait


class _DoneHandle:
    """The handle of an operation that ran when it was submitted."""

    def __init__(self, value):
        self._value = value

    def poll(self):
        return True

    def wait(self):
        return self._value

    synchronize = wait


def _my_rows(comm, rows):
    """This rank's slice of `rows` under reducescatter's split (Horovod's: rows // size each,
    one more for the first rows % size ranks)."""
    counts = kolo.communicator.split_rows(rows, comm.size)
    return sum(counts[:comm.rank]), counts[comm.rank]


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Submits the reducescatter of a copy of tensor under name (any order across ranks) and
    returns a handle at once; synchronize(handle) returns this rank's share of the first
    dimension, split as reducescatter splits it. It runs as a named allreduce of the whole
    tensor in kolo's fusion engine (fused with other named operations), then keeps this rank's
    rows: twice the bytes of a reduce-scatter, for Horovod's any-order semantics. Raises
    InvalidArgumentError at once for bad arguments or a name still pending."""
    _require_tensor(tensor)
    if op not in (Sum, Average, Min, Max, Product):
        raise InvalidArgumentError(f"unknown op {op!r}")
    if tensor.dim() == 0:
        raise InvalidArgumentError("reducescatter needs a tensor of at least one dimension")
    comm = _comm(process_set)
    handle = allreduce_async(tensor, name=comm._name(name, "reducescatter"), op=op,
                             prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, process_set=process_set)
    start, rows = _my_rows(comm, tensor.shape[0])
    return _GroupHandle([handle], lambda outputs: outputs[0].narrow(0, start, rows).clone())


def grouped_reducescatter(tensors, name=None, compression=None, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """reducescatter of each tensor of the list, in order; returns the list of this rank's
    shares. Differentiable. Blocks. name is accepted and unused."""
    if not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError("tensors must be a list of tensors")
    return [reducescatter(t, compression=compression, op=op, process_set=process_set,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor)
            for t in tensors]


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Submits reducescatter_async of every tensor of the list under name.0, name.1, ...;
    synchronize(handle) returns the list of this rank's shares."""
    if not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError("tensors must be a list of tensors")
    base = _comm(process_set)._name(name, "grouped_reducescatter")
    return _GroupHandle([reducescatter_async(t, f"{base}.{i}", op, process_set, prescale_factor,
                                             postscale_factor) for i, t in enumerate(tensors)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of each tensor of the list, in order; returns the list of gathered tensors.
    Differentiable. Blocks. name is accepted and unused."""
    if not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError("tensors must be a list of tensors")
    return [allgather(t, process_set=process_set) for t in tensors]


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Submits allgather_async of every tensor of the list under name.0, name.1, ...;
    synchronize(handle) returns the list of gathered tensors."""
    if not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError("tensors must be a list of tensors")
    base = _comm(process_set)._name(name, "grouped_allgather")
    return _GroupHandle([allgather_async(t, f"{base}.{i}", process_set)
                         for i, t in enumerate(tensors)])


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """alltoall, run when it is submitted (kolo has no named alltoall: every rank must submit
    its alltoalls in the same order); synchronize(handle) returns what alltoall returns."""
    return _DoneHandle(alltoall(tensor, splits, name, process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Horovod's allreduce of a sparse COO tensor (the gradient of a sparse embedding): gathers
    every rank's indices and values (named allgathers name.indices and name.values) and returns
    a function that waits for them and returns the sparse tensor of all of them (duplicate
    indices are summed when the tensor is coalesced), divided by the set's size for Average."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise InvalidArgumentError("sparse_allreduce_async needs a sparse COO tensor")
    if op not in (Sum, Average):
        raise InvalidArgumentError("sparse_allreduce_async supports Sum and Average only")
    sparse = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates along the first dimension: one row per non-zero entry
    indices = allgather_async(sparse.indices().t().contiguous(), f"{name}.indices", process_set)
    values = allgather_async(sparse.values(), f"{name}.values", process_set)
    members = _comm(process_set).size

    def finish():
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / members
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.size())
    return finish
